"""The drafter's artifact: a folder in peft's layout that peft refuses to apply ungated (see
:mod:`sbd_ext.drafter`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
from torch import nn

from ..artifact_checks import (
    ArtifactError,
    Field,
    check_config,
    check_finite,
    check_lora_factors,
    check_token_id,
    load_on_base,
    load_tensor_file,
    lora_pairs,
    read_json_config,
    resolve_base_loader,
    tensor_shapes,
)
from ..decoding.lookup import DraftStore
from ..metadata import get_sbd_metadata, set_sbd_metadata
from .gate import attach, detach, get_drafter
from .sampler_head import SamplerHead

PEFT_TYPE = "SBD_GATED_LORA"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CHECKPOINT_SUBFOLDER = "sbd_drafter"  # where an exported checkpoint keeps its drafter (sbd-ext export)
_MASK_ROW_KEY = "sbd_mask_row"
_HEAD_PREFIX = "sbd_sampler_head."  # the sampler head's tensors (w1, b1, w2, b2, a), where the drafter has one
STORE_PREFIX = "sbd_draft_store."  # the draft store's table (keys, next), where the drafter has one
_STORE_KEYS, _STORE_NEXT = STORE_PREFIX + "keys", STORE_PREFIX + "next"
# A draft store's entries at most (~0.6 GB as the table's Python dict; a crafted config allocates nothing past this;
# the shipped store has 86,035)
MAX_STORE_ENTRIES = 1 << 22
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
    head = drafter.sampler_head
    if head is not None:
        for n, t in head.state_dict().items():
            tensors[_HEAD_PREFIX + n] = t.detach().to(dtype).cpu().contiguous()
        sbd = {**sbd, "sampler_head": {**sbd.get("sampler_head", {}), "hidden": head.hidden, "topk": head.topk}}
    else:
        sbd = {k: v for k, v in sbd.items() if k != "sampler_head"}
    store = drafter.draft_store
    if store is not None:
        stored, spec = draft_store_entries(store)
        tensors.update(stored)
        sbd = {**sbd, "draft_store": {**sbd.get("draft_store", {}), **spec}}
    else:
        sbd = {k: v for k, v in sbd.items() if k != "draft_store"}
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


def draft_store_entries(store: DraftStore) -> tuple[dict[str, torch.Tensor], dict]:
    """A draft store as an artifact holds it: its tensors (``STORE_PREFIX`` + keys / next, int32) and the fields of
    ``sbd.draft_store`` that loading checks them against (entries, n_max, n_min)."""
    keys, nxt = store.tensors()
    return {_STORE_KEYS: keys, _STORE_NEXT: nxt}, {"entries": len(store), "n_max": store.n_max, "n_min": store.n_min}


def is_drafter(folder: str | Path) -> bool:
    """Whether ``folder`` holds a gated drafter artifact."""
    f = Path(folder) / CONFIG_FILE
    if not f.is_file() or not (Path(folder) / WEIGHTS_FILE).is_file():
        return False
    try:
        return json.loads(f.read_text()).get("peft_type") == PEFT_TYPE
    except (ValueError, AttributeError):
        return False


_CONFIG_FIELDS = {
    "peft_type": Field("choice", choices=(PEFT_TYPE,)),
    "r": Field("int", minimum=1),
    "lora_alpha": Field("number"),
    "target_modules": Field("str_list"),
    "sbd": Field("dict"),
}
_SBD_FIELDS = {
    "gated": Field("choice", choices=(True,)),
    "mask_token_id": Field("int", minimum=0),
    "sbd_block_size_range": Field("range", minimum=1),
    "base_loader": Field("loader", required=False),
    "generation": Field("dict", required=False),
    "sampler_head": Field("dict", required=False),
    "draft_store": Field("dict", required=False),
}
_HEAD_FIELDS = {"hidden": Field("int", minimum=1), "topk": Field("int", minimum=1)}
_STORE_FIELDS = {
    "entries": Field("int", minimum=0),
    "n_max": Field("int", minimum=1),
    "n_min": Field("int", minimum=1),
}


def read_drafter_config(folder: str | Path) -> dict:
    """The drafter's ``adapter_config.json``, checked field by field (:class:`ArtifactError` names the file and the
    field)."""
    path = Path(folder) / CONFIG_FILE
    cfg = check_config(read_json_config(path, "a drafter folder"), path, _CONFIG_FIELDS)
    if not cfg["target_modules"]:
        raise ArtifactError(f"{path}: field 'target_modules' must name at least one projection")
    check_config(cfg["sbd"], f"{path} (object 'sbd')", _SBD_FIELDS)
    if "sampler_head" in cfg["sbd"]:
        check_config(cfg["sbd"]["sampler_head"], f"{path} (object 'sbd.sampler_head')", _HEAD_FIELDS)
    if "draft_store" in cfg["sbd"]:
        spec = check_config(cfg["sbd"]["draft_store"], f"{path} (object 'sbd.draft_store')", _STORE_FIELDS)
        if not spec["n_min"] <= spec["n_max"] <= 64 or spec["entries"] > MAX_STORE_ENTRIES:
            raise ArtifactError(
                f"{path}: object 'sbd.draft_store' needs n_min <= n_max <= 64 and entries <= {MAX_STORE_ENTRIES}, "
                f"got n_min {spec['n_min']}, n_max {spec['n_max']}, entries {spec['entries']}"
            )
    return cfg


def _check_shapes(shapes: dict, cfg: dict, hidden_size: int, path: Path, cfg_path: Path) -> None:
    """The shapes the config implies (the mask row [H], the sampler head's tensors for ``sbd.sampler_head.hidden``)
    against the stored tensors' shapes ``shapes`` (read from the file's header): checked before anything is loaded
    or built, so that a crafted size allocates nothing."""
    row = shapes.get(_MASK_ROW_KEY)
    if row != (hidden_size,):
        got = "missing" if row is None else f"of shape {row}"
        raise ArtifactError(f"{path}: tensor {_MASK_ROW_KEY!r} must be [{hidden_size}] (the hidden size), {got}")
    store = cfg["sbd"].get("draft_store")
    got = (shapes.get(_STORE_KEYS), shapes.get(_STORE_NEXT))
    if store is None and got != (None, None):
        raise ArtifactError(f"{path}: holds draft store tensors but {cfg_path} has no 'sbd.draft_store'")
    if store is not None and got != ((store["entries"], store["n_max"]), (store["entries"],)):
        raise ArtifactError(
            f"{path}: the draft store's tensors {_STORE_KEYS!r} / {_STORE_NEXT!r} must be [{store['entries']}, "
            f"{store['n_max']}] / [{store['entries']}] ({cfg_path}'s 'sbd.draft_store'), they are {got[0]} / {got[1]}"
        )
    have = {k[len(_HEAD_PREFIX) :]: v for k, v in shapes.items() if k.startswith(_HEAD_PREFIX)}
    spec = cfg["sbd"].get("sampler_head")
    if spec is None:
        if have:
            raise ArtifactError(f"{path}: holds sampler head tensors but {cfg_path} has no 'sbd.sampler_head'")
        return
    want = SamplerHead.param_shapes(hidden_size, spec["hidden"])
    if have != want:
        raise ArtifactError(
            f"{cfg_path}: field 'sbd.sampler_head.hidden' is {spec['hidden']!r}, and the model's hidden size is "
            f"{hidden_size}: the sampler head's tensors in {path} must then be {want}, they are {have}"
        )


def _sampler_head(tensors: dict, cfg: dict, hidden_size: int, path: Path, dtype: torch.dtype):
    """The sampler head the artifact holds (its tensors popped from ``tensors``, their shapes checked by
    :func:`_check_shapes`), finite in ``dtype``; None if it has none."""
    got = {k[len(_HEAD_PREFIX) :]: tensors.pop(k) for k in [k for k in tensors if k.startswith(_HEAD_PREFIX)]}
    spec = cfg["sbd"].get("sampler_head")
    if spec is None:
        return None
    check_finite({_HEAD_PREFIX + n: t for n, t in got.items()}, path, dtype)
    head = SamplerHead(hidden_size, hidden=spec["hidden"], topk=spec["topk"])
    head.load_state_dict({n: t.float() for n, t in got.items()})
    return head.eval().requires_grad_(False)


def _draft_store(tensors: dict, cfg: dict, vocab: int, mask_id: int, path: Path):
    """The draft store the artifact holds (its tensors popped from ``tensors``, their shapes checked by
    :func:`_check_shapes`): integer ids of the base's vocabulary ``vocab`` (never the mask token); None if none."""
    keys, nxt = tensors.pop(_STORE_KEYS, None), tensors.pop(_STORE_NEXT, None)
    spec = cfg["sbd"].get("draft_store")
    if spec is None:
        return None
    if bool((keys == mask_id).any()) or bool((nxt == mask_id).any()):
        raise ArtifactError(f"{path}: the draft store holds the mask token {mask_id}")
    try:
        return DraftStore(keys, nxt, n_min=spec["n_min"], vocab=vocab)
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"{path}: {e}") from None


