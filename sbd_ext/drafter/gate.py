"""The gate: :class:`~sbd_ext.drafter.lora.GatedLoRALinear` adapters and the mask row, on the set-block rows only (see
:mod:`sbd_ext.drafter`): :func:`attach` wraps a model's projections, :class:`Drafter` sets the gate from each forward's
plan."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import torch
from torch import nn

from ..adapters import LORA_TARGETS, MaskRow
from ..linear import RowLinear
from .lora import GatedLoRALinear, RowGate

__all__ = [
    "Drafter",
    "GatedLoRALinear",
    "GatedMaskRow",
    "RowGate",
    "attach",
    "detach",
    "gate_rows",
    "get_drafter",
    "unwrapped",
]


class GatedMaskRow(MaskRow):
    """The mask token's trained row, used only while a gate is set (a forward with no gate sees the base's row)."""

    def __init__(self, model: nn.Module, mask_token_id: int, holder: RowGate):
        super().__init__(model, mask_token_id)
        self.holder = holder

    def _embed_hook(self, module, args, out):
        return super()._embed_hook(module, args, out) if self.holder.on else None

    def _head_hook(self, module, args, out):
        return super()._head_hook(module, args, out) if self.holder.on else None


class Drafter(nn.Module):
    """What :func:`attach` adds to a model (``model.sbd_drafter``): the gate holder, the mask row, the hook."""

    MERGE_LIMIT_BYTES = 4 << 30  # "auto" merges while the merged copies ([W; W + sBA]) take at most this much

    def __init__(self, model: nn.Module, mask_token_id: int, rank: int, alpha: float, targets: tuple[str, ...]):
        super().__init__()
        self.holder = RowGate()
        self._merge: bool | None = None
        self.rank, self.alpha, self.targets = int(rank), float(alpha), tuple(sorted(targets))
        self.mask_token_id = int(mask_token_id)
        # Slot 1's draft rescored given slot 0's token in verify decoding (SamplerHead; None: the drafter's ranking)
        self.sampler_head = None
        # Verify's lookup drafts where the context has none (sbd_ext.decoding.lookup.DraftStore; None: the context only)
        self.draft_store = None
        self._hook = model.get_decoder().register_forward_pre_hook(self._gate_from_plan, with_kwargs=True)
        self._post = model.get_decoder().register_forward_hook(self._clear_plan_gate, with_kwargs=True)

    def _gate_from_plan(self, module, args, kwargs):
        plan = kwargs.get("sbd_plan")
        if plan is None:
            return None  # a forward without a plan keeps whatever gate the caller set (None: the base)
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None and args:
            ids = args[0]
        self.holder.clear()  # nothing left over from a forward that raised
        # The branch's rows and the alternates': the last R, branch_valid[b] of the branch's real
        T, R = ids.shape[1], plan.tail_rows
        if plan.block_rows is None:  # a device plan (compiled step): the gate over every row, traceable
            branch = (T - R, plan.branch_valid) if R else None
            alts = (T - R + plan.branch_rows, plan.alt_rows, plan.alt_valid) if plan.alt_valid else None
            self.holder.gate = gate_rows(plan.n_commit, plan.n_valid, T, ids.device, branch, alts)
            return None
        lo, hi = plan.block_rows
        if R:
            lo, hi = (min(lo, T - R), T) if lo < hi else (T - R, T)
        if lo >= hi:  # no block rows (NTP forwards, prefill): the base alone, nothing added (cleared above)
            return None
        self.holder.rows = (lo, hi)
        if ids.shape[0] > 1 or R:  # sequences' blocks differ, or padding between a block and the branch: 0/1 gate
            branch = (T - R - lo, plan.branch_valid) if R else None
            alts = (T - R - lo + plan.branch_rows, plan.alt_rows, plan.alt_valid) if plan.alt_valid else None
            self.holder.gate = gate_rows(plan.n_commit - lo, plan.n_valid - lo, hi - lo, ids.device, branch, alts)
        return None

    def _clear_plan_gate(self, module, args, kwargs, output):
        if kwargs.get("sbd_plan") is not None:
            self.holder.clear()
        return None

    def lora_modules(self, model: nn.Module) -> list[tuple[str, GatedLoRALinear]]:
        return [(n, m) for n, m in model.named_modules() if isinstance(m, GatedLoRALinear)]

    @property
    def merge(self) -> bool | None:
        """The compiled step's adapter path: None ("auto": merged on CUDA while the merged copies of the projections
        take at most :attr:`MERGE_LIMIT_BYTES`), True (merged on any device), False (the LoRA products)."""
        return self._merge

    @merge.setter
    def merge(self, value: bool | None) -> None:
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"drafter.merge must be None (auto), True or False, got {value!r}")
        self._merge = value

    def merges(self, model: nn.Module, device: torch.device) -> bool:
        """Whether a compiled step on ``device`` runs the adapters merged (:meth:`GatedLoRALinear.merged_weight`):
        :attr:`merge` if set, else on CUDA (where a forward's cost is its kernel count at small batch) while every
        wrapped projection is a plain ``nn.Linear`` (or :class:`~sbd_ext.linear.RowLinear`) and their merged copies
        fit in :attr:`MERGE_LIMIT_BYTES`."""
        mods = [m for _, m in self.lora_modules(model)]
        plain = all(type(m.base) in (nn.Linear, RowLinear) for m in mods)  # RowLinear: nn.Linear's weights
        if self.merge is not None:
            if self.merge and not plain:
                raise ValueError("drafter.merge=True needs plain nn.Linear projections (not quantized ones)")
            return self.merge
        if torch.device(device).type != "cuda" or not plain:
            return False
        extra = 2 * sum(m.base.weight.numel() * m.base.weight.element_size() for m in mods)  # [W; W + sBA]
        return extra <= self.MERGE_LIMIT_BYTES

    def refresh(self, model: nn.Module, device: torch.device | str = "cpu") -> None:
        """Bring every adapter's decoding copies up to date for a compiled step on ``device`` (the packed B of
        :meth:`GatedLoRALinear.packed_b`, ``[W; A]`` of :meth:`GatedLoRALinear.fused_weight` over a packed base, the
        merged weights of :meth:`GatedLoRALinear.merged_weight` where
        :meth:`merges`; dropped where not): called before a compiled step runs, which reads them unchecked."""
        self.holder.merge = self.merges(model, torch.device(device))
        with torch.no_grad():
            for _, m in self.lora_modules(model):
                m.packed_b()
                m.fused_weight()
                if self.holder.merge:
                    m.merged_weight()
                else:  # the memory back
                    m.drop_merged()


def gate_rows(
    n_commit: torch.Tensor,
    n_valid: torch.Tensor,
    rows: int,
    device,
    branch: tuple[int, torch.Tensor] | None = None,
    alternates: tuple[int, int, tuple[torch.Tensor, ...]] | None = None,
) -> torch.Tensor:
    """The block-row gate [B, rows, 1] (float 0/1): row r of sequence b is a set-block row iff
    ``n_commit[b] <= r < n_valid[b]``, or, with ``branch = (start, branch_valid)``, iff
    ``start <= r < start + branch_valid[b]`` (the branch block's rows), or, with ``alternates = (start, size,
    valid)``, iff it is one of rows 1 .. valid[j][b] - 1 of group j (rows ``start + j * size`` on; row 0 of a group
    is a committed row: the base's)."""
    r = torch.arange(rows, device=device).view(1, rows)
    lo = n_commit.to(device=device, dtype=torch.long).view(-1, 1)
    hi = n_valid.to(device=device, dtype=torch.long).view(-1, 1)
    gate = (r >= lo) & (r < hi)
    if branch is not None:
        start, valid = branch
        gate |= (r >= start) & (r < start + valid.to(device=device, dtype=torch.long).view(-1, 1))
    if alternates is not None:
        start, size, valid = alternates
        for j, v in enumerate(valid):
            at = start + j * size
            gate |= (r > at) & (r < at + v.to(device=device, dtype=torch.long).view(-1, 1))
    return gate.to(torch.float32).unsqueeze(-1)


def get_drafter(model: nn.Module) -> Drafter | None:
    """The gated drafter attached to ``model`` (or None)."""
    d = getattr(model, "sbd_drafter", None)
    return d if isinstance(d, Drafter) else None


def attach(
    model: nn.Module,
    mask_token_id: int,
    rank: int = 16,
    alpha: float | None = None,
    targets: Iterable[str] = LORA_TARGETS,
) -> list[nn.Parameter]:
    """Freeze ``model`` and attach a gated drafter (LoRA of ``rank`` on ``targets`` + the mask row); returns the
    trainable parameters. The model's vocabulary must already hold ``mask_token_id``."""
    if get_drafter(model) is not None:
        raise ValueError("the model already has a gated drafter attached")
    emb = model.get_input_embeddings()
    if not 0 <= int(mask_token_id) < emb.num_embeddings:
        raise ValueError(f"mask_token_id {mask_token_id} is not a row of the embedding ({emb.num_embeddings} rows)")
    alpha = 2.0 * rank if alpha is None else float(alpha)
    for p in model.parameters():
        p.requires_grad_(False)
    targets = tuple(targets)
    drafter = Drafter(model, mask_token_id, rank, alpha, targets)
    wrapped = 0
    for module in list(model.get_decoder().modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                setattr(module, child_name, GatedLoRALinear(child, rank, alpha, drafter.holder))
                wrapped += 1
    if not wrapped:
        drafter._hook.remove()
        drafter._post.remove()
        raise ValueError(f"no nn.Linear named one of {targets} in the model: nothing to adapt")
    drafter.mask_row = GatedMaskRow(model, mask_token_id, drafter.holder)
    model.sbd_drafter = drafter
    return [p for p in model.parameters() if p.requires_grad]


def grow_rank(model: nn.Module, rank: int) -> list[nn.Parameter]:
    """Raise the attached drafter's LoRA rank to ``rank`` without changing what it computes, to continue training a
    drafter with more capacity: each A gains rows drawn as :func:`attach` draws them, each B as many zero columns
    (the new directions start at zero, as a fresh adapter's do), and alpha grows with the rank so that the scale
    alpha / rank -- and so every product -- stays the same. Returns the trainable parameters (the new factors and the
    mask row), as :func:`attach` does."""
    drafter = get_drafter(model)
    if drafter is None:
        raise ValueError("the model has no gated drafter to grow")
    rank = int(rank)
    if rank < drafter.rank:
        raise ValueError(f"cannot grow a rank-{drafter.rank} drafter to the lower rank {rank}")
    for _, m in drafter.lora_modules(model):
        if m.rank == rank:
            continue
        a, b = m.lora_A.detach(), m.lora_B.detach()
        extra = torch.empty(rank - m.rank, a.shape[1], dtype=a.dtype, device=a.device)
        nn.init.kaiming_uniform_(extra, a=math.sqrt(5))
        m.lora_A = nn.Parameter(torch.cat([a, extra]))
        m.lora_B = nn.Parameter(torch.cat([b, b.new_zeros(b.shape[0], rank - m.rank)], dim=1))
        m.rank = rank  # m.scale kept
    drafter.alpha, drafter.rank = drafter.alpha / drafter.rank * rank, rank
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or "mask_row" in name)
    return [p for p in model.parameters() if p.requires_grad]


def _remove(model: nn.Module, drafter: Drafter) -> list:
    """Put the wrapped layers back, remove the hooks and ``model.sbd_drafter``; returns what :func:`unwrapped`
    needs to restore them."""
    wrapped = []
    for name, m in drafter.lora_modules(model):
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, m.base)
        wrapped.append((owner, child, m))
    drafter.mask_row.remove()
    drafter._hook.remove()
    drafter._post.remove()
    del model.sbd_drafter
    return wrapped


