"""Fuzz (hypothesis) of block_attention's lengths and of both ops' sizes near the int32 / int64 limits.

The property, on every device present: never a crash -- either a ValueError that names what is wrong, or the result
of :mod:`sbd_ext.reference`. A refused call leaves the mutated tensors (caches, block tokens) as they were.

* lengths: ``cache_lens`` / ``n_commit`` / ``n_valid`` drawn from small valid values and values at and around
  +-2**31, 2**32, +-2**63 (int32 and int64 tensors), so that sums such as ``cache_lens + n_commit`` overflow int32
  or int64 if a kernel computed them naively; the error must come exactly when
  :func:`sbd_ext.reference.block_attention_length_error` finds one, and must name the same argument.
* sizes: tensors with a zero dimension and dimensions up to 2**40 (no memory behind them), so that products of
  sizes (rows x heads x head dim, batch x block) overflow 32 and 64 bits; and mask_replace's token / proposal ids
  and mask id anywhere in int64.

max_examples is small (the suite runs on a 2-core CI machine); ``deadline=None`` because the first example of each
test pays for the kernel's thread pool and the machine is shared.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from utils import DEVICES, assert_close, run_block_attention

import sbd_ext
from sbd_ext import reference

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
# Values where 32- and 64-bit arithmetic on lengths goes wrong: the limits, one past them, and their halves.
EDGES = [
    I32_MAX - 1,
    I32_MAX,
    I32_MAX + 1,
    2**32 - 1,
    2**32,
    2**32 + 1,
    2**62,
    I64_MAX - 1,
    I64_MAX,
    -1,
    I32_MIN,
    I32_MIN - 1,
    -(2**32),
    I64_MIN + 1,
    I64_MIN,
]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# The argument each reason of reference.block_attention_length_error is reported under.
REASON_NAMES = {
    "cache_lens": r"cache_lens\[\d+\] = -?\d+ is negative",
    "n_commit": r"n_commit\[\d+\] = -?\d+ is negative",
    "n_valid": r"n_valid\[\d+\] = -?\d+ is negative",
    "n_valid > T": r"n_valid\[\d+\] = \d+ exceeds the number of new rows T",
    "n_commit > n_valid": r"n_commit\[\d+\] = \d+ exceeds n_valid",
    "cache overflow": r"cache overflow for sequence \d+",
}


def length_values(dtype: torch.dtype):
    lo, hi = (I32_MIN, I32_MAX) if dtype == torch.int32 else (I64_MIN, I64_MAX)
    edges = [e for e in EDGES if lo <= e <= hi]
    # Mostly small values (valid calls, which then compare with the reference), some limits, some anything.
    return st.one_of(st.integers(0, 12), st.integers(0, 12), st.sampled_from(edges), st.integers(lo, hi))


@st.composite
def attention_call(draw, device: str):
    B = draw(st.integers(1, 3))
    Hkv, g = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    T, S = draw(st.integers(0, 5)), draw(st.integers(0, 9))
    D = 64 if device == "cuda" else draw(st.sampled_from([8, 64]))  # CUDA kernels: head dims 32, 64 and 128
    names = ("cache_lens", "n_commit", "n_valid")
    dtypes = [draw(st.sampled_from([torch.int32, torch.int64])) for _ in names]
    rows = []
    for _ in range(B):
        kind = draw(st.sampled_from(["valid", "valid", "overflow", "any"]))
        if kind == "any":
            rows.append(tuple(draw(length_values(dt)) for dt in dtypes))
            continue
        # valid: so that whole batches are often valid and get compared with the reference. overflow: valid row
        # counts after a cache length at the limits, where cache_lens + n_commit wraps in 32 or 64 bits.
        n_valid = draw(st.integers(0, T))
        top = I32_MAX if dtypes[0] == torch.int32 else I64_MAX
        cache = draw(st.integers(0, S) if kind == "valid" else st.sampled_from([e for e in EDGES if 0 < e <= top]))
        n_commit = draw(st.integers(0, max(0, min(n_valid, S - cache)) if kind == "valid" else n_valid))
        rows.append((cache, n_commit, n_valid))
    lens = {
        n: torch.tensor([r[i] for r in rows], dtype=dt) for i, (n, dt) in enumerate(zip(names, dtypes, strict=True))
    }
    seed = draw(st.integers(0, 2**16))
    return B, Hkv, g, T, S, D, lens, seed


@pytest.mark.parametrize("device", DEVICES)
@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_block_attention_lengths(device, data):
    reasons = check_block_attention(device, *data.draw(attention_call(device)))
    event("valid: compared with the reference" if not any(reasons) else "refused")  # --hypothesis-show-statistics
    for r in filter(None, reasons):
        event(f"reason: {r}")


# The wrap-arounds a random draw hits only a few times in 150 examples, every run: a cache length at the top of its
# dtype plus committed rows (wraps in that dtype), 2**32 + small (0 when truncated to 32 bits: would pass the check),
# a negative int64 that is small and positive in its low 32 bits.
EDGE_CASES = {
    "int64 max + 2": ([I64_MAX], [2], [3], torch.int64),
    "int64 max - 1 + 1": ([I64_MAX - 1], [1], [1], torch.int64),
    "int32 max + 2 (int32)": ([I32_MAX], [2], [3], torch.int32),
    "int32 max + 1 (int64)": ([I32_MAX], [1], [3], torch.int64),
    "2**32 + 1 (low bits 1)": ([2**32 + 1], [1], [2], torch.int64),
    "n_valid 2**32 + 2 (low bits 2)": ([0], [1], [2**32 + 2], torch.int64),
    "n_commit -2**32 + 1 (low bits 1)": ([0], [-(2**32) + 1], [2], torch.int64),
    "n_commit int64 min": ([0], [I64_MIN], [2], torch.int64),
    "second sequence wraps": ([1, I64_MAX], [2, 2], [3, 3], torch.int64),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_block_attention_length_edges(device, name):
    cache, commit, valid, dtype = EDGE_CASES[name]
    lens = {
        n: torch.tensor(x, dtype=dtype)
        for n, x in zip(("cache_lens", "n_commit", "n_valid"), (cache, commit, valid), strict=True)
    }
    reasons = check_block_attention(device, len(cache), 2, 2, 3, 8, 64, lens, seed=0)
    assert any(reasons), "every edge case is invalid"


def check_block_attention(device, B, Hkv, g, T, S, D, lens, seed) -> list[str | None]:
    """Run the op once; assert the error / result property; return the reference's reason per sequence."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * g, T, D, generator=gen)
    k, v = torch.randn(2, B, Hkv, T, D, generator=gen)
    kc, vc = torch.randn(2, B, Hkv, S, D, generator=gen)
    reasons = [
        reference.block_attention_length_error(
            int(lens["cache_lens"][b]), int(lens["n_commit"][b]), int(lens["n_valid"][b]), T, S
        )
        for b in range(B)
    ]
    dev = torch.device(device)
    g_kc, g_vc = kc.clone().to(dev), vc.clone().to(dev)  # .to(cpu) would alias kc, vc
    out, err = run_block_attention(
        q=q.to(dev),
        k=k.to(dev),
        v=v.to(dev),
        k_cache=g_kc,
        v_cache=g_vc,
        cache_lens=lens["cache_lens"].to(dev),
        n_commit=lens["n_commit"].to(dev),
        n_valid=lens["n_valid"].to(dev),
        scale=D**-0.5,
    )
    bad = [b for b in range(B) if reasons[b] is not None]
    if bad:
        assert err is not None, f"invalid lengths accepted: {reasons} for { {n: t.tolist() for n, t in lens.items()} }"
        # The first invalid sequence is reported, under the argument the reference names.
        msg = str(err)
        assert re.search(REASON_NAMES[reasons[bad[0]]], msg), f"{msg!r} vs reference reason {reasons[bad[0]]!r}"
        assert f"[{bad[0]}]" in msg or f"sequence {bad[0]}" in msg, msg
        if device == "cpu":
            assert out is None
            assert torch.equal(g_kc, kc) and torch.equal(g_vc, vc), "a refused call wrote to the caches"
            return reasons
        # CUDA: the kernel ran, with the invalid sequences empty (zero rows, nothing appended).
        for b in bad:
            assert not out[b].any()
            assert torch.equal(g_kc[b].cpu(), kc[b]) and torch.equal(g_vc[b].cpu(), vc[b])
        keep = [b for b in range(B) if reasons[b] is None]
    else:
        assert err is None, f"valid lengths refused: {err}"
        keep = list(range(B))
    if not keep:
        return reasons
    r_kc, r_vc = kc[keep].clone(), vc[keep].clone()
    want = reference.block_attention(
        q[keep], k[keep], v[keep], r_kc, r_vc, *(lens[n][keep] for n in ("cache_lens", "n_commit", "n_valid")), D**-0.5
    )
    assert_close(out[keep], want, msg="vs reference")
    assert torch.equal(g_kc[keep].cpu(), r_kc) and torch.equal(g_vc[keep].cpu(), r_vc), "cache append differs"
    return reasons


