"""Benchmark of block_attention: sbd_ext's op vs its reference vs torch SDPA on the same work, per device.

CPU work (one attention layer of Llama-3.1-8B during SBD decoding, batch 1): Hq = 32, Hkv = 8, D = 128, a cache of
2048 rows, 32 new rows, either the 2k layout (16 committed causal rows + a 16-row set block) or a 32-row set block.
SDPA gets the same keys (cache rows + new rows, concatenated beforehand) and the equivalent boolean mask
(sbd_ext.reference.block_attention_mask); for the all-block layout, whose mask is all-true, also no mask at all.
Its GQA variants: enable_gqa=True, and K/V repeated to Hq heads beforehand. Everything SDPA needs is prepared
outside the timed region; sbd_ext's time includes its cache append. The best SDPA variant is the "best existing
alternative".

Effective bandwidth = (K/V of cache + new rows read once + q read + output written) / time. With 128 query rows
per kv head the work is compute-bound (~130 flop per byte), so the table also gives the arithmetic rate,
4 * Hq * T * (cache + T) * D flop (QK^T and PV over every key, masked or not) / time.

Reproduce (2-core AVX-512 CPU, torch's default thread count):
    python -m pytest bench/ops/bench_block_attention.py --benchmark-columns=min,median,rounds --benchmark-sort=fullname
A summary table with GB/s and the ratios is printed after the last benchmark, before pytest-benchmark's tables.
On a machine shared with other jobs, wall-clock times of multi-threaded runs mostly measure the scheduler; the
per-thread CPU time of a one-thread run is a steadier comparison of the kernels themselves:
    OMP_NUM_THREADS=1 python -m pytest bench/ops/bench_block_attention.py --benchmark-timer=time.thread_time

CUDA cases (pytest bench/ops/bench_block_attention.py -m cuda; timing: bench/ops/cuda_timing.py): Llama-3.1-8B
(32 q / 8 KV heads, D 128) at caches of 1k-32k rows with 16 query rows (a set block) and 32 (16 committed + 16 block),
SmolLM2-135M (9 q / 3 KV heads, D 64) at 1k and 4k, bf16, batch 1, vs the reference and SDPA (GQA inside SDPA, the
new rows appended beforehand); sbd_ext's attention and split-KV merge kernels also timed one by one (torch.profiler).
Two CUDA-only measurements of this op: 32 layers (distinct caches) captured in one CUDA graph, the cost of a whole
model's attention without launch gaps; and the sweep over forced cache splits (tuning data for block_attention_plan).
Target: <= 1.3x the time of reading the K/V cache once at peak bandwidth for caches >= 4k.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cuda_timing import CUDA, REF_ROUNDS, ROUNDS, kernel_times, measure

import sbd_ext
from sbd_ext import reference

B, HQ, HKV, D, CACHE, T = 1, 32, 8, 128, 2048, 32
G = HQ // HKV
LAYOUTS = {"16c+16b": 16, "32b": 0}  # name -> committed rows; the other rows of the 32 are the set block
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# sbd_ext: the automatic choice of matrix path (build_info()["cpu_bf16_attention"] for bf16); sbd_ext_vector /
# sbd_ext_gemm / sbd_ext_tiles: the other paths forced (set_block_attention_matmul), the one equal to the automatic
# choice skipped, and the tiles (bf16 on AMX-BF16) where they are off or for another type.
IMPLS = [
    "sbd_ext",
    "sbd_ext_vector",
    "sbd_ext_gemm",
    "sbd_ext_tiles",
    "reference",
    "sdpa_gqa",
    "sdpa_repeat",
    "sdpa_gqa_nomask",
]


def _auto_path(dtype: torch.dtype) -> str:
    info = sbd_ext.build_info()
    return {torch.bfloat16: info["cpu_bf16_attention"], torch.float16: info["cpu_fp16_attention"]}.get(dtype, "vector")


_results: dict[tuple[str, str, str], tuple[float, float]] = {}  # (dtype, layout, impl) -> (median s, GB/s)


def _bytes(dtype: torch.dtype) -> int:
    e = torch.finfo(dtype).bits // 8
    kv = 2 * B * HKV * (CACHE + T) * D * e
    return kv + 2 * B * HQ * T * D * e  # + q read + out written


def _flops() -> int:
    return 4 * B * HQ * T * (CACHE + T) * D


def _work(dtype: torch.dtype, n_commit: int):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, HQ, D, generator=gen).to(dtype).transpose(1, 2)  # the HF layout
    k, v = (torch.randn(B, HKV, T, D, generator=gen).to(dtype) for _ in range(2))
    kc, vc = (torch.randn(B, HKV, CACHE + T, D, generator=gen).to(dtype) for _ in range(2))
    lens = torch.full((B,), CACHE, dtype=torch.int32)
    commit = torch.full((B,), n_commit, dtype=torch.int32)
    valid = torch.full((B,), T, dtype=torch.int32)
    return q, k, v, kc, vc, lens, commit, valid


def _fn(impl: str, dtype: torch.dtype, n_commit: int):
    q, k, v, kc, vc, lens, commit, valid = _work(dtype, n_commit)
    scale = D**-0.5
    if impl.startswith("sbd_ext"):
        path = impl.removeprefix("sbd_ext_") if impl != "sbd_ext" else None
        if path == _auto_path(dtype):
            pytest.skip(f"the automatic choice for {dtype} is {path}: the sbd_ext row")
        if path == "tiles" and (dtype != torch.bfloat16 or sbd_ext.build_info()["cpu_bf16_tiles"] == "model"):
            pytest.skip("the tiles path runs bf16 where the AMX-BF16 tiles are on")

        def run():
            sbd_ext._C.set_block_attention_matmul(path or "auto")
            try:
                return sbd_ext.block_attention(q, k, v, kc, vc, lens, commit, valid, scale)
            finally:
                sbd_ext._C.set_block_attention_matmul("auto")

        return run
    if impl == "reference":
        return lambda: reference.block_attention(q, k, v, kc, vc, lens, commit, valid, scale)
    keys = torch.cat([kc[:, :, :CACHE], k], dim=2)  # [B, Hkv, CACHE + T, D]
    vals = torch.cat([vc[:, :, :CACHE], v], dim=2)
    mask = reference.block_attention_mask(lens, commit, valid, T, CACHE)[:, None]  # [B, 1, T, CACHE + T]
    if impl == "sdpa_gqa":
        return lambda: F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale, enable_gqa=True)
    if impl == "sdpa_gqa_nomask":
        if not mask.all():
            pytest.skip("the mask is not all-true: no-mask SDPA would be different work")
        return lambda: F.scaled_dot_product_attention(q, keys, vals, scale=scale, enable_gqa=True)
    keys, vals = keys.repeat_interleave(G, dim=1), vals.repeat_interleave(G, dim=1)
    return lambda: F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_block_attention(benchmark, dtype_name, layout, impl):
    dtype = DTYPES[dtype_name]
    fn = _fn(impl, dtype, LAYOUTS[layout])
    benchmark.group = f"block_attention {dtype_name} {layout}"
    # The forced GEMM path on a CPU without bf16 units is cpublas's reference loops: seconds per call.
    slow = impl == "reference" or (impl == "sbd_ext_gemm" and dtype != torch.float32)
    rounds = 5 if slow else 30
    before = sbd_ext._C.block_attention_cpu_paths()
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=2)
    after = sbd_ext._C.block_attention_cpu_paths()
    if benchmark.stats is None:  # --benchmark-disable: the work ran once, as a check; nothing was timed
        return
    path = (
        "tiles"
        if after[2] > before[2]
        else "gemm"
        if after[1] > before[1]
        else "vector"
        if after[0] > before[0]
        else "-"
    )
    t_min, t_median = benchmark.stats.stats.min, benchmark.stats.stats.median
    benchmark.extra_info.update(
        dtype=dtype_name, layout=layout, B=B, Hq=HQ, Hkv=HKV, D=D, cache=CACHE, T=T,
        gbps_median=round(_bytes(dtype) / t_median / 1e9, 2), gflops_median=round(_flops() / t_median / 1e9, 1),
        gbps_min=round(_bytes(dtype) / t_min / 1e9, 2), gflops_min=round(_flops() / t_min / 1e9, 1),
        threads=torch.get_num_threads(), cpu_isa=sbd_ext.build_info()["cpu_isa"], matmul=path,
    )  # fmt: skip
    # Roles for bench/conftest.py's ratio table and CSV: the automatic choice is "ours", the forced other path an
    # alternative of ours, SDPA the baseline.
    role = {"sbd_ext": "ours", "reference": "reference"}.get(impl, "ours-alt" if impl.startswith("sbd") else "baseline")
    benchmark.extra_info.update(role=role, note=f"cpu_isa {sbd_ext.build_info()['cpu_isa']}; matmul {path}")
    _results[(dtype_name, layout, impl)] = (t_min, t_median)


@pytest.fixture(scope="module", autouse=True)
def _summary(request):
    yield
    if not _results:
        return
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        _print_summary(request.config.pluginmanager.get_plugin("terminalreporter"))


def _print_summary(tr):
    """Time, GB/s and GFLOP/s at the median; speed-ups over the best SDPA variant and the reference at the median
    and at the minimum (the minimum is the better estimate of the kernel's own cost on a shared machine)."""
    info = sbd_ext.build_info()
    tr.write_line("")
    tr.write_line(
        f"block_attention, B={B} Hq={HQ} Hkv={HKV} D={D} cache={CACHE} T={T}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, sbd_ext CPU ISA {info['cpu_isa']}, bf16 matrix path "
        f"{info['cpu_bf16_attention']} (bf16 matrix units: {info['cpu_bf16_matmul_units']})"
    )
    head = f"{'dtype':5} {'layout':8} {'impl':16} {'med ms':>7} {'min ms':>7} {'GB/s':>6} {'GFLOP/s':>7}"
    tr.write_line(f"{head} {'vs SDPA med':>11} {'vs SDPA min':>11} {'vs ref med':>10}")
    for dtype_name in DTYPES:
        for layout in LAYOUTS:
            runs = {i: _results[(dtype_name, layout, i)] for i in IMPLS if (dtype_name, layout, i) in _results}
            sdpa = [r for i, r in runs.items() if i.startswith("sdpa")]
            best_min = min((r[0] for r in sdpa), default=None)
            best_med = min((r[1] for r in sdpa), default=None)
            ref = runs.get("reference")
            for impl, (t_min, t_med) in runs.items():
                gbs, gflops = _bytes(DTYPES[dtype_name]) / t_med / 1e9, _flops() / t_med / 1e9
                row = f"{dtype_name:5} {layout:8} {impl:16} {t_med * 1e3:7.2f} {t_min * 1e3:7.2f}"
                row += f" {gbs:6.2f} {gflops:7.1f}"
                vs_med = f"{best_med / t_med:.2f}x" if best_med else "-"
                vs_min = f"{best_min / t_min:.2f}x" if best_min else "-"
                vs_ref = f"{ref[1] / t_med:.2f}x" if ref else "-"
                tr.write_line(f"{row} {vs_med:>11} {vs_min:>11} {vs_ref:>10}")
    tr.write_line("(vs columns: speed-up of the row over the best SDPA variant / the reference; >1 = faster)")


# ---- CUDA -----------------------------------------------------------------------------------------------
ATTN_SHAPES = [  # (model, Hq, Hkv, D, cache length, T rows, committed rows, dtype)
    *[("llama3.1-8b", 32, 8, 128, L, T, T - 16, "bf16") for L in (1024, 4096, 16384, 32768) for T in (16, 32)],
    *[("smollm2-135m", 9, 3, 64, L, 16, 0, "bf16") for L in (1024, 4096)],
    # SmolLM2's decode steps in fp32 (the CUDA-core kernel): an NTP step (T = 1) and a verify step at k = 4 (one
    # commit row + 4 block rows), at a chat-length cache and a longer one
    *[("smollm2-135m", 9, 3, 64, L, T, min(T, 1), "fp32") for L in (128, 1024) for T in (1, 5)],
]
DTYPE_OF = {"bf16": torch.bfloat16, "fp32": torch.float32}


def attn_inputs(Hq, Hkv, D, L, T, c, dtype="bf16"):
    B, dt = 1, DTYPE_OF[dtype]
    S = L + T
    q = torch.randn(B, Hq, T, D, device="cuda", dtype=dt)
    k, v = torch.randn(2, B, Hkv, T, D, device="cuda", dtype=dt)
    kc, vc = torch.randn(2, B, Hkv, S, D, device="cuda", dtype=dt)
    lens = torch.tensor([L], device="cuda", dtype=torch.int32)
    commit = torch.tensor([c], device="cuda", dtype=torch.int32)
    valid = torch.tensor([T], device="cuda", dtype=torch.int32)
    return q, k, v, kc, vc, lens, commit, valid


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("impl", ["sbd_ext", "reference", "sdpa_gqa"])
@pytest.mark.parametrize(
    "shape",
    ATTN_SHAPES,
    ids=[f"{m}-L{L}-T{T}" + ("-fp32" if d == "fp32" else "") for m, _, _, _, L, T, _, d in ATTN_SHAPES],
)
def test_block_attention_gpu(benchmark, device, shape, impl):
    """The GPU cases, CUDA-event timed with the L2 flushed (cuda_timing.measure); the CPU cases are above."""
    model, Hq, Hkv, D, L, T, c, dtype = shape
    q, k, v, kc, vc, lens, commit, valid = attn_inputs(Hq, Hkv, D, L, T, c, dtype)
    scale = D**-0.5
    # Bytes that must move: the K/V cache once (the roofline), plus the new rows' q / k / v and the output.
    es = q.element_size()
    kv_bytes = 2 * Hkv * L * D * es
    nbytes = kv_bytes + (Hq * T * D * es) * 2 + 2 * Hkv * T * D * es * 2
    extra = None
    if impl == "sbd_ext":
        fn = lambda: sbd_ext.block_attention(q, k, v, kc, vc, lens, commit, valid, scale)  # noqa: E731
        extra = split_attention_merge(kernel_times(fn))
    elif impl == "reference":
        if L > 16384:
            pytest.skip("the dense fp32 reference at 32k is minutes of memory traffic per call; not informative")
        fn = lambda: reference.block_attention(q, k, v, kc, vc, lens, commit, valid, scale)  # noqa: E731
    else:
        # SDPA over a cache that already holds the new rows (they were appended outside the timed region), with
        # the equivalent boolean mask and GQA done inside SDPA: a lower bound for the built-in path.
        kc[:, :, L : L + T] = k
        vc[:, :, L : L + T] = v
        mask = reference.block_attention_mask(lens, commit, valid, T, L)[:, None]  # [1, 1, T, L + T]
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
        f"{model} L={L} T={T} (commit {c}) {dtype}",
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


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("L", [4096, 32768])
def test_block_attention_32_layers_graph(benchmark, device, L):
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


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("splits", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("L", [4096, 32768])
def test_block_attention_split_sweep(benchmark, device, L, splits, monkeypatch):
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
