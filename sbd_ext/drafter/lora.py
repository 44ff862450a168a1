"""The adapter of the gated drafter: :class:`GatedLoRALinear` over a frozen projection, and :class:`RowGate`, the
per-row gate that every adapter of one model shares (see :mod:`sbd_ext.drafter`; :mod:`sbd_ext.drafter.gate` attaches
them). Decoding keeps copies of the factors in the layouts its paths read: ``scale · B`` packed for row_linear,
``[W; A]`` fused into a packed base's panels, ``[W; W + scale · B A]`` merged for CUDA graphs."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..linear import as_rows, row_count
from ..merged_linears import member_out
from ..ops import gated_lora_linear, row_linear
from ..packing import PANEL, constant_weight, is_bf16_tiles, pack_row_linear_int8, pack_row_linear_weight
from ..quantization import Int8Linear, PackedLinear, quantize_weight
from ..weight_arena import kernel_tensor


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

    # decoding copies a compiled step reads (weight_arena), and the base's view of _fused, which must stay its view
    _arena_tensors = ("_fused", "_fused_view", "_fused_scale", "_packed_b")
    _arena_late = ("_packed_b",)  # after every base weight: q/k/v's and gate/up's [W; A] stay adjacent

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
        [N, r] layout sums lanes over r = 16 and took ~2x as long; in bf16 where every value of ``scale · B`` is a
        bf16 value, as the shipped drafters' B (stored in bf16) or a bf16 model's, with a power-of-two scale: half the
        bytes, the same sums), or None where the layout does not apply (N not a
        multiple of 16, or B not on the CPU, which has the only packed kernel: the plain factor is used). Rebuilt
        when B changes (an optimizer step, a load bumps its version); a compiled step reads the copy refreshed before
        it runs (:meth:`Drafter.refresh`)."""
        if torch.compiler.is_compiling():
            return _present(kernel_tensor(self, "_packed_b") if "_packed_b" in self.__dict__ else None)
        b = self.lora_B
        key = (b._version, b.data_ptr(), b.dtype, self.scale)
        if getattr(self, "_packed_b_key", None) != key:
            packed = _absent()
            if b.shape[0] % PANEL == 0 and b.device.type == "cpu":
                with torch.no_grad():
                    scaled = (b.detach().float() * self.scale).contiguous()
                    half = scaled.to(torch.bfloat16)
                    if torch.equal(half.float(), scaled):  # bf16 values (the shipped drafters'): the same sums
                        scaled = half
                    packed = constant_weight(pack_row_linear_weight(scaled))
            _keep(self, _packed_b=packed, _packed_b_key=key)
        return _present(self._packed_b)

    def fused_weight(self) -> torch.Tensor | None:
        """``[W; A]`` in row_linear's packed layout ([(N' + r') / 16, K, 16]: the base's panels, then A's rows padded
        with zero rows to whole panels) where the base is a :class:`~sbd_ext.quantization.PackedLinear` on the CPU
        (``sbd_ext.quantize(model, "packed")``; ``"bf16"``: bf16 panels, A rounded to bf16 too), else None. One
        row_linear call then gives every row's base output and its ``x A^T`` (outputs ``N' .. N' + r``): the A
        product rides in the stream of W's panels instead of a
        call of its own (210 calls of ~2.6 MB of A for SmolLM2; measured 2026-11-27: 27.2 -> 31.4 ms for the base
        plus A products at 4 rows, against 34.5 ms with separate calls, best of 30, Zen 3). Each output sums in the
        same order as the base's own call, so the base's columns are its outputs bit for bit.

        Over a w8a8 base whose weight is in row_linear's packed int8 layout (:class:`~sbd_ext.quantization.Int8Linear`
        on AVX512-VNNI) the same in int8: A quantised per row as the base's rows are, its scales after the base's in
        :meth:`fused_scale` (x is quantised once for both; the base's columns are its outputs bit for bit, integer
        sums and one scale per column). A verify forward's adapter then is one call per projection, not four.

        The base's packed weight is re-pointed to the first N' / 16 panels of this tensor (a view: the same
        values, no second copy of W; an NTP forward reads only W). Rebuilt when the base's packed weight is replaced
        (a ``quantize``, a ``.to()``) and A's rows re-copied in place when A changes (an optimizer step, a load); a
        compiled step reads the copy refreshed before it runs (:meth:`Drafter.refresh`)."""
        if torch.compiler.is_compiling():
            return _present(kernel_tensor(self, "_fused") if "_fused" in self.__dict__ else None)
        base, a = self.base, self.lora_A
        name = _packed_name(base)
        wp = base._buffers.get(name) if name else None
        if wp is None or wp.device.type != "cpu" or a.device.type != "cpu":
            self.drop_fused()
            return None
        fused = getattr(self, "_fused", None)
        if fused is None or wp is not getattr(self, "_fused_view", None):
            with torch.no_grad():
                a_rows, a_scale = _a_rows(a, wp)
                fused = constant_weight(torch.cat([wp.detach(), a_rows]))
                view = constant_weight(fused[: wp.shape[0]])
                scale = None
                if a_scale is not None:
                    scale = constant_weight(torch.cat([_base_scale(base, wp.shape[0] * PANEL), a_scale]))
                base._buffers[name] = view  # the same values: W is stored once, in the fused tensor
            _keep(self, _fused=fused, _fused_view=view, _fused_key=(a._version, a.data_ptr()))
            _keep(self, _fused_scale=_absent() if scale is None else scale)
        elif self._fused_key != (a._version, a.data_ptr()):
            with torch.no_grad():
                a_rows, a_scale = _a_rows(a, wp)
                fused[wp.shape[0] :].copy_(a_rows)
                if a_scale is not None:
                    self._fused_scale[wp.shape[0] * PANEL :].copy_(a_scale)
            self._fused_key = (a._version, a.data_ptr())
        return fused

    def fused_scale(self) -> torch.Tensor | None:
        """The scales of an int8 :meth:`fused_weight` ([P * 16] fp32: the base's, then A's rows'), else None; read
        after :meth:`fused_weight` (which builds both)."""
        return _present(kernel_tensor(self, "_fused_scale") if "_fused_scale" in self.__dict__ else None)

    def drop_fused(self) -> None:
        """Forget :meth:`fused_weight` (the base keeps its packed weight: a view of it, holding W's values)."""
        _keep(self, _fused=_absent(), _fused_view=None, _fused_key=None, _fused_scale=_absent())

    def _fused_out(self, x: torch.Tensor, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the base's output [..., N] (a view of the call's output, bias added), ``x A^T`` [..., r] (a view)) of
        decoding rows ``x`` [..., K] with one row_linear call on :meth:`fused_weight`."""
        n, n_pad = self.out_features, self.base._buffers[_packed_name(self.base)].shape[0] * PANEL
        scale = self.fused_scale()
        out = row_linear(as_rows(x, row_count(x)), fused, scale, scale is not None)
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
                    both_w = constant_weight(torch.cat([w.detach(), adapted]))
                    self.register_buffer("merged_w", both_w, persistent=False)
                    both_b = None if bias is None else constant_weight(torch.cat([bias.detach(), bias.detach()]))
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
        if (gate is not None or rows is not None) and self._row_kernel(x):  # decoding rows through row_linear
            return self._row_kernel_forward(x, gate, rows)
        shared = member_out(self, x) if gate is None and rows is None else None  # q/k/v, gate/up: one call
        if shared is not None:
            return shared if self.base.bias is None else shared + self.base.bias
        y = self.base(x)
        if rows is not None and not torch.is_grad_enabled():  # decoding: the adapter on the block-row slice only
            lo, hi = rows
            ys = y[:, lo:hi]
            xs = x[:, lo:hi].reshape(-1, x.shape[-1])
            a_t, b_t = self._factors(x.dtype)
            if gate is None and ys.is_contiguous():  # one sequence: two GEMMs, the second accumulating into y
                ys.view(-1, ys.shape[-1]).addmm_(torch.mm(xs, a_t), b_t)
            else:
                delta = torch.mm(torch.mm(xs, a_t), b_t).view(ys.shape)
                ys += delta if gate is None else _gated(delta, gate)
            return y
        if gate is None:
            return y
        return y + _gated(self._delta(x), gate)

    def _row_kernel_forward(
        self, x: torch.Tensor, gate: torch.Tensor | None, rows: tuple[int, int] | None
    ) -> torch.Tensor:
        """Decoding rows (``_row_kernel``) with the adapter on the block-row slice ``rows`` (eager) or gated over
        every row (``rows`` None: a compiled step). A compiled step over a packed base runs the whole adapter in one
        :func:`~sbd_ext.ops.gated_lora_linear` call ([W; A] of :meth:`fused_weight`, the packed B, the gate: one
        call per projection where there were four ops, a verify forward ~4 ms faster on SmolLM2, Zen 3). Elsewhere
        the A product comes from the base's own call (:meth:`fused_weight`) or from a call of its own
        (:meth:`_delta_rows`)."""
        fused = self.fused_weight()
        b = None if fused is None or rows is not None else self.packed_b()
        shared = member_out(self, x, gate) if b is not None else None  # q/k/v, gate/up: one call for the group
        if shared is not None:
            return shared if self.base.bias is None else shared + self.base.bias
        if b is not None:  # a compiled step over a packed base: the whole adapter in one call
            x2 = as_rows(x, row_count(x))
            g = gate.to(x.dtype).reshape(-1)
            y = gated_lora_linear(x2, fused, b, g, self.fused_scale()).view(*x.shape[:-1], self.out_features)
            return y if self.base.bias is None else y + self.base.bias
        if fused is not None:
            y, h = self._fused_out(x, fused)
            hs = h if rows is None else h[:, rows[0] : rows[1]]
            delta = self._b_rows(as_rows(hs, row_count(hs)))
        else:
            y = self.base(x)
            xs = x if rows is None else x[:, rows[0] : rows[1]]
            delta = self._delta_rows(as_rows(xs, row_count(xs)))
        if rows is None:  # a compiled step: out of place, the gate over every row
            return y + _gated(delta.view(y.shape), gate)
        y = y.contiguous()  # a fused call's base output is a strided view
        ys = y[:, rows[0] : rows[1]]
        delta = delta.view(ys.shape)
        ys += delta if gate is None else _gated(delta, gate)
        return y


def _gated(delta: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``delta`` on the rows whose gate is set, exactly 0 elsewhere: a select, not ``delta * gate``, so that a
    non-finite adapter output on a block row (a drafter's inf / NaN) never reaches a committed row (inf * 0 = NaN)."""
    return torch.where(gate > 0, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))


