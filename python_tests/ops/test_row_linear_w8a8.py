"""row_linear(..., quantize_x=True): int8 x int8 with x quantised per block of 32 at run time (sbd_ext.quantize's
"w8a8"), against sbd_ext.reference.row_linear (float64 over the reference's own quantisation of x)."""

import pytest
import torch
from torch import nn

import sbd_ext
from sbd_ext import reference as R
from sbd_ext.packing import pack_row_linear_int8, unpack_row_linear_int8
from sbd_ext.quantization import quantize_weight

EPS32 = 2.0**-24


def _case(M, N, K, seed, device):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    x[:, ::7] *= 30.0  # outlier channels: blocks with very different scales
    q, s = quantize_weight(w)
    return x.to(device), q.to(device), s.to(device)


def _w8a8(x, q, s, layout):
    """row_linear(x, q, s, quantize_x=True) on the int8 weight [N, K] ("rows") or on its packed int8 layout
    ("packed": pack_row_linear_int8, N padded to whole panels with scale 1, the padding's outputs sliced off)."""
    if layout == "rows":
        return sbd_ext.row_linear(x, q, s, quantize_x=True)
    n = q.shape[0]
    qp = pack_row_linear_int8(q.cpu(), pad=True).to(x.device)
    sp = torch.nn.functional.pad(s, (0, qp.shape[0] * 16 - n), value=1.0)
    return sbd_ext.row_linear(x, qp, sp, quantize_x=True)[:, :n]


LAYOUTS = ["rows", "packed"]


