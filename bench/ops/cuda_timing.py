"""How the bench/ops benchmarks time an op on the GPU (imported by their CUDA cases; not a benchmark itself).

Timing: CUDA events around one call, after 3 warm-up calls, with the L2 cache flushed before every call by
reading a 256 MiB buffer (so a cache that fits in the 50 MiB L2 of an H100 is still read from HBM, as it is in a
real forward). Reading, not writing: a write (fill_) leaves ~50 MiB of dirty lines that the timed kernel would pay
to write back. kernel_times splits an op's device time by kernel with torch.profiler (block_attention: attn_us, the
attention kernel, and merge_us, the split-KV merge).
pytest-benchmark's own (host) timer includes the flush and a synchronisation, so the numbers to read are in
extra_info: gpu_us (median of the event times), GB/s = bytes / gpu_us with the byte count stated per op, and
pct_peak = that over the GPU's peak HBM bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s; other GPUs from their memory
clock and bus width when torch reports them). With SBD_BENCH_OUT set, every measurement is also appended to
$SBD_BENCH_OUT/cuda_ops.csv with the GPU and versions (bash bench/run_gpu.sh bench).
"""

from __future__ import annotations

import csv
import datetime
import os
import statistics
import subprocess

import pytest
import torch

import sbd_ext

CUDA_OK = torch.cuda.is_available() and sbd_ext.build_info()["cuda"]
# The device parameter of the op benchmarks' GPU cases: marked `cuda` (as the tests are; `-m cuda` selects them) and
# skipped when no GPU or no CUDA build is present.
CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA_OK, reason="needs an NVIDIA GPU and sbd_ext built with CUDA")],
)

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
