"""The gate: :class:`GatedLoRALinear` adapters and the mask row, on the set-block rows only (see
:mod:`sbd_ext.drafter`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters import LORA_TARGETS, MaskRow
from ..linear import RowLinear, as_rows, row_count
from ..ops import row_linear
from ..packing import PANEL, pack_row_linear_weight
from ..quantization import PackedLinear


class RowGate:
    """The per-row gate shared by every adapter of one model.

    ``gate``: None or a float 0/1 tensor [B, T, 1] (T: the forward's rows, or ``hi - lo`` with ``rows``; None with
    ``rows`` set: every row of the slice is a block row). ``rows``: a host range ``(lo, hi)`` of the forward's rows
    that holds every block row (eager decoding knows it): the adapters then run on that slice only. Both None:
    adapters and mask row off, the base's forward exactly (e.g. an NTP forward, which has no block rows)."""

    def __init__(self):
        self.gate: torch.Tensor | None = None
        self.rows: tuple[int, int] | None = None
        # The adapters' merged path for a gate over every row (GatedLoRALinear.merged_weight), as the last
        # Drafter.refresh decided (eager decoding gives a row range instead and never takes it).
        self.merge = False

    @property
    def on(self) -> bool:
        return self.gate is not None or self.rows is not None

    def clear(self) -> None:
        self.gate, self.rows = None, None


