"""screened_head (a greedy decoder's output head over a bf16 screen): each row's largest entry where the exact head's
is (the float64 reference's, and row_linear's bit for bit at that column), every other entry below it and within the
bound; near ties, banned ids, non-finite values and a flat screen; its checks; and greedy decoding on a packed
model with and without the screen."""

import copy

import pytest
import torch
from sbd_models import tiny_llama

import sbd_ext
from sbd_ext import _C
from sbd_ext import reference as R
from sbd_ext.greedy_head import greedy_head
from sbd_ext.ops import row_linear, screened_head
from sbd_ext.packing import pack_row_linear_weight, pack_screened_head


def _head(N, K, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * scale / K**0.5
    return w, pack_row_linear_weight(w, pad=True), *pack_screened_head(w)


def _bound(x, w, pairs=False):
    """The op's bound on |screen - exact| per entry (csrc/cpu/screened_head_cpu.cpp), from the float64 norms; with
    ``pairs`` that of bf16 products (x rounded to bf16 too; what the instruction flushes to zero as well)."""
    K = x.shape[1]
    ku = K * 2.0**-24
    factor = (2.0**-7 + 2.0**-16 if pairs else 2.0**-8) + 3 * ku / (1 - ku)
    xn, wn = x.double().norm(dim=1)[:, None], w.double().norm(dim=1)[None, :]
    flushed = 2.0**-126 * (1.01 * K**0.5 * (xn + wn) + 3 * K) if pairs else 0.0
    return factor * xn * wn + flushed


def _pairs_stat():
    return _C.screened_head_stats()[4]


def _check(x, w, wp, sp, sn, exclude=-1):
    N = w.shape[0]
    before = _pairs_stat()
    got = screened_head(x, wp, sp, sn, exclude)
    pairs = _pairs_stat() > before
    assert got.shape == (x.shape[0], wp.shape[0] * 16) and got.dtype == torch.float32
    got = got[:, :N]
    exact = row_linear(x, wp)[:, :N]
    ref = x.double() @ w.double().t()
    for ban in [-1] if exclude < 0 else [-1, exclude]:
        g, e = got.clone(), exact.clone()
        if ban >= 0:
            g[:, ban] = e[:, ban] = float("-inf")
        top = g.argmax(1)
        assert torch.equal(top, e.argmax(1))  # the kernel's exact head's choice, ties to the lower index
        rows = torch.arange(x.shape[0])
        assert torch.equal(g[rows, top], e[rows, top])  # its value bit for bit
        # and the float64 reference's choice wherever its top two are further apart than the fp32 sums' error
        r = ref.clone()
        if ban >= 0:
            r[:, ban] = float("-inf")
        two = r.topk(2, dim=1).values
        clear = (two[:, 0] - two[:, 1]) > 1e-4 * ref.abs().amax(1)
        assert torch.equal(top[clear], r.argmax(1)[clear])
        assert bool((g <= g[rows, top][:, None]).all())
    assert bool(((got.double() - ref).abs() <= _bound(x, w, pairs) + 1e-5 * ref.abs() + 1e-30).all())
    return got, exact


def _pairs_usable(M):
    """Whether a call of M rows screens with bf16 products here (the AVX-512 variant on a CPU with AVX512-BF16,
    from two rows; from one on an AMD Zen 4)."""
    info = sbd_ext.build_info()
    if not (info["cpu_avx512_bf16"] and info["cpu_isa"] == "avx512"):
        assert info["cpu_screen_pairs_rows"] == 0
        return False
    assert info["cpu_screen_pairs_rows"] == (1 if info["cpu_core"] == "zen4" else 2)
    return M >= info["cpu_screen_pairs_rows"]


@pytest.mark.parametrize("M", [1, 2, 6, 16, 33])
@pytest.mark.parametrize("N, K", [(16, 1), (37, 9), (1000, 64), (4099, 576)])
def test_choice_is_the_exact_heads(cpu_isa, M, N, K):
    w, wp, sp, sn = _head(N, K, seed=M * 7 + N)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(N + K)) * 3
    _check(x, w, wp, sp, sn)
    _check(x, w, wp, sp, sn, exclude=N // 3)


@pytest.mark.parametrize("M", [1, 2, 5, 6, 7, 13])
@pytest.mark.parametrize("N, K", [(48, 1), (37, 9), (1000, 64), (4099, 576)])
def test_bf16_products_screen(cpu_isa, M, N, K):
    """Several rows screen with bf16 products where the CPU has them: each entry is the fp32 head's (a candidate's
    panel) or the fp32 sum of x and the head both rounded to bf16 (the float64 model's, within its summation's
    error); the same choices as the widened fp32 products (set_screen_pairs(False)), which run everywhere else."""
    w, wp, sp, sn = _head(N, K, seed=M * 11 + N)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K + M)) * 3
    before = list(_C.screened_head_stats())
    got, exact = _check(x, w, wp, sp, sn)
    _, _, _, whole, pairs = (b - a for a, b in zip(before, _C.screened_head_stats(), strict=True))
    assert pairs == _pairs_usable(M)
    model = x.bfloat16().double() @ w.bfloat16().double().t()
    gamma = K * 2.0**-24 / (1 - K * 2.0**-24)
    err = gamma * (x.bfloat16().double().abs() @ w.bfloat16().double().abs().t()) + 1e-30
    screened = (got.double() - model).abs() <= err
    if _pairs_usable(M):
        assert bool((screened | (got == exact)).all())
        assert bool(screened.any()) or whole  # the screen's own values where the fp32 head did not run whole
    prev = _C.set_screen_pairs(False)
    try:
        before = _pairs_stat()
        off, _ = _check(x, w, wp, sp, sn)
        assert _pairs_stat() == before
    finally:
        _C.set_screen_pairs(prev)
    assert torch.equal(off.argmax(1), got.argmax(1))


