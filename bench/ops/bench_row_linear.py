"""row_linear (on nn.Linear's weight layout, and on its panel layout: ``row_linear_packed``) vs torch's linear (MKL
GEMM), MKL's pre-packed linear (what torch.compile's CPU freezing uses) and the float64 reference, per device.

Reproduce: OMP_NUM_THREADS=1 pytest bench/ops/bench_row_linear.py --benchmark-only -m 'not cuda'
           pytest bench/ops/bench_row_linear.py -m cuda        (the GPU; how it is timed: bench/ops/cuda_timing.py)
CPU work: every linear of one SmolLM2-135M forward for M rows (30 layers x q, k, v, o, gate, up, down, then the
49153-row output head: 537 MB of fp32 weights, more than any cache, so each call streams them from memory as a
decoding forward does), M in {1, 2, 3, 4, 8, 16, 24} (NTP; verify at k = 2: 3-4 rows; an SBD block of 8; verify's
committed block + block; the limit region), fp32; and the output head alone. GB/s = weight bytes / time (the
one-row case's floor is the memory's rate). The reference (float64) runs the head only, at M = 8.
w8a8 (``sbd_ext.quantize(model, "w8a8")``'s packed int8 panels, x quantised per block of 32; AVX512-VNNI CPUs only):
``row_linear_w8a8`` on the VNNI panels (AMX off) and, where the CPU has AMX-INT8, ``row_linear_w8a8_amx`` on the
tiles from ``cpu_amx_min_rows`` rows (issue 63: a 16-row forward at <= 1.3x a one-row one); GB/s over the int8 bytes.
CUDA: Llama-3.1-8B's MLP up projection (14336 x 4096) and output head (128256 x 4096), fp32, M in {1, 16}: the op is
cuBLAS there (at::mm), so this checks it adds nothing.
"""

import pytest
import torch
from cuda_timing import CUDA, ROUNDS, measure
from torch import nn

import sbd_ext
from sbd_ext import reference as R
from sbd_ext.packing import pack_row_linear_weight
from sbd_ext.quantization import quantize_weight

INFO = sbd_ext.build_info()
ISA = INFO["cpu_isa"]
HIDDEN, INTER, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49153
ROWS = [1, 2, 3, 4, 8, 16, 24]
LAYER_SHAPES = [  # [out, in] of one SmolLM2-135M layer: q, k, v, o, gate, up, down (also bench_gated_lora_linear.py)
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (INTER, HIDDEN),
    (INTER, HIDDEN),
    (HIDDEN, INTER),
]
_STACK: dict = {}


def _stack():
    """The weights of one forward ([out, in], nn.Linear's layout), built once."""
    if not _STACK:
        g = torch.Generator().manual_seed(0)
        ws = [torch.randn(n, k, generator=g) * 0.05 for _ in range(LAYERS) for n, k in LAYER_SHAPES]
        _STACK["w"] = ws + [torch.randn(VOCAB, HIDDEN, generator=g) * 0.05]
    return _STACK["w"]


def _inputs(M, ws):
    g = torch.Generator().manual_seed(M)
    return {k: torch.randn(M, k, generator=g) for k in {w.shape[1] for w in ws}}


def _bytes(ws):
    return sum(w.numel() for w in ws) * 4


def _mkl_packed(M, ws):
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, M) for w in ws]
    return lambda x: [torch.ops.mkl._mkl_linear(x[w.shape[1]], p, w, None, M) for p, w in zip(packed, ws, strict=True)]


def _packed(M, ws):
    """row_linear on the weights in its panel layout (sbd_ext.quantize(model, "packed")); the head's 49153 rows padded
    to 49168 (the layer drops the padding's outputs: here a view)."""
    packed = [pack_row_linear_weight(w, pad=True) for w in ws]
    return lambda x: [sbd_ext.row_linear(x[w.shape[1]], p)[:, : w.shape[0]] for p, w in zip(packed, ws, strict=True)]


_INT8: dict = {}