# ---- sizes: zero-element tensors whose other dimensions are huge ------------------------------------------------
DIM = st.one_of(st.integers(1, 3), st.sampled_from([I32_MAX, I32_MAX + 1, 2**32 + 1, 2**40]))


@pytest.mark.parametrize("device", DEVICES)
@FUZZ
@given(
    zero=st.sampled_from(["B", "T and S", "D"]),
    B=st.integers(1, 3),
    Hkv=DIM,
    g=DIM,
    T=DIM,
    D=DIM,
    S=DIM,
)
def test_block_attention_huge_empty_shapes(device, zero, B, Hkv, g, T, D, S):
    """A zero batch, zero rows, or a zero head dim next to dimensions up to 2**40: an empty result or a ValueError,
    never an overflow in a size product (Hq * T * D would be 2**120 here) or an attempt to touch memory."""
    if zero == "B":
        B = 0
    elif zero == "T and S":
        T = S = 0
    else:
        D = 0
    Hq = Hkv * g
    # Shapes whose non-zero sizes multiply past int64 cannot even be built by torch; the op never sees them.
    for shape in ((B, Hq, T, D), (B, Hkv, S, D), (B, T, Hq, D)):
        assume(math.prod(n for n in shape if n) < 2**62)
    dev = torch.device(device)
    q = torch.empty(B, Hq, T, D, device=dev)
    k, v = torch.empty(B, Hkv, T, D, device=dev), torch.empty(B, Hkv, T, D, device=dev)
    kc, vc = torch.empty(B, Hkv, S, D, device=dev), torch.empty(B, Hkv, S, D, device=dev)
    zeros = torch.zeros(B, dtype=torch.int64, device=dev)  # T = 0 or B = 0: only zero lengths can be valid
    try:
        out = torch.ops.sbd_ext.block_attention(q, k, v, kc, vc, zeros, zeros, zeros, 1.0)
        sbd_ext.ops.check_cuda_errors()
    except ValueError as e:
        assert re.search(r"block_attention: \S+", str(e)), str(e)  # names the op and the argument
        return
    assert out.shape == (B, T, Hq, D) and out.numel() == 0 and out.dtype == q.dtype


