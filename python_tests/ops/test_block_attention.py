"""block_attention against sbd_ext.reference.block_attention (a dense masked softmax in fp32).

Correctness bars: fp32 within 1e-5 (relative and absolute, utils.TOL); bf16 / fp16 within 2x the error that
PyTorch's own low-precision attention (SDPA in that dtype) makes against the same fp32 reference. Every test runs
on every device present; the CPU tests run under each CPU kernel variant (isa_device: default / avx2 / avx512
where available), each with both matrix paths (micro-kernel and cpublas GEMM), CUDA once.

The model features -- logit soft-capping (``softcap``) and the sliding window (``window_left``) -- are checked the
same way against the reference, and their definitions against transformers' own eager attention (Gemma-2) and
sliding-window mask.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from utils import CUDA_OK, DEVICE_ISAS, assert_close, cuda_only, run_block_attention

import sbd_ext
from sbd_ext import reference

OP = torch.ops.sbd_ext.block_attention.default
BAD_INPUT = (RuntimeError, ValueError, TypeError, IndexError)


def make_inputs(B, Hkv, g, T, D, S, dtype=torch.float32, device="cpu", seed=0):
    """q [B, Hq, T, D], k / v [B, Hkv, T, D], caches [B, Hkv, S, D]; q is the HF transposed view."""
    gen = torch.Generator().manual_seed(seed)
    Hq = Hkv * g

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    q = rnd(B, T, Hq, D).transpose(1, 2)  # what q_proj(x).view(B, T, Hq, D).transpose(1, 2) gives
    return q, rnd(B, Hkv, T, D), rnd(B, Hkv, T, D), rnd(B, Hkv, S, D), rnd(B, Hkv, S, D)


def lengths(vals, device, dtype=torch.int32):
    return torch.tensor(vals, dtype=dtype, device=device)


def run_both(q, k, v, kc, vc, lens, commit, valid, scale=None):
    """(ours, reference, caches after ours, caches after the reference) on separate copies of the caches."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    out = sbd_ext.block_attention(q, k, v, kc1, vc1, lens, commit, valid, scale)
    ref = reference.block_attention(q, k, v, kc2, vc2, lens.cpu(), commit.cpu(), valid.cpu(), scale)
    return out, ref, (kc1, vc1), (kc2, vc2)


CUDA_HEAD_DIMS = (32, 64, 128)


def assert_cuda_refuses_head_dim(D, kc, call):
    """On CUDA a head dim the kernels are not built for is refused with the supported list, the cache untouched."""
    before = kc.clone()
    with pytest.raises(ValueError, match=rf"the CUDA kernels support head dims 32, 64 and 128, got D = .* = {D}"):
        call()
    assert torch.equal(kc, before)


def test_the_python_layer_reads_the_cuda_head_dims_from_the_extension():
    """sbd_ext.hf.CUDA_HEAD_DIMS (what SBD decoding checks up front) is the extension's own list, not a copy: the
    C++ kernels' one definition, reported by build_info in a CPU-only build too; checked here against the dims these
    tests run on CUDA."""
    assert sbd_ext.build_info()["cuda_head_dims"] == list(CUDA_HEAD_DIMS)
    assert sbd_ext.hf.CUDA_HEAD_DIMS == CUDA_HEAD_DIMS
    assert sbd_ext.hf.kernel_available(torch.device("cuda"), 96) is False


# The CPU runs every kernel variant twice: its own micro-kernel ("vector") and the GEMM path ("gemm": both matrix
# products through ATen's cpublas, as chosen automatically for bf16 / fp16 on CPUs with AMX-BF16 /
# AMX-FP16; on other CPUs cpublas runs its reference loops, the same calls). Other devices run once.
ATTN_VARIANTS = [(d, isa, mm) for d, isa in DEVICE_ISAS if isa is not None for mm in ("vector", "gemm")] + [
    (d, None, None) for d, isa in DEVICE_ISAS if isa is None
]


@pytest.fixture(params=ATTN_VARIANTS, ids=lambda p: f"cpu-{p[1]}-{p[2]}" if p[1] else p[0])
def isa_device(request):
    """Each CPU kernel variant (and matrix path) on the CPU, and every other device once."""
    device, isa, matmul = request.param
    if isa is not None:
        sbd_ext._C.set_cpu_isa(isa)
        sbd_ext._C.set_block_attention_matmul(matmul)
    yield torch.device(device)
    if isa is not None:
        sbd_ext._C.set_cpu_isa("")
        sbd_ext._C.set_block_attention_matmul("auto")