def _check(y, x, q, s, msg=""):
    """|y - ref| within the fp32 error of summing the blocks' exact integer dot products times their scales: the
    kernel's x quantisation must equal the reference's value for value (one step off would exceed it)."""
    x, q, s = x.cpu(), q.cpu(), s.cpu()
    ref = R.row_linear(x, q, s, quantize_x=True).double()
    nb = -(-x.shape[1] // 32)
    mag = R.quantized_x(x).double().abs() @ q.double().abs().t()
    bound = mag * s.double().abs() * (nb + 12) * EPS32 + 1e-30
    err = (y.cpu().double() - ref).abs()
    assert y.shape == ref.shape and y.dtype == torch.float32, msg
    assert bool((err <= bound).all()), f"{msg}: max err {err.max().item():.3g}, worst {(err / bound).max():.3g}"


# K: whole blocks (32, 576, 1536), a shorter last block (17, 33, 100, 1537); M: the 2-row tile's edge; N: the
# 3-row weight tile's and the 64-row chunk's edges.
# packed: tiles of up to 12 rows (13 = 7 + 6, 25 = 9 + 8 + 8), N padded to whole panels of 16.
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("M", [1, 2, 3, 9, 13, 16, 25, 33, 70])  # 33, 70: slices of 32 rows
@pytest.mark.parametrize("N, K", [(1, 1), (2, 17), (3, 32), (4, 33), (7, 100), (65, 576), (130, 1537), (64, 1536)])
def test_matches_reference(device, cpu_isa, layout, M, N, K):
    x, q, s = _case(M, N, K, seed=M * 10000 + N * 10 + K, device=device)
    _check(_w8a8(x, q, s, layout), x, q, s, f"{layout} M={M} N={N} K={K}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scratch_kept_between_calls(cpu_isa, layout):
    """The quantised x lives in the calling thread's scratch between calls (a buffer over 4 MB is the call's own):
    calls of growing, shrinking and oversized shapes in turn each match the reference."""
    for i, (M, N, K) in enumerate(
        [(1, 65, 576), (70, 130, 1537), (1, 64, 1536), (2900, 4, 1537), (3, 7, 100), (1, 65, 576)]
    ):
        x, q, s = _case(M, N, K, seed=100 + i, device="cpu")
        _check(_w8a8(x, q, s, layout), x, q, s, f"call {i}: {layout} M={M} N={N} K={K}")


def test_pack_int8_layout_and_round_trip():
    """packed[n // 16, k // 4, n % 16, k % 4] == q[n, k] + 128; K padded to blocks of 32 (with 128, a zero weight), N
    with pad=True to panels of 16; unpack inverts it."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (35, 70), generator=g, dtype=torch.int8)
    p = pack_row_linear_int8(q, pad=True)
    assert p.dtype == torch.uint8 and p.shape == (3, 24, 16, 4) and p.is_contiguous()
    for n, k in ((0, 0), (17, 5), (34, 69), (20, 33)):
        assert int(p[n // 16, k // 4, n % 16, k % 4]) == int(q[n, k]) + 128
    assert int(p[2, 20, 15, 3]) == 128 and bool((p[:, 18:] == 128).all())  # padding: zero weights
    assert torch.equal(unpack_row_linear_int8(p, 35, 70), q)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        pack_row_linear_int8(q)
    with pytest.raises(TypeError, match="must be int8"):
        pack_row_linear_int8(q.float())


def test_quantisation_of_x():
    """The reference's quantisation: |q| <= 127 with 127 at each block's max, an all-zero block is 0 with scale 0,
    and q * d (quantized_x) is within half a step of x."""
    x = torch.randn(3, 70) * 5
    x[1, 32:64] = 0.0
    q, d = R.quantize_x_blocks(x)
    assert q.shape == x.shape and d.shape == (3, 3)
    assert float(q.abs().max()) == 127.0 and d[1, 1] == 0.0 and not bool(q[1, 32:64].any())
    step = d.repeat_interleave(32, 1)[:, :70]
    deq = R.quantized_x(x)
    assert torch.equal(deq, q * step)  # quantized_x: q times its block's d, x's shape
    assert bool(((deq - x).abs() <= step / 2 * (1 + 1e-5) + 1e-30).all())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_of_minus_128_is_exact(device, cpu_isa, layout):
    """The kernel multiplies |w| by sign(x, w) (packed: w + 128 = 0 unsigned): a weight of -128 (outside
    quantize_weight's range, but a valid int8 argument) is still exact."""
    x, q, s = _case(4, 6, 96, seed=3, device=device)
    q[:, ::5] = -128
    _check(_w8a8(x, q, s, layout), x, q, s)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_finite_and_zero_rows(device, cpu_isa, layout):
    """A NaN or inf in x makes its row NaN (not a silently finite number); an all-zero row gives zeros."""
    x, q, s = _case(5, 9, 80, seed=4, device=device)
    x[1, 3] = float("nan")
    x[2, 70] = float("inf")  # in the shorter last block
    x[3, 40] = float("-inf")  # in a whole block
    x[4] = 0.0
    y = _w8a8(x, q, s, layout).cpu()
    assert bool(y[1:4].isnan().all()) and bool(y[0].isfinite().all()) and not bool(y[4].any())
    assert torch.equal(y.isnan(), R.row_linear(x.cpu(), q.cpu(), s.cpu(), quantize_x=True).isnan())


@pytest.mark.parametrize("M", [9, 141])  # 141: 71 strided rows, three slices of 32 (a prefill)
def test_strided_rows_and_thread_count(device, M):
    x, q, s = _case(M, 70, 100, seed=5, device=device)
    xs = x[::2, 3:60]
    qs, ss = q[1::3, 3:60], s[1::3].contiguous()
    _check(sbd_ext.row_linear(xs, qs, ss, quantize_x=True), xs, qs, ss)
    if device.type == "cpu":
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = sbd_ext.row_linear(x, q, s, quantize_x=True)
            torch.set_num_threads(2)
            assert torch.equal(one, sbd_ext.row_linear(x, q, s, quantize_x=True))
        finally:
            torch.set_num_threads(before)


def test_packed_strided_rows_and_thread_count():
    x, q, s = _case(141, 208, 100, seed=8, device="cpu")
    xs = x[::2, 3:60]  # 71 strided rows: slices of 32
    qs = q[:, 3:60].contiguous()
    _check(_w8a8(xs, qs, s, "packed"), xs, qs, s)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _w8a8(x, q, s, "packed")
        torch.set_num_threads(2)
        assert torch.equal(one, _w8a8(x, q, s, "packed"))
    finally:
        torch.set_num_threads(before)


def test_close_to_the_weight_only_product():
    """int8 x costs a little accuracy: SmolLM2-like shapes stay within 2 % of the weight-only int8 result."""
    x, q, s = _case(16, 576, 1536, seed=6, device="cpu")
    a, b = sbd_ext.row_linear(x, q, s, quantize_x=True), sbd_ext.row_linear(x, q, s)
    assert float((a - b).norm() / b.norm()) < 0.02


def test_bad_inputs(device):
    """quantize_x needs the int8 weight: refused by the wrapper, the binding (on every device) and the fake kernel."""
    x, q, s = _case(4, 6, 8, seed=2, device=device)
    w = q.float()
    for call in (sbd_ext.row_linear, torch.ops.sbd_ext.row_linear):
        with pytest.raises(ValueError, match="quantize_x=True multiplies int8 x with an int8 weight"):
            call(x, w, None, True)
    with pytest.raises(TypeError, match="quantize_x must be a bool"):
        sbd_ext.row_linear(x, q, s, quantize_x=1)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fx, fw = torch.empty(4, 8), torch.empty(6, 8)
        with pytest.raises(ValueError, match="quantize_x=True multiplies int8 x with an int8 weight"):
            torch.ops.sbd_ext.row_linear(fx, fw, None, True)
        fq, fs = torch.empty(6, 8, dtype=torch.int8), torch.empty(6)
        assert torch.ops.sbd_ext.row_linear(fx, fq, fs, True).shape == (4, 6)


def test_packed_bad_inputs(device):
    """A packed int8 weight: refused without quantize_x, with a K that does not match, a scale of N rows that is
    not 16 * panels, non-contiguous, another rank; by the binding (every device) and the fake kernel."""
    x, q, s = _case(4, 32, 40, seed=2, device=device)
    qp = pack_row_linear_int8(q.cpu()).to(device)
    op = torch.ops.sbd_ext.row_linear
    cases = [
        ((x, qp, s, False), "a packed int8 weight .* multiplies int8 x: pass quantize_x=True"),
        ((x[:, :31], qp, s, True), r"weight.size\(1\) must equal ceil\(x.size\(1\) / 32\) \* 8"),
        ((x, qp, s[:16], True), r"scale.size\(0\) must equal 16 \* weight.size\(0\) \(N\) = 32"),
        ((x, qp, None, True), "an int8 weight needs scale"),
        ((x, qp[0], s, True), "weight must be 4-D"),
        ((x, qp.transpose(0, 1).contiguous().transpose(0, 1), s, True), "a packed int8 weight must be contiguous"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            op(*args)
        if "contiguous" not in match:  # strides: the binding's check (a fake tensor keeps them, the fake skips it)
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match=match):
                fa = [torch.empty_like(a, device="meta") if isinstance(a, torch.Tensor) else a for a in args]
                op(*fa)
    with torch.device("meta"):
        assert op(torch.empty(4, 40), torch.empty(2, 16, 16, 4, dtype=torch.uint8), torch.empty(32), True).shape == (
            4,
            32,
        )


def test_no_backward():
    x, q, s = _case(2, 3, 40, seed=7, device="cpu")
    x.requires_grad_(True)
    with pytest.raises(RuntimeError, match="has no backward, but x require"):
        torch.ops.sbd_ext.row_linear(x, q, s, True)


def test_w8a8_linear_paths_agree():
    """Int8Linear with quantize_x: the kernel (one call, several calls) and the F.linear fallback (autograd) both
    compute F.linear on x as the reference quantises it."""
    torch.manual_seed(1)
    layer = nn.Linear(70, 10)
    sbd_ext.quantize(layer, "w8a8")
    w = layer.int8_weight().float() * layer.weight_scale[:, None]
    for shape in ((3, 70), (2, 40, 70)):
        x = torch.randn(*shape)
        want = torch.nn.functional.linear(R.quantized_x(x), w, layer.bias)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x.clone().requires_grad_(True)), want, rtol=1e-5, atol=1e-5)
