"""sbd_ext: Set Block Decoding (Gat et al. 2025) for HuggingFace Llama-family models.

``import sbd_ext`` loads the compiled kernels (registering ``torch.ops.sbd_ext.*``) and the core Python layer:
ops, references, the ``"sbd"`` attention backend, the cache, decoding and the SBD metadata. Training is
``sbd_ext.training`` (imported on use); the demo (``sbd_ext.demo``: tasks, embedded models, CLI) and the recipes
(``sbd_ext.recipes``: SmolLM2) sit above the core and are never imported by it.
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
from .ops import block_attention, entropy_sample, mask_replace, row_linear  # noqa: E402
from .quantization import quantize  # noqa: E402

# The HuggingFace layer (attention backend "sbd", cache, decoding). transformers is a dependency, but a version whose
# internals moved must not take the ops down with it: the ops stay importable and the HF names raise an error that
# says what failed.
# transformers 5.24 renamed ``past_key_values`` to ``cache`` across forward arguments and model outputs; the HF layer
# is written against 5.17-5.23 (pyproject pins ``<5.24``). With a newer one installed (e.g. ``--no-deps``), the HF names
# raise an error that says so instead of failing somewhere inside a forward.
TRANSFORMERS_SUPPORTED = ("5.17", "5.24")  # [lowest, first unsupported)


def _transformers_too_new() -> str | None:
    import transformers

    major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2] if x.isdigit())
    if major_minor >= tuple(int(x) for x in TRANSFORMERS_SUPPORTED[1].split(".")):
        return (
            f"transformers {transformers.__version__} is newer than sbd_ext supports (>={TRANSFORMERS_SUPPORTED[0]}, "
            f"<{TRANSFORMERS_SUPPORTED[1]}: 5.24 renamed past_key_values to cache); pip install "
            f"'transformers>={TRANSFORMERS_SUPPORTED[0]},<{TRANSFORMERS_SUPPORTED[1]}'"
        )
    return None


try:
    if (_too_new := _transformers_too_new()) is not None:
        raise ImportError(_too_new)
    from . import cache, decoding, hf, metadata  # noqa: E402, F401  (importing hf registers attn_implementation="sbd")
    from .cache import SBDCache  # noqa: E402, F401
    from .decoding import GenerationSettings, generate, generate_reference  # noqa: E402, F401
    from .integration.hf_generate import warn_next_token_generate as _warn_next_token  # noqa: E402

    _warn_next_token()  # transformers' own generate on an SBD model (its SBD generate not loaded) warns once
except (ImportError, AttributeError) as _e:  # pragma: no cover - only with an incompatible transformers
    _HF_IMPORT_ERROR: Exception | None = _e
else:
    _HF_IMPORT_ERROR = None

_HF_NAMES = ("hf", "cache", "decoding", "metadata", "SBDCache", "GenerationSettings", "generate", "generate_reference")


def __getattr__(name: str):
    if name in _HF_NAMES and _HF_IMPORT_ERROR is not None:
        import transformers

        raise ImportError(
            f"sbd_ext.{name} could not be loaded with transformers {transformers.__version__}: "
            f"{type(_HF_IMPORT_ERROR).__name__}: {_HF_IMPORT_ERROR}. The ops (sbd_ext.block_attention, "
            "entropy_sample, mask_replace) work; install a transformers version sbd_ext supports (see pyproject.toml)."
        ) from _HF_IMPORT_ERROR
    raise AttributeError(f"module 'sbd_ext' has no attribute {name!r}")


__version__ = "0.2.0"


def build_info() -> dict:
    """How the compiled extension was built (CUDA kernels present, debug, torch version)."""
    return dict(_C.build_info())


__all__ = [
    "block_attention",
    "entropy_sample",
    "mask_replace",
    "row_linear",
    "quantize",
    "reference",
    "build_info",
    "__version__",
    *_HF_NAMES,
]