def test_bf16_products_screen_underflow_and_overflow(cpu_isa):
    """x below bf16's normal range (flushed to zero by the bf16 products: the absolute term of the bound) and x that
    rounds past bf16's largest value: the exact head's choice all the same."""
    w, wp, sp, sn = _head(2048, 64, seed=12)
    g = torch.Generator().manual_seed(13)
    for x in (torch.randn(4, 64, generator=g) * 1e-39, torch.randn(4, 64, generator=g) * 3e-38):
        _check(x, w, wp, sp, sn)
    x = w[[3, 70, 900]] * 40
    x[1, 5] = torch.finfo(torch.float32).max  # rounds to bf16's infinity: the row's screen is not finite
    before = _C.screened_head_stats()[3]
    got = screened_head(x.contiguous(), wp, sp, sn)
    assert torch.equal(got.nan_to_num().argmax(1), row_linear(x.contiguous(), wp).nan_to_num().argmax(1))
    if _pairs_usable(3):
        assert _C.screened_head_stats()[3] == before + 1  # the fp32 head whole


def test_peaked_rows_compute_few_panels_again():
    """Rows with a clear winner (a decoder's usual case) run one or two fp32 panels again, not the head."""
    w, wp, sp, sn = _head(4096, 256, seed=3)
    x = (w[[5, 900, 2100, 4000]] * 40).contiguous()  # each row points at a head row
    before = list(_C.screened_head_stats())
    got, _ = _check(x, w, wp, sp, sn)
    calls, rows, panels, whole, _ = (b - a for a, b in zip(before, _C.screened_head_stats(), strict=True))
    assert (calls, rows, whole) == (1, 4, 0) and 1 <= panels <= 8
    assert got.argmax(1).tolist() == [5, 900, 2100, 4000]
    assert not torch.equal(got, row_linear(x, wp)[:, :4096])  # the screen's values elsewhere


def test_near_ties_the_screen_cannot_separate():
    """Head rows that differ below bf16's resolution: the same bf16 row, so only the fp32 values decide."""
    w, _, _, _ = _head(512, 128, seed=4)
    w[200] = w[100] * (1 + 2.0**-14)
    w[300] = w[100] * (1 - 2.0**-14)
    w[201] = w[100].clone()  # an exact tie with row 100: the lower index wins
    wp, (sp, sn) = pack_row_linear_weight(w, pad=True), pack_screened_head(w)
    x = (w[100] * 30).view(1, -1).contiguous()
    got, exact = _check(x, w, wp, sp, sn)
    assert int(got.argmax()) == int(exact.argmax()) == 200
    x = -x  # the smallest become the largest
    _check(x, w, wp, sp, sn)
    _check(x, w, wp, sp, sn, exclude=300)