class GatedLoRALinear(nn.Module):
    """``base(x) + gate · scale · (x A^T) B^T`` over a frozen linear layer; with no gate set, exactly ``base(x)``."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, holder: RowGate):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        self.rank, self.scale = int(rank), float(alpha) / int(rank)
        self.holder = holder
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    @property
    def weight(self) -> torch.Tensor:  # code that inspects a projection's weight (families, RoPE checks) sees the base
        return self.base.weight

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def _factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``A^T`` and ``scale · B^T`` (contiguous, in ``dtype``) for decoding, cached until a factor changes (an
        in-place update bumps its version: an optimizer step, a load)."""
        key = (self.lora_A._version, self.lora_B._version, dtype, self.lora_A.data_ptr(), self.lora_B.data_ptr())
        cached = getattr(self, "_cached_factors", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                a_t = self.lora_A.to(dtype).t().contiguous()
                b_t = (self.lora_B.to(dtype) * self.scale).t().contiguous()
            cached = self._cached_factors = (key, a_t, b_t)
        return cached[1], cached[2]

    def _delta(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * self.scale

    def _row_kernel(self, x: torch.Tensor) -> bool:
        """Decoding rows that row_linear's CPU kernel takes: fp32 on the CPU, no autograd graph."""
        a = self.lora_A
        return (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and a.dtype == torch.float32
            and a.device.type == "cpu"
            and not torch.is_grad_enabled()
        )

    def packed_b(self) -> torch.Tensor | None:
        """``scale · B`` in row_linear's packed fp32 layout ([N / 16, r, 16]: the CPU kernel's panel path; the plain
        [N, r] layout sums lanes over r = 16 and took ~2x as long), or None where the layout does not apply (N not a
        multiple of 16, or B not on the CPU, which has the only packed kernel: the plain factor is used). Rebuilt
        when B changes (an optimizer step, a load bumps its version); a compiled step reads the copy refreshed before
        it runs (:meth:`Drafter.refresh`)."""
        if torch.compiler.is_compiling():
            return getattr(self, "_packed_b", None)
        b = self.lora_B
        key = (b._version, b.data_ptr(), b.dtype, self.scale)
        if getattr(self, "_packed_b_key", None) != key:
            packed = None
            if b.shape[0] % PANEL == 0 and b.device.type == "cpu":
                with torch.no_grad():
                    packed = pack_row_linear_weight((b.detach().float() * self.scale).contiguous())
            self._packed_b, self._packed_b_key = packed, key
        return self._packed_b

    def fused_weight(self) -> torch.Tensor | None:
        """``[W; A]`` in row_linear's packed layout ([(N' + r') / 16, K, 16]: the base's panels, then A's rows padded
        with zero rows to whole panels) where the base is a :class:`~sbd_ext.quantization.PackedLinear` on the CPU
        (``sbd_ext.quantize(model, "packed")``), else None. One row_linear call then gives every row's base output
        and its ``x A^T`` (outputs ``N' .. N' + r``): the A product rides in the stream of W's panels instead of a
        call of its own (210 calls of ~2.6 MB of A for SmolLM2; measured 2026-11-27: 27.2 -> 31.4 ms for the base
        plus A products at 4 rows, against 34.5 ms with separate calls, best of 30, Zen 3). Each output sums in the
        same order as the base's own call, so the base's columns are its outputs bit for bit.

        The base's ``weight_packed`` is re-pointed to the first N' / 16 panels of this tensor (a view: the same
        values, no second copy of W; an NTP forward reads only W). Rebuilt when the base's packed weight is replaced
        (a ``quantize``, a ``.to()``) and A's rows re-copied in place when A changes (an optimizer step, a load); a
        compiled step reads the copy refreshed before it runs (:meth:`Drafter.refresh`)."""
        if torch.compiler.is_compiling():
            return getattr(self, "_fused", None)
        base, a = self.base, self.lora_A
        wp = base._buffers.get("weight_packed") if isinstance(base, PackedLinear) else None
        if wp is None or wp.device.type != "cpu" or a.device.type != "cpu" or wp.dtype != torch.float32:
            self.drop_fused()
            return None
        fused = getattr(self, "_fused", None)
        if fused is None or wp is not getattr(self, "_fused_view", None):
            with torch.no_grad():
                fused = torch.cat([wp.detach(), pack_row_linear_weight(a.detach().float(), pad=True)])
                view = fused[: wp.shape[0]]
                base._buffers["weight_packed"] = view  # the same values: W is stored once, in the fused tensor
            self._fused, self._fused_view, self._fused_key = fused, view, (a._version, a.data_ptr())
        elif self._fused_key != (a._version, a.data_ptr()):
            with torch.no_grad():
                fused[wp.shape[0] :].copy_(pack_row_linear_weight(a.detach().float(), pad=True))
            self._fused_key = (a._version, a.data_ptr())
        return fused

    def drop_fused(self) -> None:
        """Forget :meth:`fused_weight` (the base keeps its packed weight: a view of it, holding W's values)."""
        self._fused = self._fused_view = self._fused_key = None

    def _fused_out(self, x: torch.Tensor, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the base's output [..., N] (a view of the call's output, bias added), ``x A^T`` [..., r] (a view)) of
        decoding rows ``x`` [..., K] with one row_linear call on :meth:`fused_weight`."""
        n, n_pad = self.out_features, self.base.weight_packed.shape[0] * PANEL
        out = row_linear(as_rows(x, row_count(x)), fused)
        y = out[:, :n].view(*x.shape[:-1], n)
        if self.base.bias is not None:
            y = y + self.base.bias
        return y, out[:, n_pad : n_pad + self.rank].view(*x.shape[:-1], self.rank)

    def _b_rows(self, h2: torch.Tensor) -> torch.Tensor:
        """``scale · h B^T`` of rows ``h`` [n, r] (``x A^T``) with row_linear on the packed B (:meth:`packed_b`)."""
        b = self.packed_b()
        return row_linear(h2, self.lora_B) * self.scale if b is None else row_linear(h2, b)

    def merged_weight(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``([W; W + scale · B A], [b; b])`` ([2N, K] and [2N] or None) where the gate has the merged path on
        (:attr:`Drafter.merge`), else None. One GEMM then gives every row's base output and its adapted output; the
        gate selects per row. A compiled CUDA step replays hundreds of tiny kernels per forward, so the adapter's two
        skinny GEMMs and its gated add (~3 kernels per projection, 630 for SmolLM2) took ~45 % of a verify forward on
        an H200 (7.1 vs 3.8 ms per forward, bench/results/gpu-h200/run3); the merged GEMM reads the weight twice,
        ~0.1 ms for SmolLM2. The copies are non-persistent buffers (not saved; static addresses for CUDA graphs),
        rebuilt in place when W, A or B changes (a captured graph keeps reading them); a compiled step reads the
        copies refreshed before it runs (:meth:`Drafter.refresh`)."""
        if not self.holder.merge:
            return None
        if torch.compiler.is_compiling():
            w2 = getattr(self, "merged_w", None)
            return None if w2 is None else (w2, getattr(self, "merged_b", None))
        w, a, b = self.base.weight, self.lora_A, self.lora_B
        key = (w._version, a._version, b._version, w.data_ptr(), a.data_ptr(), b.data_ptr(), w.dtype, self.scale)
        if getattr(self, "_merged_key", None) != key:
            with torch.no_grad():
                adapted = (w.float() + self.scale * (b.float() @ a.float())).to(w.dtype)
                bias = self.base.bias
                n = w.shape[0]
                old, old_b = getattr(self, "merged_w", None), getattr(self, "merged_b", None)
                want = ((2 * n, *w.shape[1:]), w.dtype, w.device)
                same = old is not None and (old.shape, old.dtype, old.device) == want
                if same and (old_b is None) == (bias is None):  # in place: a captured graph keeps reading these
                    old[:n].copy_(w)
                    old[n:].copy_(adapted)
                    if bias is not None:
                        old_b[:n].copy_(bias)
                        old_b[n:].copy_(bias)
                else:
                    self.register_buffer("merged_w", torch.cat([w.detach(), adapted]), persistent=False)
                    both_b = None if bias is None else torch.cat([bias.detach(), bias.detach()])
                    self.register_buffer("merged_b", both_b, persistent=False)
            self._merged_key = key
        return self.merged_w, self.merged_b

    def drop_merged(self) -> None:
        """Free the merged copies (:meth:`merged_weight`)."""
        for name in ("merged_w", "merged_b"):
            if name in self._buffers:
                del self._buffers[name]
        self._merged_key = None

    def _delta_rows(self, x2: torch.Tensor) -> torch.Tensor:
        """``scale · (x A^T) B^T`` of decoding rows [n, K] (``_row_kernel``) with row_linear: A as stored ([r, K] is
        its weight layout), ``scale · B`` packed (:meth:`packed_b`), each read once for all rows. In a compiled step
        these are two kernel calls per adapter where inductor's own code for the two skinny GEMMs cost ~18 % of a
        SmolLM2 verify forward (7 of 41 ms, 210 adapters; measured 2026-11-26)."""
        return self._b_rows(row_linear(x2, self.lora_A))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, rows = self.holder.gate, self.holder.rows
        if gate is not None and rows is None and not torch.is_grad_enabled():  # a compiled step's gate over all rows
            merged = self.merged_weight()
            if merged is not None:
                both = F.linear(x, merged[0], merged[1])
                n = self.out_features
                return torch.where(gate > 0, both[..., n:], both[..., :n])
        if gate is not None and rows is None and self._row_kernel(x):  # a compiled step's gate over all rows
            fused = self.fused_weight()
            if fused is not None:
                y, h = self._fused_out(x, fused)
                return y + self._b_rows(as_rows(h, row_count(h))).view(y.shape) * gate.to(y.dtype)
        if rows is not None and self._row_kernel(x):  # eager decoding, packed base: base and A in one call
            fused = self.fused_weight()
            if fused is not None:
                lo, hi = rows
                y, h = self._fused_out(x, fused)
                y = y.contiguous()
                ys, hs = y[:, lo:hi], h[:, lo:hi]
                delta = self._b_rows(as_rows(hs, row_count(hs))).view(ys.shape)
                ys += delta if gate is None else delta * gate.to(y.dtype)
                return y
        y = self.base(x)
        if rows is not None and not torch.is_grad_enabled():  # decoding: the adapter on the block-row slice only
            lo, hi = rows
            ys = y[:, lo:hi]
            if self._row_kernel(x):
                xs = x[:, lo:hi]
                delta = self._delta_rows(as_rows(xs, row_count(xs))).view(ys.shape)
                ys += delta if gate is None else delta * gate.to(y.dtype)
                return y
            xs = x[:, lo:hi].reshape(-1, x.shape[-1])
            a_t, b_t = self._factors(x.dtype)
            if gate is None and ys.is_contiguous():  # one sequence: two GEMMs, the second accumulating into y
                ys.view(-1, ys.shape[-1]).addmm_(torch.mm(xs, a_t), b_t)
            else:
                delta = torch.mm(torch.mm(xs, a_t), b_t).view(ys.shape)
                ys += delta if gate is None else delta * gate.to(y.dtype)
            return y
        if gate is None:
            return y
        if self._row_kernel(x):  # a compiled decoding step: the gate over every row of the forward
            delta = self._delta_rows(as_rows(x, row_count(x))).view(*x.shape[:-1], self.out_features)
            return y + delta * gate.to(y.dtype)
        return y + self._delta(x) * gate.to(y.dtype)


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
        T, R = ids.shape[1], plan.branch_rows  # the branch's rows: the last R, branch_valid[b] of them real
        if plan.block_rows is None:  # a device plan (compiled step): the gate over every row, traceable
            branch = (T - R, plan.branch_valid) if R else None
            self.holder.gate = gate_rows(plan.n_commit, plan.n_valid, T, ids.device, branch)
            return None
        lo, hi = plan.block_rows
        if R:
            lo, hi = (min(lo, T - R), T) if lo < hi else (T - R, T)
        if lo >= hi:  # no block rows (NTP forwards, prefill): the base alone, nothing added (cleared above)
            return None
        self.holder.rows = (lo, hi)
        if ids.shape[0] > 1 or R:  # sequences' blocks differ, or padding between a block and the branch: 0/1 gate
            branch = (T - R - lo, plan.branch_valid) if R else None
            self.holder.gate = gate_rows(plan.n_commit - lo, plan.n_valid - lo, hi - lo, ids.device, branch)
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
) -> torch.Tensor:
    """The block-row gate [B, rows, 1] (float 0/1): row r of sequence b is a set-block row iff
    ``n_commit[b] <= r < n_valid[b]``, or, with ``branch = (start, branch_valid)``, iff
    ``start <= r < start + branch_valid[b]`` (the branch block's rows)."""
    r = torch.arange(rows, device=device).view(1, rows)
    lo = n_commit.to(device=device, dtype=torch.long).view(-1, 1)
    hi = n_valid.to(device=device, dtype=torch.long).view(-1, 1)
    gate = (r >= lo) & (r < hi)
    if branch is not None:
        start, valid = branch
        gate |= (r >= start) & (r < start + valid.to(device=device, dtype=torch.long).view(-1, 1))
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
