"""What trains in a conversion, and the compact artifact it leaves: low-rank adapters + the mask token's row.

A pretrained model converted to SBD needs one new embedding row (the mask token) and some capacity to read a
bidirectional block of masks; everything else it already has. :func:`prepare` freezes the model and adds

* :class:`LoRALinear` adapters (``W x + s · B A x``, A: [r, in], B: [out, r], B = 0 at the start, s = alpha / r) on the
  chosen projections (``method="lora"``), or unfreezes whole groups of weights (``"attn"``: attention projections
  and norms; ``"full"``: every weight);
* :class:`MaskRow`: the mask token's row as one trainable vector [H], used both where the model embeds the mask
  token and where its output layer scores it (the same row of a tied embedding), so the rest of the table and its
  optimizer state stay frozen and tiny.

No ``peft`` dependency: the adapter is ~60 lines, saved as plain safetensors, and :func:`merge` folds it into the
weights (``W += s · B A``; the mask row written into the embedding and, if untied, the output layer), after which
the model is an ordinary HF model with no wrapper and no extra cost per forward.

Artifact (:func:`save_artifact` / :func:`apply_artifact` / :func:`load_artifact`), a folder: ``adapter.safetensors``
(LoRA factors, or the changed tensors for attn/full, bf16), ``mask_row.safetensors`` (fp32) and ``sbd_config.json``
(method, rank, alpha, targets, mask token, block-size range, recommended decoding settings, provenance, and
``base``: ``"module:function"``, the loader of the base model it applies to, as transformers' ``auto_map`` names
code; the function returns ``(model, tokenizer)`` with the mask token already in the vocabulary).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .artifact_checks import (
    ArtifactError,
    Field,
    check_config,
    check_finite,
    check_lora_factors,
    check_mask_rows,
    check_token_id,
    load_on_base,
    load_tensor_file,
    lora_pairs,
    read_json_config,
)

__all__ = [
    "LORA_TARGETS",
    "METHODS",
    "LoRALinear",
    "MaskRow",
    "prepare",
    "merge",
    "save_artifact",
    "apply_artifact",
    "read_artifact_config",
    "is_artifact",
    "load_artifact",
    "ArtifactError",
    "SBD_CONFIG_FIELDS",
]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
METHODS = ("lora", "attn", "full")
ADAPTER_FILE = "adapter.safetensors"
MASK_ROW_FILE = "mask_row.safetensors"
CONFIG_FILE = "sbd_config.json"


class LoRALinear(nn.Module):
    """``base(x) + scale · (x A^T) B^T`` over a frozen ``nn.Linear``. A starts Kaiming-uniform (as peft), B at 0,
    so the wrapped layer starts equal to the base layer."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        self.rank, self.scale = int(rank), float(alpha) / int(rank)
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale

    def delta(self) -> torch.Tensor:
        """The weight change this adapter stands for, [out, in]."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scale


class MaskRow(nn.Module):
    """The mask token's embedding row as a trainable vector, spliced into the input embedding's output and into the
    output layer's logits by forward hooks (the model's own modules stay as they are). A tied model has one row for
    both (``row``); an untied one also trains the output layer's row (``out_row``)."""

    def __init__(self, model: nn.Module, mask_token_id: int):
        super().__init__()
        emb = model.get_input_embeddings()
        head = model.get_output_embeddings()
        self.mask_token_id = int(mask_token_id)
        self.row = nn.Parameter(emb.weight[self.mask_token_id].detach().clone())
        self.out_row = None
        self._handles = [emb.register_forward_hook(self._embed_hook)]
        if head is not None:
            if head.weight is not emb.weight:
                self.out_row = nn.Parameter(head.weight[self.mask_token_id].detach().clone())
            self._handles.append(head.register_forward_hook(self._head_hook))

    def output_row(self) -> torch.Tensor:
        return self.row if self.out_row is None else self.out_row

    def _embed_hook(self, module, args, out):
        ids = args[0]
        return torch.where((ids == self.mask_token_id).unsqueeze(-1), self.row.to(out.dtype), out)

    def _head_hook(self, module, args, out):
        out = out.clone()
        score = args[0] @ self.output_row().to(args[0].dtype)
        if getattr(module, "bias", None) is not None:
            score = score + module.bias[self.mask_token_id]
        out[..., self.mask_token_id] = score
        return out

    def state(self) -> dict[str, torch.Tensor]:
        out = {"mask_row": self.row.detach().float().cpu().contiguous()}
        if self.out_row is not None:
            out["mask_out_row"] = self.out_row.detach().float().cpu().contiguous()
        return out

    @torch.no_grad()
    def load(self, rows: dict[str, torch.Tensor]) -> None:
        """Set the row(s) from a :meth:`state` (an untied model without ``mask_out_row`` takes ``mask_row``, as
        :func:`_write_mask_row` does)."""
        self.row.copy_(rows["mask_row"].to(self.row.dtype))
        if self.out_row is not None:
            self.out_row.copy_(rows.get("mask_out_row", rows["mask_row"]).to(self.out_row.dtype))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _lora_modules(model: nn.Module) -> Iterable[tuple[str, LoRALinear]]:
    return ((n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear))