def _absent() -> torch.Tensor:
    """What a cached copy (``_fused``, ``_packed_b``) holds where it does not apply: an empty tensor, not None. A
    compiled step reads the copy as a module attribute, and dynamo's guards over two models whose copies are a
    tensor in one and None in the other fail with a TypeError (weak reference to None) instead of recompiling: seen
    with the shipped drafter's compiled verify over a packed base followed by one over a base without a fused
    [W; A] (then a bf16 base; an int8 or unpacked one still has none). A constant to dynamo, as the copies are."""
    return constant_weight(torch.empty(0))


def _keep(module: nn.Module, **copies) -> None:
    """Set a layer's cached copies (constant_weight tensors: constants to dynamo's guards) in its ``__dict__``: an
    ``nn.Parameter`` set as an attribute would register as one of the module's parameters."""
    module.__dict__.update(copies)


def _present(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is not None and t.numel() > 0 else None


def _packed_name(base: nn.Module) -> str | None:
    """The buffer holding a base layer's packed weight that :meth:`GatedLoRALinear.fused_weight` extends: a packed
    fp32 / bf16 layer's panels, or a w8a8 layer's packed int8 panels; None for any other layer."""
    if isinstance(base, PackedLinear):
        return "weight_packed"
    if isinstance(base, Int8Linear) and base.quantize_x and "weight_int8_packed" in base._buffers:
        return "weight_int8_packed"
    return None


def _a_rows(a: torch.Tensor, wp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A's rows in the layout of the base's packed weight ``wp``, padded to whole panels, and (int8) their scales
    padded alike (0 on the padding rows) or None."""
    if wp.dtype != torch.uint8:
        # bf16 base: A rounded too, in the base's layout (panels, or tiles: x rounded to bf16 once for W and A)
        return pack_row_linear_weight(a.detach().float().to(wp.dtype), pad=True, tiles=is_bf16_tiles(wp)), None
    q, scale = quantize_weight(a.detach())
    packed = pack_row_linear_int8(q, pad=True)
    return packed, F.pad(scale, (0, packed.shape[0] * PANEL - scale.shape[0]))


def _base_scale(base: nn.Module, rows: int) -> torch.Tensor:
    """An int8 base layer's row scales padded as its packed weight's rows (``rows``)."""
    scale = base.kernel_weight()[1].detach().float()
    return F.pad(scale, (0, rows - scale.shape[0]))
