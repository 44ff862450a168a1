"""The drafter's artifact: a folder in peft's layout that peft refuses to apply ungated (see
:mod:`sbd_ext.drafter`)."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import torch
from torch import nn

from ..adapters import resolve_base_loader
from ..metadata import set_sbd_metadata
from .gate import attach, get_drafter

PEFT_TYPE = "SBD_GATED_LORA"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CHECKPOINT_SUBFOLDER = "sbd_drafter"  # where an exported checkpoint keeps its drafter (sbd-ext export)
_MASK_ROW_KEY = "sbd_mask_row"
_PREFIX = "base_model.model."


def save_drafter(
    model: nn.Module,
    folder: str | Path,
    sbd: dict,
    base_model_name_or_path: str = "",
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Write the drafter of ``model`` into ``folder`` (see module doc); ``sbd``: the SBD fields (``base_loader``,
    ``sbd_block_size_range``, ``generation``, provenance). The LoRA factors are stored in ``dtype`` (bf16: half the
    size; the drafter only drafts, so its rounding never changes verified output), the mask row in fp32. Returns
    the folder's size in bytes."""
    from safetensors.torch import save_file

    drafter = get_drafter(model)
    if drafter is None:
        raise ValueError("save_drafter: the model has no gated drafter")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, m in drafter.lora_modules(model):
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = m.lora_A.detach().to(dtype).cpu().contiguous()
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = m.lora_B.detach().to(dtype).cpu().contiguous()
    tensors[_MASK_ROW_KEY] = drafter.mask_row.row.detach().float().cpu().contiguous()
    save_file(tensors, folder / WEIGHTS_FILE)
    config = {
        "peft_type": PEFT_TYPE,
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": drafter.rank,
        "lora_alpha": drafter.alpha,
        "target_modules": list(drafter.targets),
        "sbd": {"gated": True, "mask_token_id": drafter.mask_token_id, **sbd},
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def is_drafter(folder: str | Path) -> bool:
    """Whether ``folder`` holds a gated drafter artifact."""
    f = Path(folder) / CONFIG_FILE
    if not f.is_file() or not (Path(folder) / WEIGHTS_FILE).is_file():
        return False
    try:
        return json.loads(f.read_text()).get("peft_type") == PEFT_TYPE
    except (ValueError, AttributeError):
        return False


def read_drafter_config(folder: str | Path) -> dict:
    """The drafter's ``adapter_config.json``, checked field by field (errors name the file and the field)."""
    path = Path(folder) / CONFIG_FILE
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{folder} is not a drafter folder: {CONFIG_FILE} is missing") from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    if cfg.get("peft_type") != PEFT_TYPE:
        raise ValueError(f"{path}: peft_type is {cfg.get('peft_type')!r}, not {PEFT_TYPE!r}")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{path}: field 'r' must be an int >= 1, got {r!r}")
    a = cfg.get("lora_alpha")
    if not isinstance(a, (int, float)) or isinstance(a, bool) or not math.isfinite(a):
        raise ValueError(f"{path}: field 'lora_alpha' must be a finite number, got {a!r}")
    t = cfg.get("target_modules")
    if not isinstance(t, list) or not t or not all(isinstance(x, str) for x in t):
        raise ValueError(f"{path}: field 'target_modules' must be a non-empty list of names, got {t!r}")
    sbd = cfg.get("sbd")
    if not isinstance(sbd, dict) or sbd.get("gated") is not True:
        raise ValueError(f"{path}: field 'sbd' must be an object with \"gated\": true")
    m = sbd.get("mask_token_id")
    if not isinstance(m, int) or isinstance(m, bool) or m < 0:
        raise ValueError(f"{path}: field 'sbd.mask_token_id' must be an int >= 0, got {m!r}")
    rng = sbd.get("sbd_block_size_range")
    if (
        not isinstance(rng, list)
        or len(rng) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in rng)
        or not 1 <= rng[0] <= rng[1]
    ):
        raise ValueError(f"{path}: field 'sbd.sbd_block_size_range' must be [lo, hi] with 1 <= lo <= hi, got {rng!r}")
    return cfg


