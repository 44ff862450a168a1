"""Batch invariance of the CPU ops: a row's result is bit for bit the one it gets alone, whatever the row count, the
tile the row falls in, the cache length split (cache rows vs new rows), the thread count and the cache splits
(issue 61; verify decoding equals next-token decoding by construction, not by luck).

Every CPU kernel variant this machine runs (cpu_isa / isa_device) and every row_linear weight form. The comparisons
are torch.equal: no tolerance. (That each result is also right is the other op tests' job, against the reference.)
"""

import pytest
import torch

import sbd_ext
from sbd_ext.packing import pack_row_linear_int8, pack_row_linear_weight
from sbd_ext.quantization import quantize_weight

ROWS = range(1, 25)


def _forms(w: torch.Tensor):
    """Each weight form row_linear takes, as (name, fn(x) -> out)."""
    q, s = quantize_weight(w)
    forms = [
        ("plain", lambda x: sbd_ext.row_linear(x, w)),
        ("packed", lambda x, p=pack_row_linear_weight(w, pad=True): sbd_ext.row_linear(x, p)[:, : w.shape[0]]),  # noqa: B008
        ("int8", lambda x: sbd_ext.row_linear(x, q, s)),
        ("w8a8", lambda x: sbd_ext.row_linear(x, q, s, quantize_x=True)),
        ("bf16", lambda x, b=w.bfloat16(): sbd_ext.row_linear(x, b)),  # noqa: B008
        (
            "bf16-packed",
            lambda x, p=pack_row_linear_weight(w.bfloat16(), pad=True): sbd_ext.row_linear(x, p)[:, : w.shape[0]],  # noqa: B008
        ),
    ]
    if w.shape[0] % 16 == 0:
        forms.append(("w8a8-packed", lambda x, p=pack_row_linear_int8(q): sbd_ext.row_linear(x, p, s, quantize_x=True)))  # noqa: B008
    return forms


# K: SmolLM2's 576, a ragged 37 (vector and segment tails), 1, 3 and 5 (segments shorter than a vector, empty
# segments); N: whole and ragged tiles.
@pytest.mark.parametrize("N,K", [(192, 576), (48, 37), (16, 1), (32, 5), (17, 3), (64, 64), (19, 70)])
@pytest.mark.parametrize("threads", [1, 2])
def test_row_linear_row_equals_the_row_alone(cpu_isa, N, K, threads):
    gen = torch.Generator().manual_seed(N * 1000 + K)
    w = torch.randn(N, K, generator=gen)
    x = torch.randn(max(ROWS), K, generator=gen)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, f in _forms(w):
            alone = torch.cat([f(x[i : i + 1]) for i in range(x.shape[0])])
            for M in ROWS:
                out = f(x[:M])
                same = [torch.equal(out[i], alone[i]) for i in range(M)]
                assert all(same), f"{name}: M={M}, rows differing from the row alone: {same.count(False)}"
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("K", [576, 70, 1536])
def test_w8a8_packed_rows_quantised_together_equal_the_rows_alone(cpu_isa, K):
    """x's blocks of 2-16 rows are quantised together (one max and one sum over 16 rows at a time, AVX-512): each
    row's output is still bit for bit the row alone's, with rows of every kind side by side: NaN, inf, all zero,
    subnormal, near FLT_MAX, one large value among small ones, and ordinary rows (NaN where the row alone is NaN)."""
    gen = torch.Generator().manual_seed(K)
    w = torch.randn(32, K, generator=gen)
    q, s = quantize_weight(w)
    p = pack_row_linear_int8(q)
    x = torch.randn(24, K, generator=gen)
    x[1, 5] = float("nan")
    x[3, K - 1] = float("-inf")
    x[4] = 0.0
    x[6] = 1e-42 * torch.sign(x[6])
    x[7] = 3e38 * torch.sign(x[7])
    x[9, 40 % K] = 1e6
    x[12, :32] = 0.0
    f = lambda rows: sbd_ext.row_linear(rows, p, s, quantize_x=True)  # noqa: E731
    alone = torch.cat([f(x[i : i + 1]) for i in range(x.shape[0])])
    assert alone[1].isnan().all() and alone[3].isnan().all() and not alone[4].any()
    for M in (2, 3, 5, 8, 16, 17, 24):
        out = f(x[:M])
        for i in range(M):
            assert torch.equal(out[i].isnan(), alone[i].isnan()), f"M={M} row {i}: NaN pattern"
            assert torch.equal(out[i].nan_to_num(), alone[i].nan_to_num()), f"M={M} row {i} differs"


