"""block_attention in bf16 on AMX-BF16 tiles (the "tiles" path, csrc/cpu/block_attention_tiles.h): against
sbd_ext.reference in fp32, each row bit for bit what it is alone (verify's exactness rests on it), and when the path
runs. Every tiles mode this CPU has: the tiles ("on", where AMX-BF16 is usable) and their emulation (any AVX512-VNNI
CPU); skipped on a CPU with neither."""

import pytest
import torch
from test_block_attention import CASES, lengths, make_inputs
from utils import assert_close

import sbd_ext
from sbd_ext import _C, reference

INFO = sbd_ext.build_info()
MODES = []
if "avx512" in INFO["cpu_isas"] and INFO["cpu_vnni"]:
    MODES.append("emulate")
if INFO["cpu_amx_bf16"]:
    MODES.append("on")
pytestmark = pytest.mark.skipif(not MODES, reason="neither AMX-BF16 tiles nor their emulation (AVX512-VNNI) here")


@pytest.fixture(params=MODES)
def tiles(request):
    _C.set_cpu_isa("avx512")
    _C.set_cpu_amx(request.param)
    _C.set_block_attention_matmul("tiles")
    yield request.param
    _C.set_block_attention_matmul("auto")
    _C.set_cpu_amx("auto")
    _C.set_cpu_isa("")


def _paths(fn):
    before = _C.block_attention_cpu_paths()
    out = fn()
    return out, tuple(a - b for a, b in zip(_C.block_attention_cpu_paths(), before, strict=True))


def _run(q, k, v, kc, vc, lens, commit, valid, softcap=0.0, window=-1):
    scale = q.shape[-1] ** -0.5
    L, C, V = (lengths(x, "cpu") for x in (lens, commit, valid))
    out, paths = _paths(
        lambda: sbd_ext.block_attention(q, k, v, kc.clone(), vc.clone(), L, C, V, scale, softcap, window)
    )
    ref = reference.block_attention(
        q.float(), k.float(), v.float(), kc.float(), vc.float(), L, C, V, scale, softcap, window
    )
    return out, ref, paths


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hkv{}-g{}-T{}-D{}-L{}-c{}-v{}".format(*c))
def test_matches_reference(tiles, case):
    B, Hkv, g, T, D, lens, commit, valid = case
    q, k, v, kc, vc = make_inputs(B, Hkv, g, T, D, 300, dtype=torch.bfloat16)
    out, ref, paths = _run(q, k, v, kc, vc, lens, commit, valid)
    assert paths[2] == (0 if D % 32 else 1), "D % 32 != 0 takes another path"
    assert_close(out, ref.to(out.dtype), dtype=torch.bfloat16, msg="output")
    for b in range(B):  # padding rows are exactly zero
        assert not out[b, valid[b] :].any()


