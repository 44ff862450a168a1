"""GPU benchmarks of the three CUDA kernels, each against its pure-PyTorch reference and PyTorch's best built-in.

    SBD_EXT_CUDA=1 python setup.py build_ext --inplace
    pytest bench/bench_cuda_ops.py --benchmark-json=out.json       # or: bash bench/run_gpu.sh bench

Timing: CUDA events around one call, after 3 warm-up calls, with the L2 cache flushed before every call by
reading a 256 MiB buffer (so a cache that fits in the 50 MiB L2 of an H100 is still read from HBM, as it is in a
real forward). Reading, not writing: a write (fill_) leaves ~50 MiB of dirty lines that the timed kernel would pay
to write back. block_attention's kernels are also timed one by one with torch.profiler (attn_us: the attention
kernel, merge_us: the split-KV merge), and a 32-layer run (distinct caches per layer, the 32 calls captured in one
CUDA graph) shows the cost of a whole model's attention without launch gaps.
pytest-benchmark's own (host) timer includes the flush and a synchronisation, so the numbers to
read are in extra_info: gpu_us (median of the event times), GB/s = bytes / gpu_us with the byte count stated per
op, and pct_peak = that over the GPU's peak HBM bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s; other GPUs from
their memory clock and bus width when torch reports them). With SBD_BENCH_OUT set, every measurement is also
appended to $SBD_BENCH_OUT/cuda_ops.csv with the GPU and versions.

Shapes: Llama-3.1-8B (32 q / 8 KV heads, D 128, vocab 128256) and SmolLM2-135M (9 q / 3 KV heads, D 64,
vocab 49152), bf16, batch 1; block attention with 16 query rows (a set block) and 32 (16 committed + 16 block).
Targets: entropy_sample 16 x 128256 < 10 us; block attention <= 1.3x the time of reading the K/V cache
once at peak bandwidth for caches >= 4k; mask_replace < 5 us.
"""

from __future__ import annotations

import csv
import datetime
import os
import statistics
import subprocess

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("pytest_benchmark")

import sbd_ext  # noqa: E402
from sbd_ext import reference as ref  # noqa: E402

CUDA_OK = torch.cuda.is_available() and sbd_ext.build_info()["cuda"]
pytestmark = pytest.mark.skipif(not CUDA_OK, reason="needs an NVIDIA GPU and sbd_ext built with CUDA")

PEAK_BW_TABLE = [
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
]
WARMUP, ROUNDS, REF_ROUNDS = 3, 30, 5


def peak_bandwidth() -> float | None:
    name = torch.cuda.get_device_name()
    for key, bw in PEAK_BW_TABLE:
        if key in name:
            return bw
    p = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None  # double data rate


_flush_buf = None


def flush_l2() -> None:
    global _flush_buf
    if _flush_buf is None:
        _flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    _flush_buf.amax()  # a read of every line: evicts what is cached and leaves nothing dirty


def kernel_times(fn, rounds: int = 10) -> dict[str, float]:
    """Device time (us) per call of `fn` of each sbd_ext CUDA kernel it launches (all its launches of that kernel,
    averaged over `rounds` calls), by torch.profiler, the L2 flushed before each call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm-up outside the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            flush_l2()
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and "sbd_cuda" in e.name:
            totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us()
    return {name: t / rounds for name, t in totals.items()}


def gpu_times(fn, rounds: int, setup=None) -> list[float]:
    """Microseconds of `fn` per call by CUDA events, L2 flushed (and `setup` run, untimed) before each call."""
    for _ in range(WARMUP):
        if setup:
            setup()
        fn()
    times = []
    for _ in range(rounds):
        flush_l2()
        if setup:
            setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(__file__)
        ).stdout.strip()
    except OSError:
        return ""


def measure(
    benchmark,
    op: str,
    impl: str,
    shape: str,
    fn,
    nbytes: int | None,
    rounds: int = ROUNDS,
    roofline_bytes: int | None = None,
    setup=None,
    extra: dict | None = None,
) -> float:
    """Times fn, records the numbers in benchmark.extra_info and the CSV, returns the median in us."""
    times = gpu_times(fn, rounds, setup)
    med = statistics.median(times)
    peak = peak_bandwidth()
    info = {
        "op": op,
        "impl": impl,
        "shape": shape,
        "gpu_us": round(med, 2),
        "gpu_us_min": round(min(times), 2),
        "rounds": rounds,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": _git_commit(),
        **(extra or {}),
    }
    if nbytes:
        gbs = nbytes / (med * 1e-6) / 1e9
        info.update(bytes=nbytes, gb_per_s=round(gbs, 1))
        if peak:
            info["pct_peak"] = round(100 * gbs * 1e9 / peak, 1)
    if roofline_bytes and peak:
        info["x_roofline"] = round(med * 1e-6 / (roofline_bytes / peak), 2)  # 1.0 = reading those bytes at peak
    benchmark.extra_info.update(info)
    benchmark.group = f"{op} {shape}"

    # pytest-benchmark wants something to time: one more call, host-timed (includes the flush and a sync).
    def host_setup():
        flush_l2()
        if setup:
            setup()

    benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), setup=host_setup, rounds=1, iterations=1)
    out = os.environ.get("SBD_BENCH_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "cuda_ops.csv")
        new = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(
                f,
                fieldnames=[
                    "time",
                    "op",
                    "impl",
                    "shape",
                    "gpu_us",
                    "gpu_us_min",
                    "bytes",
                    "gb_per_s",
                    "pct_peak",
                    "x_roofline",
                    "attn_us",
                    "merge_us",
                    "rounds",
                    "gpu",
                    "torch",
                    "cuda",
                    "commit",
                ],
            )
            if new:
                w.writeheader()
            w.writerow({"time": datetime.datetime.now().isoformat(timespec="seconds"), **info})
    return med


# ---- entropy_sample ---------------------------------------------------------------------------------------
def torch_entropy_composite(x: torch.Tensor):
    """PyTorch's best built-in: log_softmax, then entropy, max probability and argmax (several passes)."""
    lp = torch.log_softmax(x.float(), dim=-1)
    p = lp.exp()
    return -(p * lp).sum(-1), p.amax(-1), x.argmax(-1)