def test_gated_lora_linear_row_equals_the_row_alone(cpu_isa):
    """The gated adapter's product: a row's output does not depend on the other rows or on their gates."""
    gen = torch.Generator().manual_seed(7)
    N, K, r = 64, 96, 16
    w, a, b = torch.randn(N, K, generator=gen), torch.randn(r, K, generator=gen), torch.randn(N, r, generator=gen)
    weight, lora_b = pack_row_linear_weight(torch.cat([w, a]), pad=True), pack_row_linear_weight(b)
    x = torch.randn(max(ROWS), K, generator=gen)
    gate = (torch.arange(max(ROWS)) % 3 != 0).float()
    alone = torch.cat([sbd_ext.ops.gated_lora_linear(x[i : i + 1], weight, lora_b, gate[i : i + 1]) for i in range(24)])
    for M in ROWS:
        out = sbd_ext.ops.gated_lora_linear(x[:M], weight, lora_b, gate[:M])
        assert torch.equal(out, alone[:M]), f"M={M}"


def _attention(q, k, v, kc, vc, L, T, window):
    lens = lambda n: torch.tensor([n], dtype=torch.int64)  # noqa: E731
    return sbd_ext.block_attention(q, k, v, kc, vc, lens(L), lens(T), lens(T), q.shape[-1] ** -0.5, 0.0, window)


# (Hkv, g, D): SmolLM2's 3 x 3 x 64 (3 lanes a row: the rows path alone, the lanes path from 3 rows), Llama's
# 1 x 4 x 128, 2 x 1 x 32. Cache lengths across a key block (64 / 96) and a split (768 keys) boundary.
@pytest.mark.parametrize("Hkv,g,D", [(3, 3, 64), (1, 4, 128), (2, 1, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [-1, 300])
def test_block_attention_row_equals_the_row_alone(cpu_isa, Hkv, g, D, dtype, window):
    """Rows committed together over a cache of L rows equal each row run alone over a cache of L + i rows (the
    next-token step at that position), for 1..24 rows, 1 and 2 threads, the cache split across 768-key splits."""
    gen = torch.Generator().manual_seed(Hkv * 100 + D)
    S, N = 1700, 24
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    q, k, v = rnd(1, Hkv * g, N, D), rnd(1, Hkv, N, D), rnd(1, Hkv, N, D)
    kc, vc = rnd(1, Hkv, S, D), rnd(1, Hkv, S, D)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for L in (0, 5, 760, 1600):
                kc1, vc1 = kc.clone(), vc.clone()
                alone = [
                    _attention(*(t[:, :, i : i + 1].contiguous() for t in (q, k, v)), kc1, vc1, L + i, 1, window)[:, 0]
                    for i in range(N)
                ]
                for T in (1, 2, 3, 5, 16, 24):
                    out = _attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], kc.clone(), vc.clone(), L, T, window)
                    same = [torch.equal(out[:, i], alone[i]) for i in range(T)]
                    assert all(same), f"threads={threads} L={L} T={T}: {same.count(False)} rows differ"
    finally:
        torch.set_num_threads(old)


def test_a_set_block_rows_nan_value_never_reaches_a_committed_row(cpu_isa):
    """A drafter's non-finite V in the set-block rows (never stored) costs its drafts only: the committed rows of the
    same forward are exactly what they are with finite block rows, and equal the reference (same rule)."""
    from sbd_ext import reference

    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 4, 6, 64, generator=gen) for _ in range(3))
    kc, vc = torch.randn(1, 2, 40, 64, generator=gen), torch.randn(1, 2, 40, 64, generator=gen)
    lens = lambda *n: torch.tensor(n, dtype=torch.int64)  # noqa: E731
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    clean = sbd_ext.block_attention(q, k, v, kc.clone(), vc.clone(), lens(3), lens(4), lens(6), 0.125)
    bad_v = v.clone()
    bad_v[:, :, 4:, 5] = float("nan")
    bad_v[:, :, 5, 9] = float("inf")
    out = sbd_ext.block_attention(q, k, bad_v, kc.clone(), vc.clone(), lens(3), lens(4), lens(6), 0.125)
    assert torch.equal(out[:, :4], clean[:, :4])
    assert torch.isfinite(out).all()
    ref = reference.block_attention(q, k, bad_v, kc.clone(), vc.clone(), lens(3), lens(4), lens(6), 0.125)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)
