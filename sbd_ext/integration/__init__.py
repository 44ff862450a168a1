"""sbd_ext where HuggingFace users already are: ``model.generate``, streamers and ``pipeline("text-generation")``
decode with SBD through transformers' ``custom_generate`` hook.

* :data:`CUSTOM_GENERATE_DIR` -- the folder shipped in the package (``custom_generate/generate.py`` +
  ``requirements.txt``): ``model.generate(**inputs, custom_generate=str(CUSTOM_GENERATE_DIR),
  trust_remote_code=True)`` runs :func:`sbd_ext.integration.hf_generate.generate` on any SBD model in memory.
* :func:`save_pretrained` -- ``model.save_pretrained`` plus that folder, so that
  ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True).generate(...)`` decodes with SBD.
"""

from __future__ import annotations

from .hf_generate import CUSTOM_GENERATE_DIR, SBDGenerateDecoderOnlyOutput, generate, save_pretrained

__all__ = ["CUSTOM_GENERATE_DIR", "SBDGenerateDecoderOnlyOutput", "generate", "save_pretrained"]