# (B, Hkv, g, T, D, cache_lens, n_commit, n_valid): batch 1 and 3, D 64 / 128 (and an odd 40), GQA ratios 1, 3, 4,
# T = 1, 4, 16 and the 2k layout (k committed rows + k block rows), cache lengths 0, 1, 257, padding rows, and
# long T (a prompt prefill through the same op).
CASES = [
    (1, 2, 1, 1, 64, [0], [1], [1]),  # NTP decode on an empty cache, MHA
    (1, 2, 1, 1, 128, [257], [1], [1]),  # NTP decode over a cache
    (1, 1, 4, 1, 128, [1], [0], [1]),  # a one-row set block
    (1, 2, 3, 4, 64, [257], [4], [4]),  # causal rows, GQA 3
    (1, 2, 4, 4, 128, [1], [0], [4]),  # set block only
    (1, 1, 4, 16, 128, [257], [16], [16]),  # 16 causal rows
    (1, 2, 3, 16, 64, [0], [0], [16]),  # 16-row set block, empty cache
    (1, 2, 4, 32, 128, [257], [16], [32]),  # 2k layout, k = 16
    (3, 2, 4, 16, 64, [0, 1, 257], [16, 5, 0], [16, 9, 3]),  # sequences advancing independently, padding rows
    (3, 1, 3, 4, 128, [257, 0, 1], [2, 0, 4], [4, 2, 4]),
    (3, 2, 1, 8, 64, [1, 257, 0], [4, 8, 0], [8, 8, 0]),  # 2k layout k = 4; the last sequence is all padding
    (3, 1, 4, 6, 40, [257, 1, 0], [3, 3, 0], [6, 6, 5]),  # odd head dim (CPU only: CUDA refuses it, see the test)
    (1, 1, 4, 300, 64, [0], [300], [300]),  # a causal prefill: several lane panels, key blocks skipped causally
    (2, 2, 2, 200, 64, [5, 0], [120, 200], [190, 200]),  # long mixed rows
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hkv{}-g{}-T{}-D{}-L{}-c{}-v{}".format(*c))
def test_fp32_matches_reference(isa_device, case):
    B, Hkv, g, T, D, lens, commit, valid = case
    q, k, v, kc, vc = make_inputs(B, Hkv, g, T, D, 300, device=isa_device)
    if isa_device.type == "cuda" and D not in CUDA_HEAD_DIMS:
        L, C, V = (lengths(x, isa_device) for x in (lens, commit, valid))
        assert_cuda_refuses_head_dim(D, kc, lambda: sbd_ext.block_attention(q, k, v, kc, vc, L, C, V))
        return
    out, ref, caches, ref_caches = run_both(
        q, k, v, kc, vc, lengths(lens, isa_device), lengths(commit, isa_device), lengths(valid, isa_device)
    )
    assert out.shape == (B, T, Hkv * g, D) and out.dtype == q.dtype
    assert_close(out, ref, msg="output")
    for b in range(B):  # padding rows are exactly zero
        assert not out[b, valid[b] :].any()
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


def test_online_softmax_rescaling(isa_device):
    """Peaked softmax whose running max keeps growing from key block to key block (the alpha rescale path)."""
    B, Hkv, g, T, D, S = 2, 1, 4, 8, 64, 700
    q, k, v, kc, vc = make_inputs(B, Hkv, g, T, D, S, device=isa_device, seed=3)
    ramp = torch.linspace(0.2, 3.0, S, device=isa_device).view(1, 1, S, 1)
    kc = kc.abs() * ramp  # later cache rows score higher for positive q
    q = q.abs() * 2.0
    L, C, V = lengths([650, 333], isa_device), lengths([3, 8], isa_device), lengths([8, 8], isa_device)
    out, ref, _, _ = run_both(q, k, v, kc, vc, L, C, V)
    assert_close(out, ref)


def test_int64_lengths_and_default_arguments(isa_device):
    q, k, v, kc, vc = make_inputs(2, 2, 2, 5, 64, 20, device=isa_device)
    lens = lengths([3, 0], isa_device, torch.int64)
    out, ref, _, _ = run_both(q, k, v, kc, vc, lens, *(lengths([5, 5], isa_device, torch.int64),) * 2)
    assert_close(out, ref)
    # n_commit / n_valid / scale default to plain causal attention over all T rows with D ** -0.5
    assert_close(sbd_ext.block_attention(q, k, v, kc.clone(), vc.clone(), lens), out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [CASES[1], CASES[7], CASES[8]], ids=["decode", "2k", "batch3"])
def test_low_precision_within_2x_torch_error(isa_device, dtype, case):
    B, Hkv, g, T, D, lens, commit, valid = case
    S = 300
    q, k, v, kc, vc = make_inputs(B, Hkv, g, T, D, S, dtype=dtype, device=isa_device, seed=1)
    L, C, V = lengths(lens, isa_device), lengths(commit, isa_device), lengths(valid, isa_device)
    out, _, caches, _ = run_both(q, k, v, kc, vc, L, C, V)
    assert out.dtype == dtype
    exact = reference.block_attention(
        q.float(), k.float(), v.float(), kc.float(), vc.float(), L.cpu(), C.cpu(), V.cpu(), D**-0.5
    )
    # PyTorch's own run in the low dtype: SDPA over cache + new keys with the same boolean mask.
    mask = reference.block_attention_mask(L, C, V, T, S)  # [B, T, S + T]
    keys = torch.cat([kc, k], dim=2).repeat_interleave(g, dim=1)
    vals = torch.cat([vc, v], dim=2).repeat_interleave(g, dim=1)
    valid_rows = mask.any(-1)  # [B, T]
    safe = mask | ~valid_rows[..., None]  # SDPA of an all-masked row is NaN; those rows are compared separately
    theirs = F.scaled_dot_product_attention(q, keys, vals, attn_mask=safe[:, None], scale=D**-0.5).transpose(1, 2)
    sel = valid_rows.cpu()
    our_err = (out.float().cpu() - exact.cpu())[sel].abs().max().item()
    torch_err = (theirs.float().cpu() - exact.cpu())[sel].abs().max().item()
    assert our_err <= 2 * torch_err + 1e-6, f"our max error {our_err:.3g} vs PyTorch {dtype} {torch_err:.3g}"
    assert not out.cpu()[~sel].any()
    for b in range(B):  # the append is a copy: exact in any dtype
        L0, c = lens[b], commit[b]
        assert torch.equal(caches[0][b, :, L0 : L0 + c], k[b, :, :c])
        assert torch.equal(caches[1][b, :, L0 : L0 + c], v[b, :, :c])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_append_and_no_reads_past_length(isa_device, dtype):
    """Committed rows land at cache_lens[b] exactly; every other cache row is untouched and never read."""
    B, Hkv, g, T, D, S = 3, 2, 2, 6, 64, 40
    q, k, v, kc, vc = make_inputs(B, Hkv, g, T, D, S, dtype=dtype, device=isa_device)
    lens, commit, valid = [0, 7, 30], [6, 2, 0], [6, 5, 4]
    for b in range(B):  # garbage past the valid rows: any read of it would poison the output with NaN
        kc[b, :, lens[b] :] = float("nan")
        vc[b, :, lens[b] :] = float("nan")
    clean_k, clean_v = kc.nan_to_num(0.0), vc.nan_to_num(0.0)
    before_k, before_v = kc.clone(), vc.clone()
    L, C, V = lengths(lens, isa_device), lengths(commit, isa_device), lengths(valid, isa_device)
    out = sbd_ext.block_attention(q, k, v, kc, vc, L, C, V, 0.125)
    ref = reference.block_attention(q, k, v, clean_k, clean_v, L.cpu(), C.cpu(), V.cpu(), 0.125)
    assert_close(out, ref, dtype=dtype)
    for b in range(B):
        a, c = lens[b], commit[b]
        assert torch.equal(kc[b, :, a : a + c], k[b, :, :c]) and torch.equal(vc[b, :, a : a + c], v[b, :, :c])
        for cache, before in ((kc, before_k), (vc, before_v)):
            assert torch.equal(cache[b, :, :a], before[b, :, :a])
            assert cache[b, :, a + c :].isnan().all()


def test_workspace_kept_between_calls_and_committed_rows_read_from_the_cache(isa_device):
    """The vector path keeps its workspace in the calling thread between calls, and every unit reads the committed
    rows from the cache after they are appended (a key block that holds the cache's end is read in place): calls of
    other head dims, panel sizes and dtypes in turn, with committed rows across a 64-row block boundary, each match
    the reference, the caches too."""
    calls = [  # (B, Hkv, g, T, D, S, dtype, lens, commit, valid)
        (1, 3, 3, 1, 64, 200, torch.float32, [61], [1], [1]),
        (2, 2, 4, 40, 128, 300, torch.float32, [60, 0], [8, 40], [40, 40]),  # a larger panel and head dim
        (1, 3, 3, 5, 64, 200, torch.bfloat16, [62], [3], [5]),  # committed rows 62-64 and two set-block rows
        (1, 3, 3, 1, 64, 200, torch.float32, [127], [1], [1]),
        (2, 1, 2, 9, 32, 150, torch.float32, [120, 5], [9, 2], [9, 9]),
    ]
    for i, (B, Hkv, g, T, D, S, dtype, ls, cs, vs) in enumerate(calls):
        q, k, v, kc, vc = make_inputs(B, Hkv, g, T, D, S, dtype=dtype, device=isa_device, seed=i)
        L, C, V = lengths(ls, isa_device), lengths(cs, isa_device), lengths(vs, isa_device)
        out, ref, ours, theirs = run_both(q, k, v, kc, vc, L, C, V)
        assert_close(out, ref, dtype=dtype)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]), f"call {i}: caches differ"