def _w8a8(amx):
    """row_linear on the weights as sbd_ext.quantize(model, "w8a8") keeps them on an AVX512-VNNI CPU (packed int8
    panels, N padded to 16, one scale per row), with the AMX tiles on or off (restored to "auto" after each call)."""

    def make(M, ws):
        if not INFO["cpu_vnni"] or (amx and not INFO["cpu_amx_int8"]):
            pytest.skip("needs AVX512-VNNI" + (" and AMX-INT8" if amx else ""))
        key = tuple(w.shape for w in ws)
        if key not in _INT8:  # the library's own w8a8 layers, their kernel arguments as their forward passes them
            lins = nn.ModuleList(nn.Linear(w.shape[1], w.shape[0], bias=False) for w in ws)
            with torch.no_grad():
                for lin, w in zip(lins, ws, strict=True):
                    lin.weight.copy_(w)
            _INT8[key] = [(*m.kernel_weight(), m.out_features, m.in_features) for m in sbd_ext.quantize(lins, "w8a8")]
        layers = _INT8[key]

        def run(x):
            sbd_ext._C.set_cpu_amx("on" if amx else "off")
            try:
                return [sbd_ext.row_linear(x[k], p, s, quantize_x=True)[:, :n] for p, s, n, k in layers]
            finally:
                sbd_ext._C.set_cpu_amx("auto")

        return run

    return make


IMPLS = {
    "row_linear": ("ours", lambda M, ws: lambda x: [sbd_ext.row_linear(x[w.shape[1]], w) for w in ws]),
    "row_linear_w8a8": ("ours", _w8a8(amx=False)),
    "row_linear_w8a8_amx": ("ours", _w8a8(amx=True)),
    "row_linear_packed": ("ours", _packed),
    "F.linear": ("baseline", lambda M, ws: lambda x: [torch.nn.functional.linear(x[w.shape[1]], w) for w in ws]),
    "mkl_packed": ("baseline", _mkl_packed),
}


def _run(benchmark, what, M, impl):
    ws = _stack() if what == "forward" else _stack()[-1:]
    role, make = IMPLS[impl]
    fn, x = make(M, ws), _inputs(M, ws)
    dtype = "w8a8" if "w8a8" in impl else "fp32"
    benchmark.group = (
        f"row_linear: {'one SmolLM2-135M forward' if what == 'forward' else 'output head'}, {M} rows, {dtype} "
        f"(CPU, {ISA})"
    )
    benchmark.extra_info["role"] = role
    out = benchmark.pedantic(fn, args=(x,), rounds=5 if what == "forward" else 10, warmup_rounds=1, iterations=1)
    if benchmark.stats is not None:
        benchmark.extra_info["GB/s"] = _bytes(ws) / (4 if dtype == "w8a8" else 1) / benchmark.stats.stats.median / 1e9
    return out, x, ws


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("what", ["forward", "head"])
def test_cpu(benchmark, what, M, impl):
    out, x, ws = _run(benchmark, what, M, impl)
    w = ws[-1]
    if "w8a8" in impl:
        q, s = quantize_weight(w)
        torch.testing.assert_close(out[-1], R.row_linear(x[w.shape[1]], q, s, quantize_x=True), atol=1e-3, rtol=1e-4)
    else:
        torch.testing.assert_close(out[-1], R.row_linear(x[w.shape[1]], w), atol=1e-3, rtol=1e-4)


def test_reference(benchmark):
    w = _stack()[-1]
    x = _inputs(8, [w])[HIDDEN]
    benchmark.group = f"row_linear: output head, 8 rows, fp32 (CPU, {ISA})"
    benchmark.extra_info["role"] = "reference"
    benchmark.pedantic(R.row_linear, args=(x, w), rounds=3, warmup_rounds=1, iterations=1)


# ---- CUDA ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("impl", ["sbd_ext", "F.linear"])
@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("N", [14336, 128256])
def test_row_linear(benchmark, device, N, M, impl):
    """The GPU cases, CUDA-event timed (cuda_timing.measure); the CPU cases are above."""
    w = torch.randn(N, 4096, device=device) * 0.02
    x = torch.randn(M, 4096, device=device)
    op = sbd_ext.row_linear if impl == "sbd_ext" else torch.nn.functional.linear
    measure(benchmark, "row_linear", impl, f"{M}x{N}x4096 fp32", lambda: op(x, w), N * 4096 * 4, rounds=ROUNDS)