def prepare(
    model: nn.Module,
    mask_token_id: int,
    method: str = "lora",
    rank: int = 16,
    alpha: float | None = None,
    targets: Iterable[str] = LORA_TARGETS,
) -> tuple[MaskRow, list[nn.Parameter]]:
    """Freeze ``model``, add what ``method`` trains, return ``(mask_row, trainable parameters)``.

    ``mask_row`` must stay referenced while training (it owns the hooks); :func:`merge` removes it."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    for p in model.parameters():
        p.requires_grad_(False)
    targets = tuple(targets)
    if method == "lora":
        alpha = 2.0 * rank if alpha is None else float(alpha)
        wrapped = 0
        for module in list(model.modules()):
            for child_name, child in list(module.named_children()):
                if child_name in targets and isinstance(child, nn.Linear):
                    setattr(module, child_name, LoRALinear(child, rank, alpha))
                    wrapped += 1
        if not wrapped:
            raise ValueError(f"no nn.Linear named one of {targets} in the model: nothing to adapt")
    elif method == "attn":
        for n, p in model.named_parameters():
            p.requires_grad_(("self_attn" in n or "norm" in n) and "embed" not in n)
    else:
        emb_ids = {id(model.get_input_embeddings().weight)}
        head = model.get_output_embeddings()
        if head is not None:
            emb_ids.add(id(head.weight))
        for p in model.parameters():
            p.requires_grad_(id(p) not in emb_ids)  # the tables change only in the mask row (MaskRow)
    mask_row = MaskRow(model, mask_token_id)
    model.sbd_mask_row = mask_row  # a submodule: its row is one of the model's named (checkpointed) parameters
    params = [p for p in model.parameters() if p.requires_grad]
    return mask_row, params


@torch.no_grad()
def merge(model: nn.Module, mask_row: MaskRow) -> nn.Module:
    """Fold the adapters and the mask row into the model's own weights and remove every wrapper and hook."""
    for name, lora in list(_lora_modules(model)):
        lora.base.weight += lora.delta().to(lora.base.weight.dtype)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, lora.base)
    mask_row.remove()
    if getattr(model, "sbd_mask_row", None) is mask_row:
        del model.sbd_mask_row
    _write_mask_row(model, mask_row.mask_token_id, mask_row.state())
    return model


def _write_mask_row(model: nn.Module, mask_token_id: int, rows: dict[str, torch.Tensor]) -> None:
    """Write ``mask_row`` into the input table and ``mask_out_row`` (default: the same) into an untied output
    layer."""
    emb = model.get_input_embeddings().weight
    emb[mask_token_id] = rows["mask_row"].to(emb.dtype)
    head = model.get_output_embeddings()
    if head is not None and head.weight is not emb:
        head.weight[mask_token_id] = rows.get("mask_out_row", rows["mask_row"]).to(head.weight.dtype)


def _changed_tensors(model: nn.Module, method: str) -> dict[str, torch.Tensor]:
    if method == "lora":
        out = {}
        for name, lora in _lora_modules(model):
            out[f"{name}.lora_A"] = lora.lora_A.detach().to(torch.bfloat16).cpu().contiguous()
            out[f"{name}.lora_B"] = lora.lora_B.detach().to(torch.bfloat16).cpu().contiguous()
        return out
    return {
        n: p.detach().to(torch.bfloat16).cpu().contiguous()
        for n, p in model.named_parameters()
        if p.requires_grad and not n.startswith("sbd_mask_row.")
    }


