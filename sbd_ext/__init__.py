"""sbd_ext: Set Block Decoding (Gat et al. 2025) for HuggingFace Llama-family models.

``import sbd_ext`` loads the compiled kernels (registering ``torch.ops.sbd_ext.*``) and the Python layer.
"""

from __future__ import annotations

import torch  # noqa: F401  (loads libtorch, which _C links against)

try:
    from . import _C  # noqa: F401  (loading it registers the ops with the dispatcher)
except ImportError as e:  # pragma: no cover - only when the package was not built
    raise ImportError(
        "sbd_ext's compiled extension (sbd_ext._C) is missing. Install the package with `pip install .` "
        "(see README.md), or build it in place with `python setup.py build_ext --inplace`. If you ran Python from "
        "the source checkout, the un-built source folder may be shadowing the installed package."
    ) from e

from . import reference  # noqa: E402
from .ops import block_attention, entropy_sample, mask_replace  # noqa: E402

__version__ = "0.1.0"


def build_info() -> dict:
    """How the compiled extension was built (CUDA kernels present, debug, torch version)."""
    return dict(_C.build_info())


__all__ = ["block_attention", "entropy_sample", "mask_replace", "reference", "build_info", "__version__"]
