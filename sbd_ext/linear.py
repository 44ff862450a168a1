"""The row_linear op in a model: :class:`RowLinear` is ``nn.Linear`` whose forward runs
:func:`sbd_ext.ops.row_linear` for the few rows of a decoding forward on the CPU.

Why: a decoding forward has 1 row (NTP) to 2k rows (SBD: the committed block plus the k-row block). On a CPU the
BLAS GEMM behind ``nn.Linear`` is tuned for many rows; for 8-24 rows it re-packs the weight at every call and runs
far below the core's FMA rate (and at 49k output rows far below its memory rate), so an SBD forward cost about
1.8x a one-row forward on SmolLM2-135M where its FLOPs allow ~1.2x. row_linear reads each weight row once for all
x rows (csrc/cpu/row_linear_kernel.cpp).

:func:`use_row_linear` switches a model's plain ``nn.Linear`` layers (not subclasses: quantised or adapter
layers keep their own forward) to :class:`RowLinear` in place, by class: parameters, hooks, ``state_dict`` and
``repr`` are unchanged. :func:`sbd_ext.generate` does this for fp32 and bf16 CPU models on its first call (once,
like the attention switch) unless :func:`use_row_linear` was called with ``False`` for that model. A RowLinear forward
falls back to ``F.linear`` for other dtypes or devices and whenever autograd needs a graph, so training is
unaffected. It calls the op for any row count: past :data:`ROW_LIMIT` rows (a prefill) the op itself runs the
framework's GEMM, so the layer never branches on its row count -- under torch.compile, whose decode step marks the row
count dynamic, such a branch would be a guard and each side of it a graph (a second cold compile for the prefill).
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.nn import functional as F

from . import _C
from .ops import row_linear

__all__ = ["ROW_LIMIT", "RowLinear", "as_rows", "bf16_tiles_in_use", "ensure_row_linear", "row_count"]
__all__ += ["row_linear_state", "use_row_linear"]

# Up to this many rows row_linear's kernel is faster than F.linear on the machines measured (bench/ops/
# bench_row_linear.py: at SmolLM2's shapes on a 2-core AVX2 EPYC); beyond it the BLAS GEMM's blocking wins, and the op
# switches to it (fp32) or to slices of this many rows (int8). Defined once, in C++ (csrc/cpu/row_linear_kernel.h
# kRowLinearRows); read here from the build.
ROW_LIMIT: int = _C.build_info()["cpu_row_linear_rows"]


def bf16_tiles_in_use() -> bool:
    """Whether row_linear runs a bf16 weight in tiles on AMX-BF16 here, now (or on their emulation:
    ``SBD_EXT_CPU_AMX=emulate``): where it does, ``sbd_ext.quantize(model, "bf16")`` packs the weights in tiles
    (:func:`sbd_ext.packing.pack_row_linear_weight` with ``tiles=True``); ``build_info()["cpu_bf16_tiles"]``: how."""
    return _C.cpu_bf16_tiles() != "model"


_OPT_OUT = "_sbd_row_linear_off"
_LOCK = threading.Lock()


def row_count(x: torch.Tensor) -> int:
    """The rows of a linear layer's input [..., K] (0 for a 0-d tensor)."""
    return x.numel() // max(x.shape[-1], 1) if x.dim() > 0 else 0


def as_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` [..., K] as the [rows, K] operand of row_linear: a view where it can be (rows may stay strided), K
    contiguous."""
    x2 = x.reshape(rows, x.shape[-1])
    return x2.contiguous() if x2.shape[-1] > 1 and x2.stride(-1) != 1 else x2


class RowLinear(nn.Linear):
    """``nn.Linear`` with row_linear for fp32 or bf16 CPU rows without an autograd graph.

    A bf16 layer (bf16 x and weight): the op widens both in registers, sums the exact products in fp32 in its fixed
    order and rounds the result to bf16 once -- like ``F.linear`` in bf16, but with sums that do not depend on the row
    count (batch invariance), which the framework's bf16 GEMM does not promise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = row_count(x)
        if (
            rows > 0  # no upper bound here: the op takes a prefill (see the module doc)
            and x.device.type == "cpu"
            and x.dtype == w.dtype
            and w.dtype in (torch.float32, torch.bfloat16)
            and w.device.type == "cpu"
            and w.stride(-1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        ):
            out = row_linear(as_rows(x, rows), w).view(*x.shape[:-1], w.shape[0])
            return out if self.bias is None else out + self.bias
        return F.linear(x, w, self.bias)


def use_row_linear(model: nn.Module, enable: bool = True) -> int:
    """Switch every plain ``nn.Linear`` of ``model`` to :class:`RowLinear` (``enable=False``: back to
    ``nn.Linear``, and :func:`sbd_ext.generate` will not switch this model again). Returns how many layers changed."""
    src, dst = (nn.Linear, RowLinear) if enable else (RowLinear, nn.Linear)
    with _LOCK:
        changed = 0
        for module in model.modules():
            if type(module) is src:
                module.__class__ = dst
                changed += 1
        setattr(model, _OPT_OUT, not enable)
    return changed


def ensure_row_linear(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """What :func:`sbd_ext.generate` calls: switch an fp32 or bf16 CPU model once, unless it was opted out."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return
    if getattr(model, _OPT_OUT, None) is not None:
        return
    use_row_linear(model)


def row_linear_state(model: nn.Module) -> bool | None:
    """True / False after :func:`use_row_linear` switched ``model`` on / off, None if never: part of a compiled
    variant's key (torch.compile guards on the layers' class, so each state is its own graph)."""
    off = getattr(model, _OPT_OUT, None)
    return None if off is None else not off