def detach(model: nn.Module) -> None:
    """Remove the drafter from ``model`` for good (the base as it was); nothing when it has none."""
    drafter = get_drafter(model)
    if drafter is not None:
        _remove(model, drafter)


@contextlib.contextmanager
def unwrapped(model: nn.Module):
    """Inside the block ``model`` is its plain base (the wrapped layers put back, the hooks removed, no
    ``sbd_drafter``): e.g. to ``save_pretrained`` the base weights under their own names. The drafter is restored
    after the block (the same parameters)."""
    drafter = get_drafter(model)
    if drafter is None:
        yield model
        return
    row = drafter.mask_row.row.detach().clone()
    wrapped = _remove(model, drafter)
    try:
        yield model
    finally:
        for owner, child, m in wrapped:
            setattr(owner, child, m)
        decoder = model.get_decoder()
        drafter._hook = decoder.register_forward_pre_hook(drafter._gate_from_plan, with_kwargs=True)
        drafter._post = decoder.register_forward_hook(drafter._clear_plan_gate, with_kwargs=True)
        drafter.mask_row = GatedMaskRow(model, drafter.mask_token_id, drafter.holder)
        with torch.no_grad():
            drafter.mask_row.row.copy_(row)
        drafter.mask_row.row.requires_grad_(row.requires_grad)
        model.sbd_drafter = drafter