# sbd_config.json (this module's artifact). rank and alpha are required for method "lora" (check_config's
# ``required_if``); sbd_block_size_range and base_loader by load_artifact.
SBD_CONFIG_FIELDS: dict[str, Field] = {
    "method": Field("choice", choices=METHODS),
    "mask_token_id": Field("int", minimum=0),
    "rank": Field("int", required=False, minimum=1),
    "alpha": Field("number", required=False),
    "targets": Field("str_list", required=False),
    "sbd_block_size_range": Field("range", required=False, minimum=1),
    "base_loader": Field("loader", required=False),
    "generation": Field("dict", required=False),
}


def _model_hidden_and_vocab(model: nn.Module) -> tuple[int, int]:
    emb = model.get_input_embeddings().weight
    return int(emb.shape[1]), int(emb.shape[0])


def _check_artifact_tensors(
    model: nn.Module, folder: Path, meta: dict, tensors: dict[str, torch.Tensor], rows: dict[str, torch.Tensor]
) -> dict | None:
    """Every check of an artifact's tensors against ``meta`` and ``model`` before anything is written: LoRA
    factors (pairs, ranks equal to the config's, finite) or changed tensors (finite), the mask rows (shape [H],
    finite), the mask id within the vocabulary. Returns the LoRA pairs (None for attn / full)."""
    hidden, vocab = _model_hidden_and_vocab(model)
    check_token_id(meta["mask_token_id"], vocab, folder / CONFIG_FILE)
    check_mask_rows(rows, folder / MASK_ROW_FILE, hidden)
    if meta["method"] != "lora":
        check_finite(tensors, folder / ADAPTER_FILE)
        return None
    pairs = lora_pairs(tensors, folder / ADAPTER_FILE)
    check_lora_factors(pairs, folder / ADAPTER_FILE, rank=meta["rank"], config_path=folder / CONFIG_FILE)
    return pairs


def save_artifact(model: nn.Module, mask_row: MaskRow, method: str, folder: str | Path, config: dict) -> int:
    """Write the compact artifact of a prepared (not yet merged) model into ``folder``; returns its size in bytes.

    ``config`` goes into ``sbd_config.json`` next to what this module records (method, rank, alpha, targets)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_changed_tensors(model, method), folder / ADAPTER_FILE)
    save_file(mask_row.state(), folder / MASK_ROW_FILE)
    meta = {"method": method, "mask_token_id": mask_row.mask_token_id, **config}
    loras = list(_lora_modules(model))
    if loras:
        meta.update(
            rank=loras[0][1].rank,
            alpha=loras[0][1].scale * loras[0][1].rank,
            targets=sorted({n.rsplit(".", 1)[-1] for n, _ in loras}),
        )
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


@torch.no_grad()
def load_trainable(model: nn.Module, mask_row: MaskRow, folder: str | Path) -> dict:
    """Start a prepared model (:func:`prepare`, not merged) from an artifact of the same method and shape, to
    continue a conversion: the LoRA factors (or the changed tensors) and the mask row(s) copied into the trainable
    parameters. Returns the artifact's config. Every check passes before anything is copied."""
    folder = Path(folder)
    meta = read_artifact_config(folder)
    tensors = load_tensor_file(folder / ADAPTER_FILE)
    rows = load_tensor_file(folder / MASK_ROW_FILE)
    pairs = _check_artifact_tensors(model, folder, meta, tensors, rows)
    if meta["mask_token_id"] != mask_row.mask_token_id:
        raise ArtifactError(
            f"{folder / CONFIG_FILE}: field 'mask_token_id' is {meta['mask_token_id']}, the prepared model's mask "
            f"token is {mask_row.mask_token_id}"
        )
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    if pairs is not None:
        loras = dict(_lora_modules(model))
        if not loras:
            raise ValueError(f"{folder}: a LoRA artifact, but the model has no LoRA adapters (prepare it with 'lora')")
        if set(pairs) != set(loras):
            raise ValueError(f"{folder}: the artifact adapts {len(pairs)} layers, the model {len(loras)}")
        for name, (a, b) in pairs.items():
            lora = loras[name]
            if float(meta["alpha"]) / int(meta["rank"]) != lora.scale:
                raise ValueError(f"{folder}: LoRA scale {meta['alpha']}/{meta['rank']} differs from the model's")
            for part, src in (("lora_A", a), ("lora_B", b)):
                dst = getattr(lora, part)
                if dst.shape != src.shape:
                    raise ValueError(f"{folder}: {name}.{part} is {tuple(src.shape)}, the model's {tuple(dst.shape)}")
                copies.append((dst, src))
    else:
        params = dict(model.named_parameters())
        for name, value in tensors.items():
            if name not in params or params[name].shape != value.shape or not params[name].requires_grad:
                raise ValueError(f"{folder}: tensor {name} {tuple(value.shape)} is not a trainable tensor of the model")
            copies.append((params[name], value))
    for dst, src in copies:
        dst.copy_(src.to(dst.dtype))
    mask_row.load(rows)
    return meta