def test_non_contiguous_inputs(isa_device):
    """q, k, v as transposed views of [B, T, H, D] projections, caches as a slice of a larger buffer."""
    B, Hkv, g, T, D, S = 2, 2, 3, 5, 64, 24
    q, _, _, _, _ = make_inputs(B, Hkv, g, T, D, S, device=isa_device)
    k = torch.randn(B, T, Hkv, D, device=isa_device).transpose(1, 2)
    v = torch.randn(B, T, Hkv, D, device=isa_device).transpose(1, 2)
    kc = torch.randn(B, Hkv, S + 9, 2 * D, device=isa_device)[:, :, 3 : S + 3, D:]
    vc = torch.randn(B, S, Hkv, D, device=isa_device).transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or kc.is_contiguous() or vc.is_contiguous())
    L, C, V = lengths([4, 11], isa_device), lengths([5, 2], isa_device), lengths([5, 4], isa_device)
    out, ref, caches, ref_caches = run_both(q, k, v, kc, vc, L, C, V)
    assert_close(out, ref)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


def test_new_rows_inside_the_cache_are_refused(device):
    """k / v as views of the cache rows the append targets: the kernel would read rows it is writing (other
    threads / thread blocks read the new rows while the append runs), so the op refuses them; clones are fine."""
    B, Hkv, g, T, D, S, L = 2, 2, 2, 6, 64, 32, 9
    q, _, _, kc, vc = make_inputs(B, Hkv, g, T, D, S, device=device)
    k, v = kc[:, :, L : L + T], vc[:, :, L : L + T]
    lens, commit, valid = lengths([L, L], device), lengths([6, 2], device), lengths([6, 5], device)
    with pytest.raises(ValueError, match="k_cache is written in place and shares memory with k"):
        sbd_ext.block_attention(q, k, v, kc, vc, lens, commit, valid, 0.125)
    out, ref, caches, ref_caches = run_both(q, k.clone(), v.clone(), kc, vc, lens, commit, valid, 0.125)
    assert_close(out, ref)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


def test_fused_kv_buffer_is_accepted(device):
    """k_cache and v_cache interleaved in one [B, Hkv, S, 2, D] buffer share a storage but no element."""
    B, Hkv, g, T, D, S = 2, 2, 2, 4, 64, 16
    q, k, v, _, _ = make_inputs(B, Hkv, g, T, D, S, device=device)
    buf = torch.randn(B, Hkv, S, 2, D, device=device)
    L, C, V = lengths([3, 0], device), lengths([2, 4], device), lengths([4, 4], device)
    ref_k, ref_v = buf[..., 0, :].clone(), buf[..., 1, :].clone()
    ref = reference.block_attention(q, k, v, ref_k, ref_v, L.cpu(), C.cpu(), V.cpu(), 0.125)
    out = sbd_ext.block_attention(q, k, v, buf[..., 0, :], buf[..., 1, :], L, C, V, 0.125)
    assert_close(out, ref)
    assert torch.equal(buf[..., 0, :], ref_k) and torch.equal(buf[..., 1, :], ref_v)


def _paths_taken(fn):
    """(vector, gemm, tiles) CPU block_attention calls made by fn()."""
    before = sbd_ext._C.block_attention_cpu_paths()
    fn()
    after = sbd_ext._C.block_attention_cpu_paths()
    return tuple(a - b for a, b in zip(after, before, strict=True))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def test_cpu_matrix_units_mean_amx():
    """The GEMM path is chosen for bf16 / fp16 only where the CPU has AMX tiles: AVX512-BF16 alone (AMD Zen 4) runs
    the micro-kernel, which measured faster there (14.7 vs 11.8 ms, bench/ops/bench_block_attention.py)."""
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this platform")
    info = sbd_ext.build_info()
    if "amx_bf16" not in flags:
        assert not info["cpu_bf16_matmul_units"]
        assert info["cpu_bf16_attention"] == "vector"
    if "amx_fp16" not in flags:
        assert not info["cpu_fp16_matmul_units"]
        assert info["cpu_fp16_attention"] == "vector"


def test_cpu_bf16_products_and_the_training_precision_they_choose():
    """build_info()["cpu_avx512_bf16"] is the CPU's AVX512-BF16 flag (as the kernel reports it), and the drafter's
    --precision auto picks bf16 on a CPU with bf16 products in hardware (AVX512-BF16 or AMX-BF16), fp32 elsewhere."""
    from sbd_ext.recipes.drafter.args import auto_precision

    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this platform")
    info = sbd_ext.build_info()
    assert info["cpu_avx512_bf16"] == ("avx512_bf16" in flags)
    hardware_bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    assert auto_precision("cpu") == ("bf16" if hardware_bf16 else "fp32")
    assert auto_precision("cuda:0") == "bf16"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_matmul_path_choice(dtype):
    """The setting takes effect; "auto" takes the GEMM path exactly for bf16 / fp16 on CPUs with the units, except
    bf16 where the AMX-BF16 tiles are on (its own path: test_block_attention_tiles.py)."""
    q, k, v, kc, vc = make_inputs(1, 2, 4, 8, 64, 40, dtype=dtype)
    L, C, V = lengths([20], "cpu"), lengths([4], "cpu"), lengths([8], "cpu")
    info = sbd_ext.build_info()
    units = {torch.bfloat16: info["cpu_bf16_matmul_units"], torch.float16: info["cpu_fp16_matmul_units"]}
    expect_auto = bool(units.get(dtype, False))
    tiles = info["cpu_bf16_tiles"] != "model"  # the AMX-BF16 tiles (or their emulation) are on
    auto_bf16 = "tiles" if tiles else "gemm" if info["cpu_bf16_matmul_units"] else "vector"
    assert info["cpu_bf16_attention"] == auto_bf16

    def call():
        sbd_ext.block_attention(q, k, v, kc.clone(), vc.clone(), L, C, V)

    try:
        for mode, gemm in (("vector", False), ("gemm", True), ("auto", expect_auto)):
            sbd_ext._C.set_block_attention_matmul(mode)
            assert sbd_ext.build_info()["cpu_attention_matmul"] == mode
            if mode == "auto" and dtype == torch.bfloat16 and tiles:
                assert _paths_taken(call) == (0, 0, 1)
                continue
            assert _paths_taken(call) == ((0, 1, 0) if gemm else (1, 0, 0)), mode
        with pytest.raises(ValueError, match='unknown block_attention matmul "amx"'):
            sbd_ext._C.set_block_attention_matmul("amx")
    finally:
        sbd_ext._C.set_block_attention_matmul("auto")


