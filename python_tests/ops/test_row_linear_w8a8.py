"""row_linear(..., quantize_x=True): int8 x int8 with x quantised per block of 32 at run time (sbd_ext.quantize's
"w8a8"), against sbd_ext.reference.row_linear (float64 over the reference's own quantisation of x)."""

import pytest
import torch
from torch import nn

import sbd_ext
from sbd_ext import reference as R
from sbd_ext.quantization import quantize_weight

EPS32 = 2.0**-24


def _case(M, N, K, seed, device):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    x[:, ::7] *= 30.0  # outlier channels: blocks with very different scales
    q, s = quantize_weight(w)
    return x.to(device), q.to(device), s.to(device)


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
@pytest.mark.parametrize("M", [1, 2, 3, 9, 16, 33, 70])  # 33, 70: slices of 32 rows
@pytest.mark.parametrize("N, K", [(1, 1), (2, 17), (3, 32), (4, 33), (7, 100), (65, 576), (130, 1537), (64, 1536)])
def test_matches_reference(device, cpu_isa, M, N, K):
    x, q, s = _case(M, N, K, seed=M * 10000 + N * 10 + K, device=device)
    _check(sbd_ext.row_linear(x, q, s, quantize_x=True), x, q, s, f"M={M} N={N} K={K}")


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


def test_weight_of_minus_128_is_exact(device, cpu_isa):
    """The kernel multiplies |w| by sign(x, w): a weight of -128 (outside quantize_weight's range, but a valid int8
    argument) is still exact."""
    x, q, s = _case(4, 6, 96, seed=3, device=device)
    q[:, ::5] = -128
    _check(sbd_ext.row_linear(x, q, s, quantize_x=True), x, q, s)


def test_non_finite_and_zero_rows(device, cpu_isa):
    """A NaN or inf in x makes its row NaN (not a silently finite number); an all-zero row gives zeros."""
    x, q, s = _case(5, 9, 80, seed=4, device=device)
    x[1, 3] = float("nan")
    x[2, 70] = float("inf")  # in the shorter last block
    x[3, 40] = float("-inf")  # in a whole block
    x[4] = 0.0
    y = sbd_ext.row_linear(x, q, s, quantize_x=True).cpu()
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
    w = layer.weight_int8.float() * layer.weight_scale[:, None]
    for shape in ((3, 70), (2, 40, 70)):
        x = torch.randn(*shape)
        want = torch.nn.functional.linear(R.quantized_x(x), w, layer.bias)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x.clone().requires_grad_(True)), want, rtol=1e-5, atol=1e-5)