def test_excluded_id_is_left_out_of_the_screen():
    """A banned id (the mask token) that would be the largest: the largest of the others is exact all the same."""
    w, wp, sp, sn = _head(777, 48, seed=5)
    x = (w[42] * 50).view(1, -1).contiguous()
    got, exact = _check(x, w, wp, sp, sn, exclude=42)
    assert int(got.argmax()) == 42 and got[0, 42] == exact[0, 42]


def test_non_finite_and_flat_rows_run_the_fp32_head_whole():
    w, wp, sp, sn = _head(300, 32, seed=6)
    cases = {"nan x": torch.randn(3, 32), "inf x": torch.randn(3, 32), "flat": torch.zeros(3, 32)}
    cases["nan x"][1, 4] = float("nan")
    cases["inf x"][2, 0] = float("inf")
    for name, x in cases.items():
        before = _C.screened_head_stats()[3]
        got = screened_head(x, wp, sp, sn)
        assert _C.screened_head_stats()[3] == before + 1, name
        assert torch.equal(got.nan_to_num(), row_linear(x, wp).nan_to_num()), name
    w2 = w.clone()
    w2[7, 3] = float("inf")  # a non-finite head row: its norm is inf
    wp2, (sp2, sn2) = pack_row_linear_weight(w2, pad=True), pack_screened_head(w2)
    x = torch.randn(2, 32)
    assert torch.equal(screened_head(x, wp2, sp2, sn2).nan_to_num(), row_linear(x, wp2).nan_to_num())


def test_reference_and_pack_screened_head():
    w, wp, sp, sn = _head(40, 24, seed=7)
    assert sp.dtype == torch.bfloat16 and sp.shape == wp.shape == (3, 24, 16) and sn.shape == (40,)
    assert torch.equal(sp, pack_row_linear_weight(w.bfloat16(), pad=True))
    assert bool((sn.double() >= w.double().norm(dim=1)).all())  # rounded up
    assert bool((sn.double() <= w.double().norm(dim=1) * (1 + 2.0**-23)).all())
    x = torch.randn(2, 24)
    ref = R.screened_head(x, wp, sp, sn)
    assert torch.equal(screened_head(x, wp, sp, sn)[:, :40].argmax(1), ref[:, :40].argmax(1))
    with pytest.raises(TypeError, match="pack_screened_head"):
        pack_screened_head(w.bfloat16())


def test_bad_inputs():
    w, wp, sp, sn = _head(40, 24, seed=8)
    x = torch.randn(2, 24)
    bad = [
        ((x.double(), wp, sp, sn), TypeError, "x must have dtype"),
        ((x, wp.bfloat16(), sp, sn), TypeError, "weight must have dtype"),
        ((x, wp, sp.float(), sn), TypeError, "screen must have dtype"),
        ((x, wp, sp, sn.double()), TypeError, "screen_norm must have dtype"),
        ((x[:, :20], wp, sp, sn), ValueError, r"weight.size\(1\) must equal x.size\(1\)"),
        ((x, wp, sp[:2], sn), ValueError, "screen.size"),
        ((x, wp, sp, sn[:30]), ValueError, "one entry per real row"),
        ((x, wp, sp, torch.ones(49)), ValueError, "one entry per real row"),
        ((x.view(2, 1, 24), wp, sp, sn), ValueError, "x must be 2-D"),
        ((x, wp[:, :, :8].contiguous(), sp, sn), ValueError, "16"),
        ((x, wp.transpose(0, 1), sp, sn), ValueError, "contiguous|must equal"),
    ]
    for args, err, msg in bad:
        with pytest.raises(err, match=msg):
            screened_head(*args)
    for ex in (-2, 40, 10**12):
        with pytest.raises(ValueError, match="exclude must be -1"):
            screened_head(x, wp, sp, sn, ex)
    with pytest.raises(TypeError, match="exclude must be an integer"):
        screened_head(x, wp, sp, sn, 1.5)
    with pytest.raises(RuntimeError, match="is on meta but x is on cpu"):
        screened_head(x, wp, sp, sn.to("meta"))
    with pytest.raises(RuntimeError, match="has no backward"):
        screened_head(x.requires_grad_(), wp, sp, sn)


