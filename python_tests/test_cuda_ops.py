"""CUDA kernels against the fp32 references and the CPU kernels (skipped without an NVIDIA GPU + CUDA build).

- entropy_sample: identical tokens on CPU and CUDA for the same (seed, offset), greedy and sampled, bit for bit (both
  compute every Gumbel score with the same correctly rounded operations, sbd/gumbel.h; against the reference, whose
  torch.log may round a score 1 ulp apart, a sampled token may differ only at such a near-tie); entropy / max_prob
  within fp32 rounding; NaN / +inf / all -inf rows exactly as the reference.
- block_attention: within 2x of PyTorch's own error (SDPA in the same low precision, equivalent mask) against
  the fp32 reference, and within the tolerance table; caches appended exactly; never a write past the cache end.
- mask_replace: identical to the reference and the CPU kernel.
- compute-sanitizer (memcheck / racecheck / synccheck) over a small case of each op, when the tool exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from utils import CUDA_OK, assert_close  # noqa: E402

import sbd_ext
from sbd_ext import reference as ref

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA_OK, reason="needs an NVIDIA GPU and sbd_ext built with its CUDA kernels"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---- entropy_sample ---------------------------------------------------------------------------------------
def make_logits(n: int, v: int, dtype: torch.dtype, seed: int, special: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 4
    if special and n >= 5:
        x[1, v // 2] = float("nan")
        x[2, v // 3] = float("inf")
        x[3] = float("-inf")
        x[4] = torch.randint(0, 3, (v,), generator=g).float()  # ties at the maximum
        x[0, ::7] = float("-inf")  # banned tokens
    return x.to(dtype)


def assert_tokens_match(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, temperature: float, seed, offset):
    got, want = got.cpu(), want.cpu()
    if temperature == 0.0:
        assert torch.equal(got, want), f"greedy tokens differ: {got.tolist()} vs {want.tolist()}"
        return
    n, v = x.shape
    u = ref.philox_uniform(n, v, seed, offset).double()
    score = x.cpu().double() / temperature - torch.log(-torch.log(u))
    for r in torch.nonzero(got != want).flatten().tolist():
        assert got[r] >= 0 and want[r] >= 0, f"row {r}: validity differs ({int(got[r])} vs {int(want[r])})"
        gap = float(score[r, want[r]] - score[r, got[r]])
        assert abs(gap) < 1e-4, f"row {r}: token {int(got[r])} vs {int(want[r])}, Gumbel score gap {gap:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [7, 1000, 49152, 128256])
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_entropy_sample_cuda(rows, vocab, dtype, temperature):
    x = make_logits(rows, vocab, dtype, seed=rows * 7 + vocab)
    seed, offset = 0xDEADBEEF12345678, 4242 + rows
    ent, pmax, tok = sbd_ext.entropy_sample(x.cuda(), temperature, seed, offset)
    r_ent, r_pmax, r_tok = ref.entropy_sample(x, temperature, seed, offset)
    assert_close(ent, r_ent, atol=1e-4, rtol=1e-4, msg="entropy")
    assert_close(pmax, r_pmax, atol=1e-6, rtol=1e-5, msg="max_prob")
    assert_tokens_match(tok, r_tok, x, temperature, seed, offset)
    # The CPU kernel is part of every build: a missing one is an error here, never a skipped cross-check. Both
    # kernels score with the same exactly rounded Gumbel noise (sbd/gumbel.h): the tokens agree bit for bit.
    c = sbd_ext.entropy_sample(x, temperature, seed, offset)
    assert torch.equal(tok.cpu(), c[2]), f"tokens differ from the CPU kernel's: {tok.tolist()} vs {c[2].tolist()}"
    assert_close(ent, c[0], atol=1e-4, rtol=1e-4, msg="entropy vs CPU kernel")


@pytest.mark.parametrize("dtype", DTYPES)
def test_entropy_sample_cuda_strided_and_misaligned(dtype):
    # Rows 1 element past a 16-byte boundary and a row stride that is not a multiple of the vector width.
    n, v = 16, 4099
    base = make_logits(n, v + 4, dtype, seed=3).cuda()
    x = base[:, 1 : v + 1]
    for temperature in (0.0, 1.3):
        got = sbd_ext.entropy_sample(x, temperature, 11, 12)
        want = ref.entropy_sample(x.contiguous().cpu(), temperature, 11, 12)
        assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
        assert_tokens_match(got[2], want[2], x, temperature, 11, 12)


def test_entropy_sample_cuda_invalid_rows_and_determinism():
    x = make_logits(8, 50000, torch.bfloat16, seed=9).cuda()
    a = sbd_ext.entropy_sample(x, 0.7, 5, 6)
    b = sbd_ext.entropy_sample(x, 0.7, 5, 6)
    for u, w in zip(a, b, strict=True):
        assert torch.equal(u.nan_to_num(-1), w.nan_to_num(-1)), "two identical calls differ"
    ent, pmax, tok = (t.cpu() for t in a)
    for r in (1, 2, 3):  # NaN, +inf, all -inf
        assert ent[r].isnan() and pmax[r].isnan() and tok[r] == -1
    assert not ent[[0, 4, 5]].isnan().any()


# ---- block_attention --------------------------------------------------------------------------------------
def sdpa_lowp(q, k, v, kc, vc, lens, commit, valid, scale):
    """PyTorch's best built-in on the same problem, in the inputs' precision: SDPA with the equivalent mask."""
    B, Hq, T, D = q.shape
    Hkv, S = kc.shape[1], kc.shape[2]
    keys = torch.cat([kc, k], 2).repeat_interleave(Hq // Hkv, 1)
    vals = torch.cat([vc, v], 2).repeat_interleave(Hq // Hkv, 1)
    mask = ref.block_attention_mask(lens, commit, valid, T, S)[:, None]
    out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale)
    return out.nan_to_num(0.0).transpose(1, 2)  # fully masked (padding) rows -> 0, [B, T, Hq, D]


ATTN_CASES = [
    # (Hkv, g, T, D, cache_lens per sequence, n_commit, n_valid)
    (2, 1, 1, 64, [0, 1], [1, 1], [1, 1]),
    (3, 3, 16, 64, [257, 0], [0, 16], [16, 11]),  # SmolLM2 heads; set block, then committed + padding
    (2, 4, 16, 128, [4096, 1], [16, 3], [16, 16]),  # Llama-3.1-8B ratio
    (1, 4, 33, 128, [257, 4096], [16, 33], [33, 20]),  # M = 132 packed rows: three m-tiles
    (2, 3, 64, 64, [1, 257], [32, 64], [64, 64]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"Hkv{c[0]}-g{c[1]}-T{c[2]}-D{c[3]}-L{max(c[4])}")
@pytest.mark.parametrize("kernel", ["default", "simt"])
@pytest.mark.parametrize("len_dtype", [torch.int32, torch.int64])
def test_block_attention_cuda(case, dtype, kernel, len_dtype, monkeypatch):
    if kernel == "simt" and dtype == torch.float32:
        pytest.skip("fp32 always uses the CUDA-core kernel")
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
    want = ref.block_attention(q.float(), k.float(), v.float(), r_kc.float(), r_vc.float(), cl, nc, nv, scale)
    r_kc, r_vc = kc.clone(), vc.clone()
    ref.block_attention(q, k, v, r_kc, r_vc, cl, nc, nv, scale)  # the appended caches, in the cache dtype
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
    want = ref.block_attention(q.float(), k.float(), v.float(), kc.float(), vc.float(), cl, nc, nv, D**-0.5)
    dev = [t.cuda() for t in (q, k, v, kc, vc, cl, nc, nv)]
    got = sbd_ext.block_attention(*dev, D**-0.5)
    assert_close(got, want, dtype=torch.bfloat16)


def test_block_attention_cuda_never_writes_past_the_cache():
    # cache_lens + n_commit > S: an invalid call (the CUDA binding does not read lengths on the host); the kernel
    # must clamp. The caches are views of a larger buffer whose extra rows must stay untouched.
    B, Hkv, g, T, D, S = 1, 2, 2, 8, 128, 20
    big_k = torch.zeros(B, Hkv, S + 16, D, device="cuda", dtype=torch.bfloat16)
    big_v = torch.zeros_like(big_k)
    q = torch.randn(B, Hkv * g, T, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, B, Hkv, T, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([S - 3], device="cuda")
    n = torch.tensor([T], device="cuda")
    sbd_ext.block_attention(q, k, v, big_k[:, :, :S], big_v[:, :, :S], lens, n, n)
    torch.cuda.synchronize()
    assert big_k[:, :, S:].abs().sum() == 0 and big_v[:, :, S:].abs().sum() == 0
    assert torch.equal(big_k[:, :, S - 3 : S], k[:, :, :3])


def test_ops_capture_in_a_cuda_graph():
    # No host synchronisation inside the ops: all three capture into one graph and replay.
    x = make_logits(16, 49152, torch.bfloat16, seed=1, special=False).cuda()
    B, Hkv, g, T, D, S = 1, 2, 4, 16, 128, 300
    q = torch.randn(B, Hkv * g, T, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, B, Hkv, T, D, device="cuda", dtype=torch.bfloat16)
    kc, vc = torch.randn(2, B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    lens, nc, nv = (torch.tensor([x], device="cuda", dtype=torch.int32) for x in (100, 0, 16))
    tokens = torch.full((1, 16), 7, device="cuda", dtype=torch.int64)

    def step():
        out = sbd_ext.block_attention(q, k, v, kc, vc, lens, nc, nv)
        ent, pmax, tok = sbd_ext.entropy_sample(x, 0.0)
        counts = sbd_ext.mask_replace(tokens, tok.view(1, 16), ent.view(1, 16), pmax.view(1, 16), 7, "eb", 0.35)
        return out, tok, counts

    eager = step()
    tokens.fill_(7)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up on a side stream, as torch.cuda.graphs recommends
    torch.cuda.current_stream().wait_stream(s)
    tokens.fill_(7)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    tokens.fill_(7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    assert torch.equal(captured[2][0], eager[2][0])


# ---- mask_replace -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [1, 16, 100, 1024])
@pytest.mark.parametrize("rule", ref.RULES)
@pytest.mark.parametrize("threshold", [0.0, 0.35, 0.9])
def test_mask_replace_cuda(K, rule, threshold):
    B, mask_id = 6, 3
    g = torch.Generator().manual_seed(K)
    tokens = torch.randint(0, 50, (B, K), generator=g)
    tokens[torch.rand(B, K, generator=g) < 0.7] = mask_id
    tokens[0] = mask_id  # all masked
    tokens[1] = 9  # none masked
    proposals = torch.randint(-1, 50, (B, K), generator=g)
    ent = torch.rand(B, K, generator=g) * 0.5
    ent[:, ::5] = 0.1  # ties
    ent[2, ::3] = float("nan")
    conf = torch.rand(B, K, generator=g)
    want_tok = tokens.clone()
    want = ref.mask_replace(want_tok, proposals, ent, conf, mask_id, rule, threshold)
    # Non-contiguous tokens (a column slice), as a decoding loop may keep the block inside a longer buffer.
    buf = torch.full((B, K + 2), -5, dtype=torch.int64, device="cuda")
    g_tok = buf[:, 1 : K + 1]
    g_tok.copy_(tokens)
    got = sbd_ext.mask_replace(g_tok, proposals.cuda(), ent.cuda(), conf.cuda(), mask_id, rule, threshold)
    assert torch.equal(g_tok.cpu(), want_tok)
    assert (buf[:, 0] == -5).all() and (buf[:, -1] == -5).all()
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    c_tok = tokens.clone()
    c = sbd_ext.mask_replace(c_tok, proposals, ent, conf, mask_id, rule, threshold)
    assert torch.equal(c_tok, g_tok.cpu()) and torch.equal(c[0], got[0].cpu()) and torch.equal(c[1], got[1].cpu())


def test_mask_replace_cuda_rejects_too_long_blocks():
    t = torch.zeros(1, 1025, dtype=torch.int64, device="cuda")
    f = torch.zeros(1, 1025, device="cuda")
    with pytest.raises(ValueError, match="1024"):
        sbd_ext.mask_replace(t, t, f, f, 0, "eb", 0.1)


def test_block_attention_cuda_rejects_unsupported_head_dim():
    q = torch.zeros(1, 2, 1, 96, device="cuda")
    kv = torch.zeros(1, 2, 1, 96, device="cuda")
    cache = torch.zeros(1, 2, 4, 96, device="cuda")
    n = torch.ones(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="head dim"):
        sbd_ext.block_attention(q, kv, kv, cache, cache.clone(), n * 0, n, n)


# ---- compute-sanitizer ------------------------------------------------------------------------------------
SANITIZER_SCRIPT = r"""
import torch, sbd_ext
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(5, 4099, device="cuda", dtype=dtype)
    x[1, 7] = float("nan")
    sbd_ext.entropy_sample(x, 0.0)
    sbd_ext.entropy_sample(x[:, 1:], 0.9, 1, 2)
    for simt in ("0", "1"):
        import os; os.environ["SBD_EXT_ATTN_SIMT"] = simt
        B, Hkv, g, T, D, S = 2, 2, 3, 17, 64, 150
        q = torch.randn(B, Hkv * g, T, D, device="cuda", dtype=dtype)
        k, v = torch.randn(2, B, Hkv, T, D, device="cuda", dtype=dtype)
        kc, vc = torch.randn(2, B, Hkv, S, D, device="cuda", dtype=dtype)
        lens = torch.tensor([0, 140], device="cuda")  # second: 140 + 17 > 150, the kernel must clamp
        sbd_ext.block_attention(q, k, v, kc, vc, lens, torch.tensor([5, 17], device="cuda"),
                                torch.tensor([12, 17], device="cuda"))
tok = torch.full((3, 16), 2, device="cuda")
sbd_ext.mask_replace(tok, torch.arange(48, device="cuda").view(3, 16), torch.rand(3, 16, device="cuda"),
                     torch.rand(3, 16, device="cuda"), 2, "eb", 0.3)
torch.cuda.synchronize()
print("sanitizer-script-ok")
"""


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = os.path.join(home, "bin", "compute-sanitizer")
    return path if os.path.exists(path) else None


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer(tool):
    exe = _sanitizer()
    if exe is None:
        pytest.skip("compute-sanitizer not found (set CUDA_HOME)")
    # Without the caching allocator every tensor is its own allocation, so memcheck sees exact bounds.
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    cmd = [exe, "--tool", tool, "--error-exitcode", "99", sys.executable, "-c", SANITIZER_SCRIPT]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0 and "sanitizer-script-ok" in res.stdout, (
        f"{tool} failed (rc {res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    )