ENTROPY_SHAPES = [(1, 128256), (16, 128256), (64, 128256), (1, 49152), (16, 49152), (64, 49152)]


@pytest.mark.parametrize("impl", ["sbd_ext", "reference", "torch"])
@pytest.mark.parametrize("rows,vocab", ENTROPY_SHAPES, ids=[f"{n}x{v}" for n, v in ENTROPY_SHAPES])
def test_entropy_sample(benchmark, rows, vocab, impl):
    x = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    fns = {
        "sbd_ext": lambda: sbd_ext.entropy_sample(x, 0.0),
        "reference": lambda: ref.entropy_sample(x, 0.0),
        "torch": lambda: torch_entropy_composite(x),
    }
    measure(
        benchmark,
        "entropy_sample",
        impl,
        f"{rows}x{vocab} bf16 greedy",
        fns[impl],
        x.numel() * 2,
        rounds=ROUNDS if impl != "reference" else REF_ROUNDS,
    )


@pytest.mark.parametrize("impl", ["sbd_ext", "reference"])
def test_entropy_sample_temperature(benchmark, impl):
    x = torch.randn(16, 128256, device="cuda", dtype=torch.bfloat16) * 3
    fn = (
        (lambda: sbd_ext.entropy_sample(x, 0.8, 1, 2))
        if impl == "sbd_ext"
        else lambda: ref.entropy_sample(x, 0.8, 1, 2)
    )
    measure(
        benchmark,
        "entropy_sample",
        impl,
        "16x128256 bf16 T=0.8",
        fn,
        x.numel() * 2,
        rounds=ROUNDS if impl == "sbd_ext" else REF_ROUNDS,
    )


# ---- block_attention --------------------------------------------------------------------------------------
ATTN_SHAPES = [  # (model, Hq, Hkv, D, cache length, T rows, committed rows)
    *[("llama3.1-8b", 32, 8, 128, L, T, T - 16) for L in (1024, 4096, 16384, 32768) for T in (16, 32)],
    *[("smollm2-135m", 9, 3, 64, L, 16, 0) for L in (1024, 4096)],
]


def attn_inputs(Hq, Hkv, D, L, T, c):
    B, dt = 1, torch.bfloat16
    S = L + T
    q = torch.randn(B, Hq, T, D, device="cuda", dtype=dt)
    k, v = torch.randn(2, B, Hkv, T, D, device="cuda", dtype=dt)
    kc, vc = torch.randn(2, B, Hkv, S, D, device="cuda", dtype=dt)
    lens = torch.tensor([L], device="cuda", dtype=torch.int32)
    commit = torch.tensor([c], device="cuda", dtype=torch.int32)
    valid = torch.tensor([T], device="cuda", dtype=torch.int32)
    return q, k, v, kc, vc, lens, commit, valid