def test_fake_kernel_shapes_and_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.sbd_ext.screened_head
    with FakeTensorMode():
        x, wp, sp, sn = (
            torch.empty(3, 24),
            torch.empty(3, 24, 16),
            torch.empty(3, 24, 16, dtype=torch.bfloat16),
            torch.empty(40),
        )
        assert op(x, wp, sp, sn, -1).shape == (3, 48)
        with pytest.raises(ValueError, match="one entry per real row"):
            op(x, wp, sp, torch.empty(20), -1)
        with pytest.raises(TypeError, match="screen must have dtype"):
            op(x, wp, sp.float(), sn, -1)


# ---- a packed model's head ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [True, False])
def test_quantize_packed_gives_the_head_a_screen(tie):
    model = sbd_ext.quantize(tiny_llama(tie=tie), "packed")
    head = model.get_output_embeddings()
    assert head.screen_packed.dtype == torch.bfloat16 and head.screen_packed.shape == head.weight_packed.shape
    assert torch.equal(head.screen_norm, pack_screened_head(head.weight)[1])
    assert not any("screen" in k for k in model.state_dict())  # derived buffers: no checkpoint keys
    others = [m for m in model.modules() if isinstance(m, sbd_ext.quantization.PackedLinear) and m is not head]
    assert others and not any("screen_packed" in m._buffers for m in others)
    assert "screen_packed" not in sbd_ext.quantize(tiny_llama(tie=tie), "packed", screen_head=False).lm_head._buffers
    sbd_ext.quantize(model, "int8")  # a rounded scheme drops it
    assert "screen_packed" not in model.get_output_embeddings()._buffers


def test_head_forward_screens_only_inside_greedy_head():
    model = sbd_ext.quantize(tiny_llama(), "packed")
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model(ids).logits
        before = _C.screened_head_stats()[0]
        with greedy_head(-1):
            screened = model(ids).logits
        assert _C.screened_head_stats()[0] == before + 1
        assert torch.equal(model(ids).logits, exact)  # outside the block: the exact head again
    assert torch.equal(screened.argmax(-1), exact.argmax(-1))


def test_tied_head_screen_follows_the_embedding():
    model = sbd_ext.quantize(tiny_llama(tie=True), "packed")
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        emb[3].mul_(4.0)
        model(torch.tensor([[1, 2]]))  # the next eager forward re-packs the copy and its screen
    assert torch.equal(model.lm_head.screen_norm, pack_screened_head(emb)[1])


@pytest.mark.parametrize("compile_", [False, True])
@pytest.mark.parametrize("mode", ["ntp", "verify"])
def test_greedy_decoding_is_the_same_with_and_without_the_screen(mode, compile_):
    """The same tokens as the packed model without a screen (and as the fp32 model, tests of "packed"); greedy
    decoding screens every forward, sampled decoding none."""
    fp32 = tiny_llama()
    on = sbd_ext.quantize(copy.deepcopy(fp32), "packed")
    off = sbd_ext.quantize(copy.deepcopy(fp32), "packed", screen_head=False)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=12, compile=compile_, block_size=4)
    kw |= dict(mode="ntp") if mode == "ntp" else dict(mode="sbd", verify=True)
    before = _C.screened_head_stats()[0]
    a = sbd_ext.generate(on, ids, **kw)
    assert _C.screened_head_stats()[0] > before
    b = sbd_ext.generate(off, ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    before = _C.screened_head_stats()[0]
    sbd_ext.generate(on, ids, **(kw | dict(temperature=0.7, seed=3)))
    assert _C.screened_head_stats()[0] == before