def test_gemm_path_falls_back_for_rows_that_are_not_matrices():
    """A GEMM needs a leading dimension >= D: k / v rows broadcast with stride 0 take the micro-kernel, exactly."""
    B, Hkv, g, T, D, S = 1, 2, 2, 6, 64, 30
    q, _, _, kc, vc = make_inputs(B, Hkv, g, T, D, S, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, 1, D).to(torch.bfloat16).expand(B, Hkv, T, D)  # row stride 0
    v = torch.randn(B, Hkv, 1, D).to(torch.bfloat16).expand(B, Hkv, T, D)
    L, C, V = lengths([10], "cpu"), lengths([3], "cpu"), lengths([6], "cpu")
    try:
        sbd_ext._C.set_block_attention_matmul("gemm")
        holder = {}
        assert _paths_taken(lambda: holder.update(r=run_both(q, k, v, kc, vc, L, C, V))) == (1, 0, 0)
        out, ref, _, _ = holder["r"]
        assert_close(out, ref, dtype=torch.bfloat16)
    finally:
        sbd_ext._C.set_block_attention_matmul("auto")


@pytest.mark.parametrize("threads", [3, 8])
@pytest.mark.parametrize("T", [1, 4])
def test_cache_splits(isa_device, threads, T):
    """Batch 1 with one kv head and a long cache: the cache is split across threads and the partial states
    merged (sbd/softmax_state.h); the result must not depend on it beyond fp32 rounding. T = 1 takes the kernel's
    rows path (fewer query rows than a vector), T = 4 its lanes path."""
    q, k, v, kc, vc = make_inputs(1, 1, 4, T, 64, 1500, device=isa_device)
    L, C, V = lengths([1400], isa_device), lengths([T // 2], isa_device), lengths([T], isa_device)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out, ref, caches, ref_caches = run_both(q, k, v, kc, vc, L, C, V)
        torch.set_num_threads(1)
        single = sbd_ext.block_attention(q, k, v, kc.clone(), vc.clone(), L, C, V, 0.125)
    finally:
        torch.set_num_threads(old)
    assert_close(out, ref)
    assert_close(out, single)
    assert torch.equal(caches[0], ref_caches[0])


def test_empty_batch_and_rows(device):
    q, k, v, kc, vc = make_inputs(0, 2, 2, 3, 64, 8, device=device)
    z = lengths([], device)
    assert sbd_ext.block_attention(q, k, v, kc, vc, z, z, z).shape == (0, 3, 4, 64)
    q, k, v, kc, vc = make_inputs(2, 2, 2, 0, 64, 8, device=device)
    z = lengths([0, 0], device)
    assert sbd_ext.block_attention(q, k, v, kc, vc, lengths([3, 8], device), z, z).shape == (2, 0, 4, 64)


def test_opcheck(device):
    q, k, v, kc, vc = make_inputs(2, 2, 2, 4, 64, 16, device=device)
    args = (q, k, v, kc, vc, lengths([3, 0], device), lengths([2, 4], device), lengths([4, 4], device), 0.125)
    torch.library.opcheck(OP, args)


def test_torch_compile_fullgraph(device):
    q, k, v, kc, vc = make_inputs(2, 2, 2, 4, 64, 16, device=device)
    L, C, V = lengths([3, 0], device), lengths([2, 3], device), lengths([4, 3], device)

    def layer(q, k, v, kc, vc, L, C, V):
        o = sbd_ext.block_attention(q, k, v, kc, vc, L, C, V, 0.125)
        return o.flatten(2) * 2.0

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    kc1, vc1 = kc.clone(), vc.clone()
    got = compiled(q, k, v, kc1, vc1, L, C, V)
    want = layer(q, k, v, kc.clone(), vc.clone(), L, C, V)
    assert_close(got, want)
    assert torch.equal(kc1[0, :, 3:5], k[0, :, :2])  # the in-place append survives compilation


# ---- bad inputs: each raises a clear error naming the argument --------------------------------------------
def _good(device):
    q, k, v, kc, vc = make_inputs(1, 2, 2, 4, 64, 16, device=device)
    return dict(
        q=q, k=k, v=v, k_cache=kc, v_cache=vc, cache_lens=lengths([3], device), n_commit=lengths([2], device),
        n_valid=lengths([4], device), scale=0.125,
    )  # fmt: skip


def _shifted_caches(args):
    """k_cache and v_cache as two views of one buffer, one row apart."""
    buf = torch.zeros(1, 2, 17, 64, device=args["q"].device)
    return dict(k_cache=buf[:, :, :16], v_cache=buf[:, :, 1:])


BAD = {
    "q int dtype": (lambda a: a.update(q=a["q"].long()), "q must have dtype"),
    "k dtype differs": (lambda a: a.update(k=a["k"].double()), "k must have the same dtype as q"),
    "v_cache dtype differs": (lambda a: a.update(v_cache=a["v_cache"].half()), "v_cache must have the same dtype"),
    "q 3-D": (lambda a: a.update(q=a["q"][0]), r"q must be 4-D \[B, Hq, T, D\]"),
    "k wrong T": (lambda a: a.update(k=a["k"][:, :, :3]), r"k.size\(2\) must equal q.size\(2\) \(T\)"),
    "v wrong D": (lambda a: a.update(v=a["v"][..., :32]), r"v.size\(3\) must equal q.size\(3\) \(D\)"),
    "v wrong Hkv": (lambda a: a.update(v=a["v"][:, :1]), r"v.size\(1\) must equal k.size\(1\) \(Hkv\)"),
    "Hq not multiple of Hkv": (lambda a: a.update(q=a["q"][:, :3]), "must be a multiple of the number of kv heads"),
    "k_cache wrong Hkv": (lambda a: a.update(k_cache=a["k_cache"][:, :1]), r"k_cache.size\(1\) must equal"),
    "v_cache wrong S": (lambda a: a.update(v_cache=a["v_cache"][:, :, :8]), r"v_cache.size\(2\) must equal"),
    "k_cache 3-D": (lambda a: a.update(k_cache=a["k_cache"][0]), "k_cache must be 4-D"),
    "cache_lens float": (lambda a: a.update(cache_lens=a["cache_lens"].float()), "cache_lens must have dtype"),
    "n_commit 2-D": (lambda a: a.update(n_commit=a["n_commit"][None]), "n_commit must be 1-D"),
    "n_valid wrong B": (lambda a: a.update(n_valid=a["n_valid"].repeat(2)), r"n_valid.size\(0\) must equal"),
    "q last stride": (
        lambda a: a.update(q=torch.cat([a["q"], a["q"]], -1)[..., ::2]),
        "q must be contiguous in its last dimension",
    ),
    "scale nan": (lambda a: a.update(scale=float("nan")), "scale must be a finite number"),
    # Mutated caches that share memory with themselves or with another argument.
    "k_cache expanded": (
        lambda a: a.update(k_cache=a["k_cache"][:, :, :1].expand(-1, -1, 16, -1)),
        "k_cache is written in place but some of its elements share memory",
    ),
    "v_cache overlaps itself": (
        lambda a: a.update(v_cache=a["v_cache"].as_strided(a["v_cache"].shape, (1024, 512, 32, 1))),
        "v_cache is written in place but some of its elements share memory",
    ),
    "caches overlap": (
        lambda a: a.update(_shifted_caches(a)),
        "k_cache is written in place and shares memory with v_cache",
    ),
    "q is the cache": (
        lambda a: a.update(q=a["k_cache"].view(1, 4, 8, 64)[:, :, :4]),
        "k_cache is written in place and shares memory with q",
    ),
    "v inside v_cache": (lambda a: a.update(v=a["v_cache"][:, :, 3:7]), "v_cache .* shares memory with v"),
    "lengths inside the cache": (
        lambda a: a.update(n_valid=a["k_cache"].view(torch.int32).view(-1)[:1]),
        "k_cache is written in place and shares memory with n_valid",
    ),
}

# Bad lengths: raised by the call on the CPU; on CUDA found by the kernel (run_block_attention), which then writes
# zero output rows for the sequence and appends nothing.
BAD_LENGTHS = {
    "negative cache_lens": (lambda a: a["cache_lens"].fill_(-1), r"cache_lens\[0\] = -1 is negative"),
    "negative n_commit": (lambda a: a["n_commit"].fill_(-2), r"n_commit\[0\] = -2 is negative"),
    "n_commit > n_valid": (lambda a: a["n_valid"].fill_(1), r"n_commit\[0\] = 2 exceeds n_valid\[0\] = 1"),
    "n_valid > T": (lambda a: a["n_valid"].fill_(5), r"n_valid\[0\] = 5 exceeds the number of new rows T = 4"),
    "cache overflow": (lambda a: a["cache_lens"].fill_(15), r"cache overflow for sequence 0.*15 \+ 2 exceeds"),
    # cache_lens + n_commit overflows int64 (this once passed the check and wrote before the cache)
    "cache_lens int64 max": (lambda a: a.update(cache_lens=lengths([2**63 - 1], a["q"].device, torch.int64)),
                             r"cache overflow for sequence 0.*9223372036854775807 \+ 2 exceeds"),
    "n_commit int64 max": (lambda a: a.update(n_commit=lengths([2**63 - 1], a["q"].device, torch.int64)),
                           r"n_commit\[0\] = 9223372036854775807 exceeds n_valid"),
    "n_valid int32 max": (lambda a: a["n_valid"].fill_(2**31 - 1), r"n_valid\[0\] = 2147483647 exceeds"),
    "cache_lens int64 min": (lambda a: a.update(cache_lens=lengths([-(2**63)], a["q"].device, torch.int64)),
                             r"cache_lens\[0\] = -9223372036854775808 is negative"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs(device, name):
    args = _good(device)
    mutate, pattern = BAD[name]
    mutate(args)
    with pytest.raises(BAD_INPUT, match=pattern):
        OP(**args)


@pytest.mark.parametrize("name", list(BAD_LENGTHS))
def test_bad_lengths(device, name):
    args = _good(device)
    mutate, pattern = BAD_LENGTHS[name]
    mutate(args)
    k_before, v_before = args["k_cache"].clone(), args["v_cache"].clone()
    out, err = run_block_attention(**args)
    assert err is not None, "invalid lengths were accepted"
    assert re.search(pattern, str(err)), f"{str(err)!r} does not match {pattern!r}"
    assert torch.equal(args["k_cache"], k_before) and torch.equal(args["v_cache"], v_before)
    if device.type == "cpu":
        assert out is None
    else:  # the kernel ran, treating the sequence as empty
        assert out.shape == (1, 4, 4, 64) and not out.any()


def test_bad_lengths_in_a_batch_leave_the_valid_sequences_exact(device):
    """One invalid sequence among valid ones: the CPU refuses the call; CUDA computes the valid sequences exactly
    and writes nothing for the invalid one."""
    q, k, v, kc, vc = make_inputs(3, 2, 2, 4, 64, 16, device=device)
    L, C, V = lengths([3, 15, 0], device), lengths([2, 2, 4], device), lengths([4, 4, 4], device)
    kc0, vc0 = kc.clone(), vc.clone()
    out, err = run_block_attention(
        q=q, k=k, v=v, k_cache=kc, v_cache=vc, cache_lens=L, n_commit=C, n_valid=V, scale=0.125
    )
    assert err is not None and "cache overflow for sequence 1" in str(err)
    if device.type == "cpu":
        assert out is None and torch.equal(kc, kc0)
        return
    keep = [0, 2]
    rk, rv = kc0[keep].clone(), vc0[keep].clone()
    ref = reference.block_attention(
        q[keep], k[keep], v[keep], rk, rv, L[keep].cpu(), C[keep].cpu(), V[keep].cpu(), 0.125
    )
    assert_close(out[keep], ref)
    assert not out[1].any() and torch.equal(kc[1], kc0[1]) and torch.equal(vc[1], vc0[1])
    assert torch.equal(kc[keep], rk) and torch.equal(vc[keep], rv)


@pytest.mark.skipif(not CUDA_OK, reason="needs a second device (a GPU with sbd_ext's CUDA kernels)")
def test_device_mismatch():
    args = _good("cuda")
    args["cache_lens"] = args["cache_lens"].cpu()
    with pytest.raises(BAD_INPUT, match="cache_lens is on cpu but q is on cuda"):
        OP(**args)


@pytest.mark.parametrize("index,name", [(0, "q"), (2, "v"), (3, "k_cache"), (5, "cache_lens"), (6, "n_commit")])
def test_none_to_the_raw_op_names_the_argument(index, name):
    """torch.ops passes None as an undefined tensor: the binding's checks name it instead of reading a dtype."""
    q, k, v, kc, vc = make_inputs(1, 2, 2, 3, 16, 8)
    args = [q, k, v, kc, vc, lengths([2], "cpu"), lengths([1], "cpu"), lengths([3], "cpu"), 0.25]
    args[index] = None
    with pytest.raises(TypeError, match=f"block_attention: {name} must be a tensor, got None"):
        OP(*args)


@pytest.mark.parametrize("name", ["q", "k", "v_cache", "cache_lens", "n_valid"])
def test_meta_and_cpu_mixed_is_a_device_error(name):
    """One tensor on meta, the rest on the CPU: the device error (before: the Meta dispatch key won and the fake
    ran, returning uninitialised memory). All on meta still runs the fake (shapes only)."""
    args = _good("cpu")
    args[name] = args[name].to("meta")
    with pytest.raises(RuntimeError, match=f"{name} is on meta but q is on cpu|q is on meta"):
        sbd_ext.block_attention(**args)
    meta = {n: t.to("meta") for n, t in _good("cpu").items() if isinstance(t, torch.Tensor)}
    assert sbd_ext.block_attention(**meta).device.type == "meta"


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_inputs_requiring_grad_are_refused(name):
    """No backward: an input that requires grad (grad mode on) raises instead of leaving ``.grad`` silently None;
    under no_grad, or with detached inputs, the op runs."""
    args = _good("cpu")
    args[name] = args[name].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="has no backward"):
        sbd_ext.block_attention(**args)
    with torch.no_grad():
        sbd_ext.block_attention(**_good("cpu"))


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---- CUDA (skipped without an NVIDIA GPU and the CUDA kernels) ----------------------------------------
def sdpa_lowp(q, k, v, kc, vc, lens, commit, valid, scale):
    """PyTorch's best built-in on the same problem, in the inputs' precision: SDPA with the equivalent mask."""
    B, Hq, T, D = q.shape
    Hkv, S = kc.shape[1], kc.shape[2]
    keys = torch.cat([kc, k], 2).repeat_interleave(Hq // Hkv, 1)
    vals = torch.cat([vc, v], 2).repeat_interleave(Hq // Hkv, 1)
    mask = reference.block_attention_mask(lens, commit, valid, T, S)[:, None]
    out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale)
    return out.nan_to_num(0.0).transpose(1, 2)  # fully masked (padding) rows -> 0, [B, T, Hq, D]


ATTN_CASES = [
    # (Hkv, g, T, D, cache_lens per sequence, n_commit, n_valid)
    (2, 1, 1, 64, [0, 1], [1, 1], [1, 1]),
    (2, 2, 16, 32, [257, 3], [16, 5], [16, 9]),  # head dim 32 (the embedded demo models): its own swizzle
    (3, 3, 16, 64, [257, 0], [0, 11], [16, 11]),  # SmolLM2 heads; set block, then committed + padding
    (2, 4, 16, 128, [4096, 1], [16, 3], [16, 16]),  # Llama-3.1-8B ratio
    (1, 4, 33, 128, [257, 4096], [16, 20], [33, 20]),  # M = 132 packed rows: three m-tiles
    (2, 3, 64, 64, [1, 257], [32, 64], [64, 64]),
]


# fp32 always runs the CUDA-core (simt) kernel: forcing it is the default there, so that pair is not generated.
KERNEL_DTYPES = [("default", d) for d in DTYPES] + [("simt", d) for d in DTYPES if d != torch.float32]


@cuda_only
@pytest.mark.parametrize("kernel,dtype", KERNEL_DTYPES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"Hkv{c[0]}-g{c[1]}-T{c[2]}-D{c[3]}-L{max(c[4])}")
@pytest.mark.parametrize("len_dtype", [torch.int32, torch.int64])
def test_block_attention_cuda(case, dtype, kernel, len_dtype, monkeypatch):
    monkeypatch.setenv("SBD_EXT_ATTN_SIMT", "1" if kernel == "simt" else "0")
    Hkv, g, T, D, lens, commit, valid = case
    B, Hq = len(lens), Hkv * g
    S = max(lens) + T + 5
    gen = torch.Generator().manual_seed(T * 31 + D)
    mk = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    q, k, v = mk(B, Hq, T, D), mk(B, Hkv, T, D), mk(B, Hkv, T, D)
    kc, vc = mk(B, Hkv, S, D), mk(B, Hkv, S, D)
    cl, nc, nv = (torch.tensor(x, dtype=len_dtype) for x in (lens, commit, valid))
    scale = D**-0.5
    r_kc, r_vc = kc.clone(), vc.clone()
    want = reference.block_attention(q.float(), k.float(), v.float(), r_kc.float(), r_vc.float(), cl, nc, nv, scale)
    r_kc, r_vc = kc.clone(), vc.clone()
    reference.block_attention(q, k, v, r_kc, r_vc, cl, nc, nv, scale)  # the appended caches, in the cache dtype
    # q as the transpose of a [B, T, Hq, D] projection output (non-contiguous, as a model passes it).
    qc = q.transpose(1, 2).contiguous().cuda().transpose(1, 2)
    g_kc, g_vc = kc.cuda(), vc.cuda()
    dev = [t.cuda() for t in (k, v, cl, nc, nv)]
    got = sbd_ext.block_attention(qc, dev[0], dev[1], g_kc, g_vc, dev[2], dev[3], dev[4], scale)
    assert got.shape == (B, T, Hq, D) and got.dtype == dtype
    assert torch.equal(g_kc.cpu(), r_kc) and torch.equal(g_vc.cpu(), r_vc), "cache append differs"
    assert_close(got, want, dtype=dtype, msg="vs fp32 reference")
    if dtype != torch.float32:
        torch_lowp = sdpa_lowp(q.cuda(), *(t.cuda() for t in (k, v, kc, vc)), *dev[2:], scale).cpu().float()
        err_torch = (torch_lowp - want).abs().max().item()
        err_ours = (got.cpu().float() - want).abs().max().item()
        assert err_ours <= 2 * err_torch + 1e-6, f"error {err_ours:.3g} > 2x PyTorch's {err_torch:.3g}"
    c_kc, c_vc = kc.clone(), vc.clone()
    c = sbd_ext.block_attention(q, k, v, c_kc, c_vc, cl, nc, nv, scale)
    assert_close(got, c, dtype=dtype, msg="vs CPU kernel")
    assert torch.equal(c_kc, r_kc) and torch.equal(c_vc, r_vc), "CPU cache append differs"


@cuda_only
@pytest.mark.parametrize("splits", ["1", "7", "64"])
def test_block_attention_cuda_forced_splits(splits, monkeypatch):
    # The split count only changes the work decomposition (SBD_EXT_ATTN_SPLITS is the benchmarks' tuning hook).
    monkeypatch.setenv("SBD_EXT_ATTN_SPLITS", splits)
    B, Hkv, g, T, D, S = 2, 2, 4, 16, 128, 1100
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, Hkv * g, T, D, generator=gen).bfloat16()
    k, v = torch.randn(2, B, Hkv, T, D, generator=gen).bfloat16()
    kc, vc = torch.randn(2, B, Hkv, S, D, generator=gen).bfloat16()
    cl, nc, nv = torch.tensor([1000, 3]), torch.tensor([8, 16]), torch.tensor([16, 16])
    want = reference.block_attention(q.float(), k.float(), v.float(), kc.float(), vc.float(), cl, nc, nv, D**-0.5)
    dev = [t.cuda() for t in (q, k, v, kc, vc, cl, nc, nv)]
    got = sbd_ext.block_attention(*dev, D**-0.5)
    assert_close(got, want, dtype=torch.bfloat16)


@cuda_only
def test_block_attention_cuda_never_writes_past_the_cache():
    # cache_lens + n_commit > S: an invalid call (the CUDA binding does not read lengths on the host). The kernel
    # writes nothing for that sequence (zero output rows) and reports it; the caches are views of a larger buffer
    # whose extra rows must stay untouched.
    B, Hkv, g, T, D, S = 1, 2, 2, 8, 128, 20
    big_k = torch.zeros(B, Hkv, S + 16, D, device="cuda", dtype=torch.bfloat16)
    big_v = torch.zeros_like(big_k)
    q = torch.randn(B, Hkv * g, T, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, B, Hkv, T, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([S - 3], device="cuda")
    n = torch.tensor([T], device="cuda")
    out = sbd_ext.block_attention(q, k, v, big_k[:, :, :S], big_v[:, :, :S], lens, n, n)
    with pytest.raises(ValueError, match=r"cache overflow for sequence 0: cache_lens\[0\] \+ n_commit\[0\] = 17 \+ 8"):
        sbd_ext.ops.check_cuda_errors()
    assert not big_k.any() and not big_v.any(), "an invalid sequence wrote to its cache"
    assert not out.any()


@cuda_only
def test_block_attention_cuda_rejects_unsupported_head_dim():
    q = torch.zeros(1, 2, 1, 96, device="cuda")
    kv = torch.zeros(1, 2, 1, 96, device="cuda")
    cache = torch.zeros(1, 2, 4, 96, device="cuda")
    n = torch.ones(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="head dim"):
        sbd_ext.block_attention(q, kv, kv, cache, cache.clone(), n * 0, n, n)


# ------------------------------------------------------------------------------------------------------------
# model features: soft-capping and the sliding window
# ------------------------------------------------------------------------------------------------------------
def run_both_features(q, k, v, kc, vc, lens, commit, valid, softcap, window_left, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    out = sbd_ext.block_attention(q, k, v, kc1, vc1, lens, commit, valid, scale, softcap, window_left)
    ref = reference.block_attention(
        q, k, v, kc2, vc2, lens.cpu(), commit.cpu(), valid.cpu(), scale, softcap or 0.0, window_left
    )
    assert torch.equal(kc1.cpu(), kc2.cpu()) and torch.equal(vc1.cpu(), vc2.cpu()), "the append differs"
    return out, ref


# (B, Hkv, g, T, D, cache_lens, n_commit, n_valid): NTP decode, the 2k layout, a batch with padding rows and an
# empty cache, a prefill (several lane panels), an odd head dim (CPU only).
FEATURE_CASES = [
    (1, 2, 1, 1, 64, [257], [1], [1]),
    (1, 2, 4, 32, 128, [257], [16], [32]),
    (3, 2, 4, 16, 64, [0, 1, 200], [16, 5, 0], [16, 9, 3]),
    (1, 1, 4, 150, 64, [20], [150], [150]),
    (2, 1, 3, 6, 40, [100, 3], [3, 0], [6, 6]),
]
# (softcap, window_left): each feature alone and both; a window of one key (0); windows that cut the cache, the new
# rows, or nothing (larger than any position).
FEATURES = [(2.5, -1), (0.0, 0), (0.0, 7), (1.0, 40), (30.0, 100), (0.0, 10**6)]


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: f"cap{f[0]}-w{f[1]}")
@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: "B{}-Hkv{}-g{}-T{}-D{}-L{}-c{}-v{}".format(*c))
def test_fp32_matches_reference_with_features(isa_device, case, features):
    B, Hkv, g, T, D, lens, commit, valid = case
    softcap, window = features
    q, k, v, kc, vc = make_inputs(B, Hkv, g, T, D, 300, device=isa_device)
    q = q * 3.0  # scores of a few units, so that a cap of 1-2.5 bends them
    L, C, V = (lengths(x, isa_device) for x in (lens, commit, valid))
    if isa_device.type == "cuda" and D not in CUDA_HEAD_DIMS:  # refused with the features too
        assert_cuda_refuses_head_dim(
            D, kc, lambda: sbd_ext.block_attention(q, k, v, kc, vc, L, C, V, softcap=softcap, window_left=window)
        )
        return
    out, ref = run_both_features(q, k, v, kc, vc, L, C, V, softcap, window)
    assert_close(out, ref, msg=f"softcap={softcap} window_left={window}")
    for b in range(B):
        assert not out[b, valid[b] :].any()


def test_features_change_the_result_and_defaults_are_off(isa_device):
    """The parameters are honoured (not dropped), and softcap 0 / None with window_left -1 is the plain op."""
    q, k, v, kc, vc = make_inputs(2, 2, 2, 8, 64, 64, device=isa_device, seed=4)
    q = q * 3.0
    L, C, V = lengths([40, 9], isa_device), lengths([4, 8], isa_device), lengths([8, 8], isa_device)

    def run(*features):
        return sbd_ext.block_attention(q, k, v, kc.clone(), vc.clone(), L, C, V, 0.125, *features)

    plain = run()
    assert_close(run(0.0, -1), plain)
    assert_close(run(None), plain)
    assert_close(run(0.0, 10**9), plain)  # a window past every position hides nothing
    for features in [(1.0, -1), (0.0, 3)]:
        assert (run(*features) - plain).abs().max() > 1e-2, features


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(isa_device, dtype):
    B, Hkv, g, T, D, lens, commit, valid = FEATURE_CASES[2]
    q, k, v, kc, vc = make_inputs(B, Hkv, g, T, D, 300, dtype=dtype, device=isa_device, seed=2)
    q = q * 3.0
    L, C, V = (lengths(x, isa_device) for x in (lens, commit, valid))
    out = sbd_ext.block_attention(q, k, v, kc.clone(), vc.clone(), L, C, V, D**-0.5, 2.0, 9)
    exact = reference.block_attention(
        q.float(), k.float(), v.float(), kc.float(), vc.float(), L.cpu(), C.cpu(), V.cpu(), D**-0.5, 2.0, 9
    )
    assert out.dtype == dtype
    assert_close(out.float(), exact, dtype=dtype)


@pytest.mark.parametrize("threads", [3, 8])
@pytest.mark.parametrize("T", [1, 4])
def test_window_with_cache_splits_reads_no_row_before_it(isa_device, threads, T):
    """A long cache split across threads (partial states merged) under a window: the rows before the first row's
    window are never read (NaN there would show), the rest match the reference."""
    S, Lc, wl = 1500, 1400, 300
    q, k, v, kc, vc = make_inputs(1, 1, 4, T, 64, S, device=isa_device, seed=5)
    L, C, V = lengths([Lc], isa_device), lengths([T // 2], isa_device), lengths([T], isa_device)
    ref = reference.block_attention(q, k, v, kc.clone(), vc.clone(), L.cpu(), C.cpu(), V.cpu(), 0.125, 0.0, wl)
    first = Lc - wl  # new row 0 sits at position Lc and sees keys >= Lc - wl
    kc[:, :, :first] = float("nan")
    vc[:, :, :first] = float("nan")
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = sbd_ext.block_attention(q, k, v, kc, vc, L, C, V, 0.125, 0.0, wl)
    finally:
        torch.set_num_threads(old)
    assert_close(out, ref)


# ---- the definitions are transformers' --------------------------------------------------------------------
class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.training = False


@pytest.mark.parametrize("window", [None, 1, 5, 12])
@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("past,T", [(0, 9), (20, 1), (17, 6)])
def test_matches_transformers_eager_attention(isa_device, window, softcap, past, T):
    """Plain causal rows over a cache (what HF's cached generate computes) equal transformers' eager Gemma-2
    attention under the mask transformers builds (sdpa_mask with its sliding-window mask function, ``kv > q - W``):
    window_left = W - 1, soft-capping after scaling and before the mask."""
    B, Hkv, g, D = 2, 2, 2, 64
    S = past + T
    q, k, v, kc, vc = make_inputs(B, Hkv, g, T, D, S, device=isa_device, seed=past + T)
    q = q * 3.0
    keys, vals = torch.cat([kc[:, :, :past], k], 2), torch.cat([vc[:, :, :past], v], 2)
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    mask = sdpa_mask(B, T, S, q_offset=past, mask_function=fn, allow_is_causal_skip=False, device="cpu")
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    scale = 0.2
    theirs, _ = gemma2_eager(_Module(g), q.cpu(), keys.cpu(), vals.cpu(), additive, scaling=scale, softcap=softcap)
    L, C = lengths([past] * B, isa_device), lengths([T] * B, isa_device)
    wl = -1 if window is None else window - 1
    ours = sbd_ext.block_attention(q, k, v, kc.clone(), vc.clone(), L, C, C, scale, softcap, wl)
    assert_close(ours, theirs, atol=2e-5, rtol=2e-5)


def test_set_block_rows_see_the_block_rows_after_them_within_the_window():
    """The SBD definition: a set-block row at position p sees keys at positions >= p - window_left, block rows after
    it included; a committed row stays causal."""
    mask = reference.block_attention_mask(
        lengths([5], "cpu"), lengths([2], "cpu"), lengths([5], "cpu"), T=5, S=8, window_left=3
    )[0]
    # row i sits at position 5 + i; columns 0..7 cache (positions 0..7, valid < 5), 8..12 new rows (positions 5..9)
    pos = 5 + torch.arange(5).view(-1, 1)
    col_pos = torch.cat([torch.arange(8), 5 + torch.arange(5)]).view(1, -1)
    cache = torch.arange(13).view(1, -1) < 5
    new = ~cache & (torch.arange(13).view(1, -1) >= 8)
    causal_or_block = (col_pos <= pos) | (torch.arange(5).view(-1, 1) >= 2)
    want = (cache | new) & causal_or_block & (col_pos >= pos - 3)
    assert torch.equal(mask, want)


# ---- op contract: schema defaults, fake impl, compile, bad inputs ------------------------------------------
def test_opcheck_and_compile(device):
    q, k, v, kc, vc = make_inputs(2, 2, 2, 4, 64, 16, device=device)
    L, C, V = lengths([3, 0], device), lengths([2, 4], device), lengths([4, 4], device)
    torch.library.opcheck(OP, (q, k, v, kc, vc, L, C, V, 0.125, 2.0, 2))
    torch.library.opcheck(OP, (q, k, v, kc, vc, L, C, V, 0.125))  # the schema's defaults

    def layer(q, k, v, kc, vc, L, C, V):
        return sbd_ext.block_attention(q, k, v, kc, vc, L, C, V, 0.125, 2.0, 2).flatten(2)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert_close(compiled(q, k, v, kc.clone(), vc.clone(), L, C, V), layer(q, k, v, kc.clone(), vc.clone(), L, C, V))


@pytest.mark.parametrize(
    "softcap,window,error,match",
    [
        (float("nan"), -1, ValueError, "softcap must be a finite number >= 0"),
        (-1.0, -1, ValueError, "softcap must be a finite number >= 0"),
        (math.inf, -1, ValueError, "softcap must be a finite number >= 0"),
        (1e39, -1, ValueError, "fits in fp32"),
        (0.0, -2, ValueError, "window_left must be >= 0 .* or -1"),
        (0.0, 2**63, ValueError, "window_left must be >= 0"),
        ("1", -1, TypeError, "softcap must be a number"),
        (0.0, 1.5, TypeError, "window_left must be an integer"),
        (0.0, True, TypeError, "window_left must be an integer, got a bool"),
    ],
)
def test_bad_features(device, softcap, window, error, match):
    q, k, v, kc, vc = make_inputs(1, 1, 2, 2, 64, 8, device=device)
    L, C = lengths([1], device), lengths([2], device)
    with pytest.raises(error, match=match):
        sbd_ext.block_attention(q, k, v, kc, vc, L, C, C, 0.125, softcap, window)
    if error is ValueError and not isinstance(window, int) or (error is ValueError and -(2**63) <= window < 2**63):
        with pytest.raises(ValueError, match="block_attention: "):  # the C++ check says the same without the wrapper
            OP(q, k, v, kc, vc, L, C, C, 0.125, softcap, window)
