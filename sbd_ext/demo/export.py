"""An embedded model saved as a transformers checkpoint that decodes with SBD wherever transformers decodes:
``model.generate``, streamers, ``pipeline("text-generation")`` and ``transformers serve`` (``sbd-ext export``).

The folder holds the weights, the tokenizer with a chat template (the model's own prompt format, when the tokenizer
has none), ``generation_config.json`` with the model's recommended SBD settings (``sbd_block_size``, ``sbd_sampler``,
``sbd_threshold``, ``sbd_verify``: from its ``sbd_demo.json``) and ``custom_generate/`` (loaded by
``from_pretrained(dir, trust_remote_code=True)``). ``plain=True`` saves the same files without ``custom_generate/``
and without SBD settings: the checkpoint as transformers serves any next-token model (the NTP control, served
plainly, for comparisons).

The chat template writes the BOS token as text, so the saved tokenizer maps special-token strings in a message to
the special tokens (``split_special_tokens`` off, as in most chat tokenizers); the embedded tokenizers themselves keep
typed ``<eos>`` as text.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..integration import save_pretrained
from ..integration.chat import chat_template_for
from . import models

__all__ = ["export", "recommended_settings"]


def recommended_settings(info: dict) -> dict:
    """The ``sbd_*`` generation-config fields a model's ``sbd_demo.json`` recommends (objective "sbd" only)."""
    if info.get("objective", "sbd") != "sbd" or "block_size" not in info:
        return {}
    fields = {"sbd_block_size": int(info["block_size"]), "sbd_sampler": info.get("sampler", "eb")}
    if "gamma_low" in info:
        fields["sbd_threshold"] = float(info["gamma_low"])
    if info.get("verify"):
        fields["sbd_verify"] = True
    return fields


def export(name_or_path: str | Path, dest: str | Path, plain: bool = False, dtype: torch.dtype = torch.float32) -> Path:
    """Save the embedded model ``name_or_path`` (or a model folder / SBD artifact) to ``dest`` as described in the
    module docstring; returns ``dest``. ``dest`` must not hold a checkpoint already."""
    dest = Path(dest)
    if (dest / "config.json").exists():
        raise FileExistsError(f"{dest} already holds a checkpoint (config.json); choose an empty folder")
    info = models.demo_info(name_or_path)
    model, tok = models.load(name_or_path, dtype=dtype, attn_implementation="sdpa")
    if not getattr(tok, "chat_template", None):
        template = info.get("prompt_template")
        if not template:
            raise ValueError(f"{name_or_path}: the tokenizer has no chat template and sbd_demo.json no prompt_template")
        tok.chat_template = chat_template_for(template)
        # The template writes the BOS token as text: it must map to the special token, not to its characters.
        tok.split_special_tokens = False
    gc = model.generation_config
    for key in [k for k in vars(gc) if k.startswith("sbd_")]:
        delattr(gc, key)
    if plain:
        model.save_pretrained(dest)
    else:
        fields = recommended_settings(info)
        for key, value in fields.items():
            setattr(gc, key, value)
        save_pretrained(model, dest)
    tok.save_pretrained(dest)
    return dest