@torch.no_grad()
def load_weights(model: nn.Module, folder: str | Path, cfg: dict | None = None) -> dict:
    """Attach a drafter to ``model`` (the base, mask token in its vocabulary) from ``folder``; returns the config."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = read_drafter_config(folder) if cfg is None else cfg
    path = folder / WEIGHTS_FILE
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: cannot read the drafter's weights ({e})") from None
    sbd = cfg["sbd"]
    attach(model, sbd["mask_token_id"], rank=cfg["r"], alpha=cfg["lora_alpha"], targets=cfg["target_modules"])
    drafter = get_drafter(model)
    mods = dict(drafter.lora_modules(model))
    names = {k[len(_PREFIX) :].rsplit(".", 2)[0] for k in tensors if k.startswith(_PREFIX)}
    if names != set(mods):
        raise ValueError(
            f"{path}: adapts {len(names)} layers, the model has {len(mods)} for targets "
            f"{cfg['target_modules']} (missing: {sorted(set(mods) - names)[:3]}, "
            f"unknown: {sorted(names - set(mods))[:3]})"
        )
    for name, m in mods.items():
        for part in ("lora_A", "lora_B"):
            key = f"{_PREFIX}{name}.{part}.weight"
            src, dst = tensors.get(key), getattr(m, part)
            if src is None:
                raise ValueError(f"{path}: tensor {key} is missing")
            if src.shape != dst.shape:
                raise ValueError(
                    f"{path}: {key} is {tuple(src.shape)}, the model needs {tuple(dst.shape)} "
                    f"(rank 'r' = {cfg['r']} in {CONFIG_FILE})"
                )
            if not torch.isfinite(src).all():
                raise ValueError(f"{path}: {key} holds NaN or inf")
            dst.copy_(src.to(dst.dtype))
    row = tensors.get(_MASK_ROW_KEY)
    if row is None or row.shape != drafter.mask_row.row.shape:
        raise ValueError(
            f"{path}: {_MASK_ROW_KEY} must be a [{drafter.mask_row.row.shape[0]}] tensor, got "
            f"{None if row is None else tuple(row.shape)}"
        )
    if not torch.isfinite(row).all():
        raise ValueError(f"{path}: {_MASK_ROW_KEY} holds NaN or inf")
    drafter.mask_row.row.copy_(row.to(drafter.mask_row.row.dtype))
    for p in model.parameters():
        p.requires_grad_(False)
    return cfg


def load_drafter(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sbd",
    device: str | torch.device | None = None,
    trust_base_loader: bool = False,
):
    """``(model, tokenizer)``: the base model the drafter names (its ``base_loader``, imported only if it is a known
    loader or ``trust_base_loader``: see :func:`sbd_ext.adapters.resolve_base_loader`) with the drafter attached
    (gated, not merged), the SBD metadata set, its recommended decoding settings on ``model.generation_config``."""
    folder = Path(folder)
    cfg = read_drafter_config(folder)
    sbd = cfg["sbd"]
    loader = resolve_base_loader(sbd.get("base_loader", ""), folder / CONFIG_FILE, trust=trust_base_loader)
    model, tok = loader(attn_implementation=attn_implementation)
    load_weights(model, folder, cfg)
    set_sbd_metadata(model, int(sbd["mask_token_id"]), tuple(sbd["sbd_block_size_range"]))
    for key, value in sbd.get("generation", {}).items():
        setattr(model.generation_config, key, value)
    model.to(dtype)
    if device is not None:
        model.to(device)
    return model.eval(), tok


_ATTACH_LOCK = threading.Lock()


def attach_from_checkpoint(model: nn.Module) -> bool:
    """Attach the drafter an exported checkpoint carries (``<checkpoint>/sbd_drafter/``, written by ``sbd-ext
    export``) to ``model`` loaded from that checkpoint, once; returns whether the model has a drafter afterwards.
    Called by ``model.generate``'s SBD path (``custom_generate``), so a checkpoint loaded with
    ``from_pretrained(dir, trust_remote_code=True)`` decodes with its drafter without any other step."""
    if get_drafter(model) is not None:
        return True
    folder = Path(str(getattr(model, "name_or_path", "") or "")) / CHECKPOINT_SUBFOLDER
    if not is_drafter(folder):
        return False
    with _ATTACH_LOCK:
        if get_drafter(model) is None:
            load_weights(model, folder)
            model.eval()
    return True
