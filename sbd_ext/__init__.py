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

# The HuggingFace layer (attention backend "sbd", SBD decoding) needs transformers; the ops work without it.
try:
    import transformers  # noqa: F401
except ImportError as _e:  # pragma: no cover - only without transformers
    _HF_IMPORT_ERROR: ImportError | None = _e
else:
    _HF_IMPORT_ERROR = None
    from . import decoding, hf  # noqa: E402, F401  (importing hf registers attn_implementation="sbd")
    from .decoding import SBDCache, generate, generate_reference  # noqa: E402, F401

_HF_NAMES = ("hf", "decoding", "SBDCache", "generate", "generate_reference")


def __getattr__(name: str):
    if name in _HF_NAMES and _HF_IMPORT_ERROR is not None:
        raise ImportError(f"sbd_ext.{name} needs transformers (pip install transformers)") from _HF_IMPORT_ERROR
    raise AttributeError(f"module 'sbd_ext' has no attribute {name!r}")


__version__ = "0.1.0"


def build_info() -> dict:
    """How the compiled extension was built (CUDA kernels present, debug, torch version)."""
    return dict(_C.build_info())


__all__ = [
    "block_attention",
    "entropy_sample",
    "mask_replace",
    "reference",
    "build_info",
    "__version__",
    *_HF_NAMES,
]