@pytest.mark.parametrize("impl", ["sbd_ext", "reference", "torch_sdpa"])
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=[f"{m}-L{L}-T{T}" for m, _, _, _, L, T, _ in ATTN_SHAPES])
def test_block_attention(benchmark, shape, impl):
    model, Hq, Hkv, D, L, T, c = shape
    q, k, v, kc, vc, lens, commit, valid = attn_inputs(Hq, Hkv, D, L, T, c)
    scale = D**-0.5
    # Bytes that must move: the K/V cache once (the roofline), plus the new rows' q / k / v and the output.
    kv_bytes = 2 * Hkv * L * D * 2
    nbytes = kv_bytes + (Hq * T * D * 2) * 2 + 2 * Hkv * T * D * 2 * 2
    extra = None
    if impl == "sbd_ext":
        fn = lambda: sbd_ext.block_attention(q, k, v, kc, vc, lens, commit, valid, scale)  # noqa: E731
        extra = split_attention_merge(kernel_times(fn))
    elif impl == "reference":
        if L > 16384:
            pytest.skip("the dense fp32 reference at 32k is minutes of memory traffic per call; not informative")
        fn = lambda: ref.block_attention(q, k, v, kc, vc, lens, commit, valid, scale)  # noqa: E731
    else:
        # SDPA over a cache that already holds the new rows (they were appended outside the timed region), with
        # the equivalent boolean mask and GQA done inside SDPA: a lower bound for the built-in path.
        kc[:, :, L : L + T] = k
        vc[:, :, L : L + T] = v
        mask = ref.block_attention_mask(lens, commit, valid, T, L)[:, None]  # [1, 1, T, L + T]
        keys, vals = kc[:, :, : L + T], vc[:, :, : L + T]
        fn = lambda: F.scaled_dot_product_attention(
            q,
            keys,
            vals,
            attn_mask=mask,
            scale=scale,  # noqa: E731
            enable_gqa=True,
        )
    measure(
        benchmark,
        "block_attention",
        impl,
        f"{model} L={L} T={T} (commit {c}) bf16",
        fn,
        nbytes,
        rounds=ROUNDS if impl != "reference" else REF_ROUNDS,
        roofline_bytes=kv_bytes,
        extra=extra,
    )


def split_attention_merge(per_kernel: dict[str, float]) -> dict[str, float]:
    """attn_us (the attention kernel) and merge_us (the split-KV merge) from kernel_times' per-call times."""
    attn = sum(t for name, t in per_kernel.items() if "attn_mma_kernel" in name or "attn_simt_kernel" in name)
    merge = sum(t for name, t in per_kernel.items() if "attn_merge_kernel" in name)
    return {"attn_us": round(attn, 2), "merge_us": round(merge, 2)}


LAYERS = 32


@pytest.mark.parametrize("L", [4096, 32768])
def test_block_attention_32_layers_graph(benchmark, L):
    """A Llama-3.1-8B forward's attention: 32 calls on 32 distinct caches (as a model's layers), captured in one
    CUDA graph and replayed, so the time is the kernels' alone; x_roofline against reading all 32 caches once."""
    Hq, Hkv, D, T = 32, 8, 128, 16
    layers = [attn_inputs(Hq, Hkv, D, L, T, 0) for _ in range(LAYERS)]  # n_commit 0: replays write nothing

    def forward():
        for q, k, v, kc, vc, lens, commit, valid in layers:
            sbd_ext.block_attention(q, k, v, kc, vc, lens, commit, valid, D**-0.5)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    kv_bytes = LAYERS * 2 * Hkv * L * D * 2
    measure(
        benchmark,
        "block_attention_32_layers",
        "sbd_ext graph",
        f"llama3.1-8b x{LAYERS} layers L={L} T={T} bf16",
        graph.replay,
        kv_bytes,
        roofline_bytes=kv_bytes,
        extra=split_attention_merge(kernel_times(forward, rounds=3)),
    )


@pytest.mark.parametrize("splits", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("L", [4096, 32768])
def test_block_attention_split_sweep(benchmark, L, splits, monkeypatch):
    """Tuning data for block_attention_plan: the same Llama-3.1-8B shape under a forced number of cache splits."""
    monkeypatch.setenv("SBD_EXT_ATTN_SPLITS", str(splits))
    Hq, Hkv, D, T = 32, 8, 128, 16
    q, k, v, kc, vc, lens, commit, valid = attn_inputs(Hq, Hkv, D, L, T, 0)
    kv_bytes = 2 * Hkv * L * D * 2
    fn = lambda: sbd_ext.block_attention(q, k, v, kc, vc, lens, commit, valid)  # noqa: E731
    measure(
        benchmark,
        "block_attention_splits",
        f"splits={splits}",
        f"llama3.1-8b L={L} T={T} bf16",
        fn,
        kv_bytes,
        roofline_bytes=kv_bytes,
    )


# ---- mask_replace -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["sbd_ext", "reference"])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_mask_replace(benchmark, batch, impl):
    K, mask_id = 16, 0
    tokens = torch.zeros(batch, K, dtype=torch.int64, device="cuda")
    proposals = torch.randint(1, 1000, (batch, K), device="cuda")
    ent = torch.rand(batch, K, device="cuda")
    conf = torch.rand(batch, K, device="cuda")
    op = sbd_ext.mask_replace if impl == "sbd_ext" else ref.mask_replace

    # Every call starts from a fully masked block; the reset runs before the start event.
    measure(
        benchmark,
        "mask_replace",
        impl,
        f"{batch}x{K} eb",
        lambda: op(tokens, proposals, ent, conf, mask_id, "eb", 0.35),
        None,
        rounds=ROUNDS if impl == "sbd_ext" else REF_ROUNDS,
        setup=tokens.zero_,
    )