def _check_mask_id(model: nn.Module, mask_id: int, rows: int, cfg_path: Path, tokenizer) -> bool:
    """Whether the mask token's row is to be appended (``mask_id`` == the base's vocabulary size ``rows``). Else it
    must be the mask token the base's config (or its ``tokenizer``) names, or a padding row past the tokenizer's
    tokens (a padded vocabulary); any other id is an ordinary token of this base (a drafter made over another base),
    which decoding would ban: :class:`ArtifactError`."""
    if mask_id == rows:
        return True
    check_token_id(mask_id, rows + 1, cfg_path, "sbd.mask_token_id")
    own = {get_sbd_metadata(model)[0], getattr(tokenizer, "mask_token_id", None)} - {None}
    if mask_id in own or (tokenizer is not None and len(tokenizer) <= mask_id < rows):
        return False
    names = f"mask token {sorted(own)[0]}" if own else "no mask token"
    raise ArtifactError(
        f"{cfg_path}: field 'sbd.mask_token_id' is {mask_id}, an ordinary token of this base model (vocabulary size "
        f"{rows}; its config names {names}): the drafter's mask id must be the base's vocabulary size (its row is "
        "appended) or the base's own mask token. This drafter was made over another base: load it over that one"
    )


@torch.no_grad()
def load_weights(
    model: nn.Module,
    folder: str | Path,
    cfg: dict | None = None,
    dtype: torch.dtype | None = None,
    tokenizer=None,
) -> dict:
    """Attach a drafter to ``model`` (the base) from ``folder``; returns the config. Everything is checked before
    the model is touched: the shapes the config implies against the file's header (before anything is loaded or
    built), the factors (pairs, one rank equal to ``r``), the layers they adapt against the model's, the mask row
    ([hidden]), every value finite in ``dtype`` (the dtype the model is used in; default: the model's), the mask id
    (the base's vocabulary size, its row then appended; the mask token the base's config names; or, given the base's
    ``tokenizer``, its mask token or a padding row past its tokens)."""
    folder = Path(folder)
    cfg = read_drafter_config(folder) if cfg is None else cfg
    path, cfg_path = folder / WEIGHTS_FILE, folder / CONFIG_FILE
    emb = model.get_input_embeddings().weight
    dtype = emb.dtype if dtype is None else dtype
    # A base with its original vocabulary (an exported checkpoint): the mask token's row is appended once the
    # artifact is checked (its value is the drafter's mask row, spliced in by the gate).
    grow = _check_mask_id(model, cfg["sbd"]["mask_token_id"], emb.shape[0], cfg_path, tokenizer)
    _check_shapes(tensor_shapes(path), cfg, emb.shape[1], path, cfg_path)
    tensors = load_tensor_file(path)
    row = tensors.pop(_MASK_ROW_KEY)
    check_finite({_MASK_ROW_KEY: row}, path, dtype)
    head = _sampler_head(tensors, cfg, emb.shape[1], path, dtype)
    store = _draft_store(tensors, cfg, emb.shape[0] + grow, cfg["sbd"]["mask_token_id"], path)
    unknown = sorted(k for k in tensors if not k.startswith(_PREFIX))
    if unknown:
        raise ArtifactError(f"{path}: unexpected tensor(s) {unknown[:3]}")
    suffixes = (".lora_A.weight", ".lora_B.weight")
    pairs = lora_pairs({k[len(_PREFIX) :]: t for k, t in tensors.items()}, path, *suffixes)
    check_lora_factors(pairs, path, cfg["r"], "r", cfg_path, suffixes, dtype)
    sbd = cfg["sbd"]
    if grow:
        model.resize_token_embeddings(emb.shape[0] + 1, mean_resizing=False)
    attach(model, sbd["mask_token_id"], rank=cfg["r"], alpha=cfg["lora_alpha"], targets=cfg["target_modules"])
    drafter = get_drafter(model)
    mods = dict(drafter.lora_modules(model))
    try:
        if set(pairs) != set(mods):
            raise ArtifactError(
                f"{path}: adapts {len(pairs)} layers, the model has {len(mods)} for target_modules "
                f"{cfg['target_modules']} (missing: {sorted(set(mods) - set(pairs))[:3]}, unknown: "
                f"{sorted(set(pairs) - set(mods))[:3]})"
            )
        for name, m in mods.items():
            for part, src in zip(("lora_A", "lora_B"), pairs[name], strict=True):
                dst = getattr(m, part)
                if src.shape != dst.shape:
                    raise ArtifactError(
                        f"{path}: {_PREFIX}{name}.{part}.weight is {tuple(src.shape)}, the model "
                        f"needs {tuple(dst.shape)}"
                    )
                dst.copy_(src.to(dst.dtype))
    except ArtifactError:
        detach(model)  # leave the model as it was
        raise
    drafter.mask_row.row.copy_(row.to(drafter.mask_row.row.dtype))
    if head is not None:
        drafter.sampler_head = head.to(emb.device)
    drafter.draft_store = store
    if grow:  # the base's config is a plain one (an exported checkpoint): the SBD fields come from the drafter
        set_sbd_metadata(model, sbd["mask_token_id"], tuple(sbd["sbd_block_size_range"]))
    for p in model.parameters():
        p.requires_grad_(False)
    return cfg