@pytest.mark.parametrize("device", DEVICES)
@FUZZ
@given(B=st.sampled_from([0, 1, 2**40]), K=st.sampled_from([0, 1, 2**31, 2**40]))
def test_mask_replace_huge_empty_shapes(device, B, K):
    assume(B * K == 0 and B <= 2**20)  # the counts [B] are real outputs: a batch of 2**40 cannot be allocated
    dev = torch.device(device)
    tok, prop = torch.empty(B, K, dtype=torch.int64, device=dev), torch.empty(B, K, dtype=torch.int64, device=dev)
    ent, conf = torch.empty(B, K, device=dev), torch.empty(B, K, device=dev)
    try:
        n_rev, n_rem = sbd_ext.mask_replace(tok, prop, ent, conf, 5, "eb", 0.1)
    except ValueError as e:
        assert "mask_replace" in str(e) and (device == "cuda" and "1024" in str(e)), str(e)
        return
    assert n_rev.shape == n_rem.shape == (B,) and not n_rev.any() and not n_rem.any()


TOKEN = st.one_of(st.integers(-1, 9), st.sampled_from(EDGES), st.integers(I64_MIN, I64_MAX))
STAT = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def replace_call(draw):
    B, K = draw(st.integers(1, 3)), draw(st.integers(1, 17))
    mask_id = draw(TOKEN)
    # Blocks mostly masked (so something is revealed), the rest arbitrary ids, the mask id among them or not.
    tokens = [[draw(st.one_of(st.just(mask_id), st.just(mask_id), TOKEN)) for _ in range(K)] for _ in range(B)]
    proposals = [draw(st.lists(TOKEN, min_size=K, max_size=K)) for _ in range(B)]
    ent = [draw(st.lists(st.one_of(st.floats(0, 3, width=32), STAT), min_size=K, max_size=K)) for _ in range(B)]
    conf = [draw(st.lists(st.one_of(st.floats(0, 1, width=32), STAT), min_size=K, max_size=K)) for _ in range(B)]
    rule = draw(st.sampled_from(["eb", "entropy", "confidence"]))
    threshold = draw(st.one_of(st.floats(0, 2), st.floats(allow_nan=True, allow_infinity=True)))
    return (
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(proposals, dtype=torch.int64),
        torch.tensor(ent, dtype=torch.float32),
        torch.tensor(conf, dtype=torch.float32),
        mask_id,
        rule,
        threshold,
    )


@pytest.mark.parametrize("device", DEVICES)
@FUZZ
@given(call=replace_call())
def test_mask_replace_ids_and_statistics(device, call):
    """Any int64 ids and mask id, any float statistics (NaN, +-inf, negative), any threshold: the reference's result,
    or a ValueError for a threshold the rule cannot use (NaN; a negative gamma)."""
    tokens, proposals, ent, conf, mask_id, rule, threshold = call
    dev = torch.device(device)
    ours = tokens.clone().to(dev)  # .to(cpu) alone would alias tokens
    bad_threshold = threshold != threshold or (rule != "confidence" and threshold < 0)
    try:
        n_rev, n_rem = sbd_ext.mask_replace(
            ours, proposals.to(dev), ent.to(dev), conf.to(dev), mask_id, rule, threshold
        )
    except ValueError as e:
        assert bad_threshold, f"refused a usable call: {e}"
        assert "threshold" in str(e) or "gamma" in str(e), str(e)
        assert torch.equal(ours.cpu(), tokens), "a refused call wrote to tokens"
        return
    assert not bad_threshold, f"accepted threshold {threshold} for rule {rule!r}"
    want = tokens.clone()
    r_rev, r_rem = reference.mask_replace(want, proposals, ent, conf, mask_id, rule, threshold)
    assert torch.equal(ours.cpu(), want)
    assert torch.equal(n_rev.cpu(), r_rev) and torch.equal(n_rem.cpu(), r_rem)