def read_artifact_config(folder: str | Path) -> dict:
    """The artifact's ``sbd_config.json``, checked field by field (:data:`SBD_CONFIG_FIELDS`; rank and alpha for a
    LoRA artifact): FileNotFoundError when absent, :class:`ArtifactError` naming the file and field otherwise."""
    path = Path(folder) / CONFIG_FILE
    cfg = read_json_config(path)
    return check_config(cfg, path, SBD_CONFIG_FIELDS, {"method=lora": ("rank", "alpha")})


@torch.no_grad()
def apply_artifact(model: nn.Module, folder: str | Path) -> dict:
    """Apply an artifact written by :func:`save_artifact` to the base ``model`` (whose vocabulary already holds the
    mask token), in place: adapters merged into the weights, the mask row written. Returns its config. Every check
    (config fields, tensors, shapes against the model) passes before the model is changed."""
    folder = Path(folder)
    meta = read_artifact_config(folder)
    tensors = load_tensor_file(folder / ADAPTER_FILE)
    rows = load_tensor_file(folder / MASK_ROW_FILE)
    pairs = _check_artifact_tensors(model, folder, meta, tensors, rows)
    params = dict(model.named_parameters())
    updates: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # (weight, value, add)
    if pairs is not None:
        scale = float(meta["alpha"]) / int(meta["rank"])
        for name, (a, b) in pairs.items():
            weight = params.get(f"{name}.weight")
            if weight is None:
                raise ValueError(f"{folder}: the adapter names {name}, which the model does not have")
            if (b.shape[0], a.shape[1]) != tuple(weight.shape):
                raise ValueError(
                    f"{folder}: adapter {name} is {(b.shape[0], a.shape[1])}, the weight {tuple(weight.shape)}"
                )
            updates.append((weight, (b.float() @ a.float()) * scale, True))
    else:
        for name, value in tensors.items():
            if name not in params or params[name].shape != value.shape:
                raise ValueError(f"{folder}: tensor {name} {tuple(value.shape)} does not fit the model")
            updates.append((params[name], value, False))
    for weight, value, add in updates:
        if add:
            weight += value.to(weight.dtype)
        else:
            weight.copy_(value.to(weight.dtype))
    _write_mask_row(model, int(meta["mask_token_id"]), rows)
    return meta


def is_artifact(folder: str | Path) -> bool:
    """Whether ``folder`` holds an artifact of this module (not a full checkpoint)."""
    folder = Path(folder)
    return (folder / CONFIG_FILE).is_file() and (folder / ADAPTER_FILE).is_file()


def load_artifact(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sbd",
    device: str | torch.device | None = None,
    trust_base_loader: bool = False,
):
    """``(model, tokenizer)``: the base model the artifact names (its ``base_loader``), the artifact applied, the
    SBD metadata set, its recommended decoding settings (``generation``: ``sbd_block_size``, ``sbd_sampler``,
    ``sbd_threshold``, ...) on ``model.generation_config``, in eval mode. The base loader may need packages the
    artifact's recipe needs (it says which).

    The base loader is code: it is imported only if it is a known loader (``artifact_checks.KNOWN_BASE_LOADERS``) or
    ``trust_base_loader=True``, and never from a ``__main__`` module. Every malformed field or tensor is an
    :class:`ArtifactError` naming the file and the field."""
    folder = Path(folder)
    meta = read_artifact_config(folder)
    cfg_path = folder / CONFIG_FILE
    check_config(meta, cfg_path, {"base_loader": Field("loader"), "sbd_block_size_range": Field("range", minimum=1)})
    return load_on_base(
        meta,
        cfg_path,
        lambda model: apply_artifact(model, folder),
        dtype,
        attn_implementation,
        device,
        trust_base_loader,
    )
