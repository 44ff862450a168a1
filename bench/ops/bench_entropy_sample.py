"""entropy_sample vs its reference and vs the PyTorch composite (log_softmax, entropy, argmax), per device.

Reproduce: OMP_NUM_THREADS=1 pytest bench/ops/bench_entropy_sample.py --benchmark-only -m 'not cuda'
           pytest bench/ops/bench_entropy_sample.py -m cuda        (the GPU; how it is timed: bench/ops/cuda_timing.py)
CPU shapes: 16 x 128256 logits (Llama-3 vocabulary, one 16-token block), fp32 and bf16; 16 x 49152 (SmolLM2).
Logits: N(0, 3^2), where nearly every entry needs its Philox draw when sampling at T = 0.8 (the worst case of the
sampling fast path); and "peaked", LLM-like rows (a bulk ~20 below a few top tokens) where most are skipped.
The "ours is N× faster" column of the summary gives sampled / greedy for the "ours-sampling" rows. The groups name
the CPU kernel variant that ran (sbd_ext.build_info()["cpu_isa"]); the CSV note (--sbd-csv) lists the CPU's
vector ISA flags.
GB/s = N * V * element size / time (the logits are read once).
CUDA shapes: {1, 16, 64} x {128256, 49152} bf16 logits N(0, 3^2), greedy, sbd_ext vs reference vs the composite;
16 x 128256 at T = 0.8, sbd_ext vs reference. Target: 16 x 128256 < 10 us.
"""

import pytest
import torch
from cuda_timing import CUDA, REF_ROUNDS, ROUNDS, measure

import sbd_ext
from sbd_ext import reference as R

SHAPES = [(16, 128256), (16, 49152)]
DTYPES = [torch.float32, torch.bfloat16]
ISA = sbd_ext.build_info()["cpu_isa"]


def cpu_flags() -> str:
    """The CPU's vector ISA flags that matter to the kernels (from /proc/cpuinfo; empty elsewhere)."""
    want = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""
    return " ".join(w for w in want if w in flags)


def composite(x):
    """What one writes in PyTorch today: log_softmax, then entropy, max-probability and argmax."""
    lp = torch.log_softmax(x.float(), dim=-1)
    return -(lp.exp() * lp).sum(-1), lp.max(-1).values.exp(), x.argmax(-1)


def _run(benchmark, fn, x, role, name, kind=""):
    n, v = x.shape
    benchmark.group = f"entropy_sample {n}x{v} {str(x.dtype).replace('torch.', '')}{kind} (CPU, {ISA})"
    benchmark.extra_info["role"] = role
    benchmark.extra_info["note"] = f"cpu_isa {ISA}; flags {cpu_flags()}"
    result = benchmark.pedantic(fn, args=(x,), rounds=30, warmup_rounds=3, iterations=1)
    if benchmark.stats is not None:  # None under --benchmark-disable: nothing was timed
        benchmark.extra_info["GB/s"] = n * v * x.element_size() / benchmark.stats.stats.median / 1e9
    return result


@pytest.fixture(
    scope="module", params=[(s, d) for s in SHAPES for d in DTYPES], ids=lambda p: f"{p[0][0]}x{p[0][1]}-{p[1]}"
)
def logits(request):
    (n, v), dtype = request.param
    return (torch.randn(n, v, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)


def test_ours_greedy(benchmark, logits):
    _run(benchmark, lambda x: sbd_ext.entropy_sample(x), logits, "ours", "greedy")


def test_ours_sampled(benchmark, logits):
    _run(benchmark, lambda x: sbd_ext.entropy_sample(x, 0.8, seed=1, offset=2), logits, "ours-sampling", "sampled")


def test_composite(benchmark, logits):
    _run(benchmark, composite, logits, "baseline", "composite")


def test_reference(benchmark, logits):
    _run(benchmark, lambda x: R.entropy_sample(x), logits, "reference", "reference")


@pytest.fixture(scope="module")
def peaked_logits():
    """LLM-like rows: a bulk N(-20, 2^2) below five top tokens N(10, 2^2) (16 x 128256 fp32)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 128256, generator=g) * 2 - 20
    top = torch.randint(0, 128256, (16, 5), generator=g)
    x.scatter_(1, top, torch.randn(16, 5, generator=g) * 2 + 10)
    return x


def test_ours_greedy_peaked(benchmark, peaked_logits):
    _run(benchmark, lambda x: sbd_ext.entropy_sample(x), peaked_logits, "ours", "greedy", " peaked")


def test_ours_sampled_peaked(benchmark, peaked_logits):
    _run(
        benchmark,
        lambda x: sbd_ext.entropy_sample(x, 0.8, seed=1, offset=2),
        peaked_logits,
        "ours-sampling",
        "sampled",
        " peaked",
    )


# ---- CUDA -------------------------------------------------------------------------------------------------------
CUDA_SHAPES = [(1, 128256), (16, 128256), (64, 128256), (1, 49152), (16, 49152), (64, 49152)]
CUDA_CASES = [  # (rows, vocab, temperature, impl)
    *[(n, v, 0.0, impl) for n, v in CUDA_SHAPES for impl in ("sbd_ext", "reference", "composite")],
    *[(16, 128256, 0.8, impl) for impl in ("sbd_ext", "reference")],
]


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: f"{c[0]}x{c[1]}-T{c[2]}-{c[3]}")
def test_entropy_sample(benchmark, device, case):
    """The GPU cases, CUDA-event timed with the L2 flushed (cuda_timing.measure); the CPU cases are above."""
    rows, vocab, temperature, impl = case
    x = torch.randn(rows, vocab, device=device, dtype=torch.bfloat16) * 3
    sampled = (temperature, 1, 2) if temperature else (0.0,)
    fns = {
        "sbd_ext": lambda: sbd_ext.entropy_sample(x, *sampled),
        "reference": lambda: R.entropy_sample(x, *sampled),
        "composite": lambda: composite(x),
    }
    mode = f"T={temperature}" if temperature else "greedy"
    rounds = REF_ROUNDS if impl == "reference" else ROUNDS
    measure(benchmark, "entropy_sample", impl, f"{rows}x{vocab} bf16 {mode}", fns[impl], x.numel() * 2, rounds=rounds)
