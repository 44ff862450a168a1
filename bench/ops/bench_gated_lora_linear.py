"""gated_lora_linear (a projection and its gated LoRA adapter in one call) vs the same products as separate calls
(what a compiled drafter step ran before it: row_linear on the packed [W; A], row_linear on the packed scale * B,
the gated add) and vs torch's linears (F.linear for W, A and B, the gated add), and the float64 reference.

Reproduce: OMP_NUM_THREADS=1 pytest bench/ops/bench_gated_lora_linear.py --benchmark-only
CPU work: every adapted projection of one SmolLM2-135M verify forward (30 layers x q, k, v, o, gate, up, down: 210
adapters of rank 16 over 135 MB of fp32 weights, streamed from memory as a decoding forward does), M in {3, 4, 6}
rows (verify at k = 2 with prompt lookup), the gate on the last two rows (the block rows; the others are clean rows,
the base's computation only), fp32. The reference (float64) runs the first layer only.
"""

import pytest
import torch
from bench_row_linear import HIDDEN, INTER, LAYER_SHAPES, LAYERS

import sbd_ext
from sbd_ext import reference as R
from sbd_ext.ops import gated_lora_linear
from sbd_ext.packing import pack_row_linear_weight

ISA = sbd_ext.build_info()["cpu_isa"]
RANK = 16
ROWS = [3, 4, 6]
_STACK: dict = {}


def _stack():
    """(W, A, scale * B) of every adapted projection, nn.Linear's layout, and their packed forms, built once."""
    if not _STACK:
        g = torch.Generator().manual_seed(0)
        plain, packed = [], []
        for _ in range(LAYERS):
            for n, k in LAYER_SHAPES:
                w, a = torch.randn(n, k, generator=g) * 0.05, torch.randn(RANK, k, generator=g) * 0.05
                b = torch.randn(n, RANK, generator=g) * 0.05
                plain.append((w, a, b))
                packed.append(
                    (
                        torch.cat([pack_row_linear_weight(w), pack_row_linear_weight(a, pad=True)]),
                        pack_row_linear_weight(b),
                    )
                )
        _STACK.update(plain=plain, packed=packed)
    return _STACK


def _inputs(M):
    g = torch.Generator().manual_seed(M)
    gate = torch.zeros(M)
    gate[-2:] = 1.0
    return {k: torch.randn(M, k, generator=g) for k in (HIDDEN, INTER)}, gate


def _fused(x, gate):
    return [gated_lora_linear(x[f.shape[1]], f, b, gate) for f, b in _STACK["packed"]]


def _separate(x, gate):
    """The previous compiled step's ops per adapter: one row_linear on [W; A], a copy of x A^T, row_linear on B,
    the gated add."""
    out = []
    for (f, b), (w, _, _) in zip(_STACK["packed"], _STACK["plain"], strict=True):
        n = w.shape[0]
        both = sbd_ext.row_linear(x[f.shape[1]], f)
        delta = sbd_ext.row_linear(both[:, n : n + RANK].contiguous(), b)
        out.append(both[:, :n] + delta * gate[:, None])
    return out


def _torch(x, gate):
    F = torch.nn.functional
    return [
        F.linear(x[w.shape[1]], w) + F.linear(F.linear(x[w.shape[1]], a), b) * gate[:, None]
        for w, a, b in _STACK["plain"]
    ]


IMPLS = {
    "gated_lora_linear": ("ours", _fused),
    "separate_calls": ("previous", _separate),
    "F.linear": ("baseline", _torch),
}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("M", ROWS)
def test_cpu(benchmark, M, impl):
    _stack()
    role, fn = IMPLS[impl]
    x, gate = _inputs(M)
    benchmark.group = (
        f"gated_lora_linear: the 210 adapters of a SmolLM2-135M verify forward, {M} rows, fp32 (CPU, {ISA})"
    )
    benchmark.extra_info["role"] = role
    with torch.no_grad():
        out = benchmark.pedantic(fn, args=(x, gate), rounds=10, warmup_rounds=2, iterations=1)
    f, b = _STACK["packed"][-1]
    torch.testing.assert_close(out[-1], R.gated_lora_linear(x[INTER], f, b, gate), atol=1e-4, rtol=1e-4)


def test_reference(benchmark):
    _stack()
    x, gate = _inputs(4)
    benchmark.group = f"gated_lora_linear: the 210 adapters of a SmolLM2-135M verify forward, 4 rows, fp32 (CPU, {ISA})"
    benchmark.extra_info["role"] = "reference (first layer)"
    benchmark.pedantic(
        lambda: [R.gated_lora_linear(x[f.shape[1]], f, b, gate) for f, b in _STACK["packed"][:7]],
        rounds=3,
        iterations=1,
    )