def load_folder_base(path: str | Path, attn_implementation: str = "sbd"):
    """``(model, tokenizer)`` of a local HF model folder as it is (float32, offline, no remote code): the base of a
    drafter trained over a user's own checkpoint (the drafter recipe's ``--base``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not (p / "config.json").is_file():
        raise ArtifactError(f"{p}: not a local HF model folder (no config.json)")
    tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        p, local_files_only=True, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model, tok


def base_folder(cfg: dict, folder: str | Path = "") -> Path | None:
    """The local base model folder a drafter config names (``base_model_name_or_path``, peft's field) when it has no
    ``sbd.base_loader``; None when it has one. A relative path is relative to the drafter's ``folder`` (the folder
    holding the artifact), never to the working directory. :class:`ArtifactError` when it names neither, or names a
    relative path and ``folder`` is not given."""
    if "base_loader" in cfg["sbd"]:
        return None
    where = cfg.get("base_model_name_or_path") or ""
    cfg_path = Path(folder) / CONFIG_FILE
    if not isinstance(where, str) or not where:
        raise ArtifactError(
            f"{cfg_path}: names no base model (neither 'sbd.base_loader' nor "
            "'base_model_name_or_path'); pass base=<the base model's folder>"
        )
    p = Path(where)
    if p.is_absolute():
        return p
    if not str(folder):
        raise ArtifactError(
            f"{cfg_path}: field 'base_model_name_or_path' is the relative path {where!r}, relative to the drafter's "
            "folder: pass the folder (base_folder(cfg, folder))"
        )
    return Path(folder) / p


def load_drafter(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sbd",
    device: str | torch.device | None = None,
    trust_base_loader: bool = False,
    base: str | Path | None = None,
):
    """``(model, tokenizer)``: the base model the drafter names with the drafter attached (gated, not merged), the
    SBD metadata set, its recommended decoding settings on ``model.generation_config``. The base: ``base`` (a local
    HF model folder) when given, else the drafter's ``sbd.base_loader`` (imported only if it is a known loader or
    ``trust_base_loader``: see :func:`sbd_ext.adapters.resolve_base_loader`), else the local folder its
    ``base_model_name_or_path`` names (a drafter trained over a user's checkpoint, :func:`load_folder_base`; a
    relative path is relative to ``folder``, not to the working directory). ``dtype``: the model's dtype, in which
    every stored value must be finite."""
    folder = Path(folder)
    cfg = read_drafter_config(folder)
    where = Path(base) if base is not None else base_folder(cfg, folder)
    if where is None:
        base_loader = resolve_base_loader(cfg["sbd"].get("base_loader", ""), folder / CONFIG_FILE, trust_base_loader)
    toks = []  # the base's tokenizer, for the mask id's check (its mask token; a padded vocabulary's unused rows)

    def loader(attn_implementation):
        if where is not None:
            model, tok = load_folder_base(where, attn_implementation)
        else:
            model, tok = base_loader(attn_implementation=attn_implementation)
        toks.append(tok)
        return model, tok

    return load_on_base(
        cfg["sbd"],
        folder / CONFIG_FILE,
        lambda model: load_weights(model, folder, cfg, dtype, toks[0]),
        dtype,
        attn_implementation,
        device,
        trust_base_loader,
        loader,
    )


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