@pytest.mark.parametrize("softcap,window", [(0.0, 40), (30.0, -1), (5.0, 100)])
@pytest.mark.parametrize("lens,T", [([1000], 8), ([2000], 1), ([63], 5), ([64], 33)])
def test_long_caches_splits_window_softcap(tiles, softcap, window, lens, T):
    """Caches over several 768-key splits (the partial states and their merge), ragged 64-key blocks, a sliding
    window, soft-capping; NTP (T = 1) and a 2k layout."""
    q, k, v, kc, vc = make_inputs(1, 2, 4, T, 128, 2100, dtype=torch.bfloat16, seed=lens[0])
    out, ref, paths = _run(q, k, v, kc, vc, lens, [T // 2], [T], softcap, window)
    assert paths == (0, 0, 1)
    assert_close(out, ref.to(out.dtype), dtype=torch.bfloat16, msg="output")


@pytest.mark.parametrize("Hkv,g,D", [(3, 3, 64), (1, 4, 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_equals_the_row_alone(tiles, Hkv, g, D, threads):
    """Rows committed together over a cache of L rows equal each row alone over a cache of L + i rows, bit for bit
    (1-24 rows: one lane tile and several; caches across 64-key blocks and a 768-key split)."""
    gen = torch.Generator().manual_seed(Hkv * 100 + D)
    S, N = 1000, 24
    rnd = lambda *s: torch.randn(*s, generator=gen).bfloat16()  # noqa: E731
    q, k, v = rnd(1, Hkv * g, N, D), rnd(1, Hkv, N, D), rnd(1, Hkv, N, D)
    kc, vc = rnd(1, Hkv, S, D), rnd(1, Hkv, S, D)
    one = lambda n: torch.tensor([n], dtype=torch.int64)  # noqa: E731
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for L in (700, 761):
            alone = []
            for i in range(N):  # row i alone: the rows before it committed into the cache
                kci, vci = kc.clone(), vc.clone()
                kci[:, :, L : L + i], vci[:, :, L : L + i] = k[:, :, :i], v[:, :, :i]
                sl = slice(i, i + 1)
                alone.append(
                    sbd_ext.block_attention(
                        q[:, :, sl], k[:, :, sl], v[:, :, sl], kci, vci, one(L + i), one(1), one(1), D**-0.5
                    )[:, 0]
                )
            for T in (2, 5, 16, 24):
                out = sbd_ext.block_attention(
                    q[:, :, :T], k[:, :, :T], v[:, :, :T], kc.clone(), vc.clone(), one(L), one(T), one(T), D**-0.5
                )
                same = [torch.equal(out[:, i], alone[i]) for i in range(T)]
                assert all(same), f"L={L} T={T}: {same.count(False)} rows differ"
    finally:
        torch.set_num_threads(old)


def test_a_set_block_rows_nan_value_never_reaches_a_committed_row(tiles):
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 4, 6, 64, generator=gen).bfloat16() for _ in range(3))
    kc, vc = (torch.randn(1, 2, 40, 64, generator=gen).bfloat16() for _ in range(2))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    clean, ref_clean, _ = _run(q, k, v, kc, vc, [3], [4], [6])
    bad_v = v.clone()
    bad_v[:, :, 4:, 5] = float("nan")
    bad_v[:, :, 5, 9] = float("inf")
    out, ref, paths = _run(q, k, bad_v, kc, vc, [3], [4], [6])
    assert paths == (0, 0, 1)
    assert torch.equal(out[:, :4], clean[:, :4]) and torch.isfinite(out).all()
    assert_close(out, ref.to(out.dtype), dtype=torch.bfloat16)


def test_hardware_and_emulation_agree():
    """The emulated tiles run the same kernel; the hardware rounds a tile row's pairs in its own order (~1e-6)."""
    if MODES != ["emulate", "on"]:
        pytest.skip("needs the AMX-BF16 tiles")
    q, k, v, kc, vc = make_inputs(1, 2, 4, 16, 128, 900, dtype=torch.bfloat16, seed=5)
    outs = []
    try:
        _C.set_cpu_isa("avx512")
        for mode in MODES:
            _C.set_cpu_amx(mode)
            outs.append(_run(q, k, v, kc, vc, [850], [8], [16])[0])
    finally:
        _C.set_cpu_amx("auto")
        _C.set_cpu_isa("")
    assert_close(outs[0].float(), outs[1].float(), atol=2e-2, rtol=2e-2)


def test_when_the_tiles_run():
    """The automatic choice runs bf16 on the tiles exactly where row_linear runs bf16 in tiles
    (build_info()["cpu_bf16_tiles"]); fp32 never; "vector" / "gemm" never; "tiles" raises where they are off; K / V
    rows broadcast (stride 0) fall back."""
    q, k, v, kc, vc = make_inputs(1, 2, 4, 8, 64, 40, dtype=torch.bfloat16)
    L, C, V = lengths([20], "cpu"), lengths([4], "cpu"), lengths([8], "cpu")
    call = lambda q=q, k=k, v=v: sbd_ext.block_attention(q, k, v, kc.clone(), vc.clone(), L, C, V)  # noqa: E731
    auto = sbd_ext.build_info()["cpu_bf16_tiles"] != "model"
    assert (sbd_ext.build_info()["cpu_bf16_attention"] == "tiles") == auto
    assert _paths(call)[1][2] == (1 if auto else 0)
    try:
        _C.set_cpu_isa("avx512")
        _C.set_cpu_amx(MODES[-1])
        for mode, expect in (("vector", 0), ("gemm", 0), ("tiles", 1), ("auto", 1)):
            _C.set_block_attention_matmul(mode)
            assert _paths(call)[1][2] == expect, mode
        _C.set_block_attention_matmul("tiles")
        q32, k32, v32, kc32, vc32 = make_inputs(1, 2, 4, 8, 64, 40)
        _, paths = _paths(lambda: sbd_ext.block_attention(q32, k32, v32, kc32, vc32, L, C, V))
        assert paths[2] == 0, "fp32 never takes the tiles"
        kb = torch.randn(1, 2, 1, 64).bfloat16().expand(1, 2, 8, 64)  # row stride 0
        _, paths = _paths(lambda: sbd_ext.block_attention(q, kb, kb, kc.clone(), vc.clone(), L, C, V))
        assert paths[2] == 0, "rows that are not matrices fall back"
        _C.set_cpu_amx("off")
        assert sbd_ext.build_info()["cpu_bf16_attention"] != "tiles"
        assert _paths(call)[1][2] == 0, "the tiles off: the other paths"
        with pytest.raises(ValueError, match='block_attention matmul "tiles" needs the AMX-BF16 tiles'):
            _C.set_block_attention_matmul("tiles")
    finally:
        _C.set_block_attention_matmul("auto")
        _C.set_cpu_amx("auto")
        _C.set_cpu_isa("")
