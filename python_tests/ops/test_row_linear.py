"""row_linear against sbd_ext.reference.row_linear (float64), its contract, and RowLinear in a model."""

import pytest
import torch
from sbd_models import tiny_llama
from torch import nn
from utils import assert_close

import sbd_ext
from sbd_ext import reference as R
from sbd_ext.linear import ROW_LIMIT, RowLinear, ensure_row_linear, use_row_linear
from sbd_ext.packing import pack_row_linear_weight, unpack_row_linear_weight

EPS32 = 2.0**-24


def _case(M, N, K, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g).to(device), torch.randn(N, K, generator=g).to(device)


def _check(y, x, w, msg=""):
    """|y - x @ w^T| within the fp32 summation error bound K * eps * (|x| @ |w|^T) (+ one rounding of the result)."""
    ref = R.row_linear(x.cpu(), w.cpu()).double()
    bound = (x.cpu().double().abs() @ w.cpu().double().abs().t()) * (x.shape[1] + 2) * EPS32 + 1e-30
    err = (y.cpu().double() - ref).abs()
    assert y.shape == ref.shape and y.dtype == torch.float32, msg
    assert bool((err <= bound).all()), (
        f"{msg}: max err {err.max().item():.3g}, worst err/bound {(err / bound).max():.3g}"
    )


# M: 1 row (NTP), tile edges (kMr = 4) and a decoding forward's 8 / 16 / 17 rows; N: weight-tile edges (kNr = 3)
# and chunk edges (64); K: vector tails (8 lanes on AVX2) and SmolLM2's 576 / 1536.
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 16, 17, 32, 33, 70])  # past 32 rows: the framework's GEMM
@pytest.mark.parametrize("N, K", [(1, 1), (2, 7), (3, 8), (4, 9), (5, 17), (64, 576), (65, 576), (130, 1537)])
def test_matches_reference(device, cpu_isa, M, N, K):
    x, w = _case(M, N, K, seed=M * 10000 + N * 10 + K, device=device)
    _check(sbd_ext.row_linear(x, w), x, w, f"M={M} N={N} K={K}")


def test_output_head_shape(device, cpu_isa):
    """SmolLM2's output head (49153 rows after the mask row) for a 17-row verify forward."""
    x, w = _case(17, 49153, 576, seed=3, device=device)
    _check(sbd_ext.row_linear(x, w), x, w)


def test_strided_rows(device, cpu_isa):
    """Rows of x and of the weight may be strided (slices of wider tensors); only K must be contiguous."""
    xb, wb = _case(9, 70, 100, seed=5, device=device)
    x, w = xb[::2, 3:60], wb[1::3, 3:60]
    _check(sbd_ext.row_linear(x, w), x, w)
    x0 = xb[:1, :57].expand(6, 57)  # stride-0 rows (read-only input)
    _check(sbd_ext.row_linear(x0, w), x0, w)


@pytest.mark.parametrize("packed", [False, True])
def test_independent_of_thread_count(packed):
    x, w = _case(16, 1024, 576, seed=7, device="cpu")
    w = pack_row_linear_weight(w) if packed else w
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sbd_ext.row_linear(x, w)
        torch.set_num_threads(2)
        two = sbd_ext.row_linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("M, N, K", [(0, 5, 3), (4, 0, 3), (4, 5, 0)])
def test_empty(device, M, N, K):
    x, w = _case(M, N, K, seed=1, device=device)
    y = sbd_ext.row_linear(x, w)
    assert y.shape == (M, N) and bool((y == 0).all())


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda x, w: (x.double(), w), "x must have dtype Float"),
        (lambda x, w: (x, w.half()), "weight must have dtype Float"),
        (lambda x, w: (x.long(), w), "x must have dtype Float"),
        (lambda x, w: (x[0], w), "x must be 2-D"),
        (lambda x, w: (x, w.unsqueeze(0)), "weight must be 2-D"),
        (lambda x, w: (x, w[:, :-1]), r"weight.size\(1\) must equal x.size\(1\)"),
        (lambda x, w: (x.t().contiguous().t(), w), "x must be contiguous in its last dimension"),
        (lambda x, w: (x, w.t().contiguous().t()), "weight must be contiguous in its last dimension"),
        (lambda x, w: (x, None), "weight must be a torch.Tensor"),
        (lambda x, w: (x, w.to("meta")), "weight is on meta"),
    ],
)
def test_bad_inputs(device, change, match):
    x, w = _case(4, 6, 8, seed=2, device=device)
    x, w = change(x, w)
    with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
        sbd_ext.row_linear(x, w)


def test_bad_inputs_past_the_wrapper(device):
    """torch.ops.sbd_ext.row_linear directly (no Python checks): the binding's own checks."""
    x, w = _case(4, 6, 8, seed=2, device=device)
    with pytest.raises(TypeError, match="x must be a tensor, got None"):
        torch.ops.sbd_ext.row_linear(None, w)
    with pytest.raises(TypeError, match="weight must have dtype Float"):
        torch.ops.sbd_ext.row_linear(x, w.half())
    with pytest.raises(ValueError, match=r"weight.size\(1\) must equal"):
        torch.ops.sbd_ext.row_linear(x, w[:, :5])


def test_output_size_overflow(device):
    """An expanded x / weight whose M * N does not fit in int64 is refused before any allocation."""
    x = torch.zeros(1, 4, device=device).expand(2**40, 4)
    w = torch.zeros(1, 4, device=device).expand(2**30, 4)
    with pytest.raises(ValueError, match="overflows int64"):
        sbd_ext.row_linear(x, w)


def test_no_backward():
    x, w = _case(2, 3, 4, seed=4, device="cpu")
    w.requires_grad_(True)
    with pytest.raises(RuntimeError, match="has no backward"):
        sbd_ext.row_linear(x, w)
    with torch.no_grad():
        _check(sbd_ext.row_linear(x, w), x, w.detach())


@pytest.mark.parametrize("which", ["x", "weight", "x, weight"])
def test_no_backward_past_the_wrapper(which):
    """torch.ops.sbd_ext.row_linear directly: an input requiring grad is refused (issue 35, item 9), not an output
    that requires grad and a backward that leaves x.grad None; without grad mode it computes."""
    x, w = _case(3, 5, 4, seed=6, device="cpu")
    x.requires_grad_("x" in which.split(", "))
    w.requires_grad_("weight" in which.split(", "))
    with pytest.raises(RuntimeError, match=rf"row_linear has no backward, but {which} require\(s\) grad"):
        torch.ops.sbd_ext.row_linear(x, w)
    with torch.no_grad():
        y = torch.ops.sbd_ext.row_linear(x, w)
    assert not y.requires_grad
    _check(y, x.detach(), w.detach())
    with torch.inference_mode():
        _check(torch.ops.sbd_ext.row_linear(x, w), x.detach(), w.detach())


def test_fake_kernel_checks_what_the_binding_checks():
    """The fake (and Meta) kernel refuses what the CPU binding refuses instead of returning a shape (item 9)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.sbd_ext.row_linear
    with FakeTensorMode():
        x, w = torch.empty(4, 64), torch.empty(5, 64)
        assert op(x, w).shape == (4, 5) and op(x, w).dtype == torch.float32
        with pytest.raises(ValueError, match=r"weight.size\(1\) must equal x.size\(1\) \(K\) = 64"):
            op(x, torch.empty(5, 63))
        with pytest.raises(TypeError, match="weight must have dtype Float"):
            op(x, torch.empty(5, 64, dtype=torch.float64))
        with pytest.raises(ValueError, match="x must be 2-D"):
            op(torch.empty(2, 4, 64), w)
    meta = torch.empty(4, 64, device="meta")
    assert op(meta, torch.empty(5, 64, device="meta")).shape == (4, 5)
    with pytest.raises(RuntimeError, match="weight is on cpu but x is on meta"):
        op(meta, torch.empty(5, 64))
    with pytest.raises(ValueError, match=r"weight.size\(1\) must equal"):
        op(meta, torch.empty(5, 63, device="meta"))


# ---- int8 weights (weight-only quantisation) ------------------------------------------------------------------
def _case_int8(M, N, K, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scale = torch.rand(N, generator=g) * 0.02 + 1e-3
    return x.to(device), q.to(device), scale.to(device)


def _check_int8(y, x, q, scale, msg=""):
    """|y - (x @ q^T) * scale| within K * eps * (|x| @ |q|^T) * scale (+ the scale's rounding), float64 reference."""
    x, q, scale = x.cpu(), q.cpu(), scale.cpu()
    ref = R.row_linear(x, q, scale).double()
    exact = (x.double() @ q.double().t()) * scale.double()
    bound = (x.double().abs() @ q.double().abs().t()) * scale.double() * (x.shape[1] + 3) * EPS32 + 1e-30
    assert y.shape == ref.shape and y.dtype == torch.float32, msg
    err = (y.cpu().double() - exact).abs()
    assert bool((err <= bound).all()), f"{msg}: max err {err.max().item():.3g}, worst {(err / bound).max():.3g}"
    assert bool(((ref.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 16, 17, 33, 70])  # 33, 70: slices of 32 rows (a prefill)
@pytest.mark.parametrize("N, K", [(1, 1), (2, 7), (3, 8), (4, 9), (5, 17), (7, 31), (65, 576), (130, 1537)])
def test_int8_matches_reference(device, cpu_isa, M, N, K):
    """K: the int8 vector tails (8 lanes on AVX2, 16 on AVX-512); N: weight tile and chunk edges."""
    x, q, s = _case_int8(M, N, K, seed=M * 10000 + N * 10 + K, device=device)
    _check_int8(sbd_ext.row_linear(x, q, s), x, q, s, f"M={M} N={N} K={K}")


def test_int8_equals_the_dequantised_fp32_product(device):
    """The int8 path computes what an fp32 weight q * scale would give, to fp32 rounding (SmolLM2's head shape)."""
    x, q, s = _case_int8(5, 4099, 576, seed=11, device=device)
    _check_int8(sbd_ext.row_linear(x, q, s), x, q, s)
    _check_int8(sbd_ext.row_linear(x, (q.float() * s[:, None]).contiguous()), x, q, s)


@pytest.mark.parametrize("M", [9, 141])  # 141: 71 strided rows, three slices of 32 (a prefill)
def test_int8_strided_rows_and_thread_count(device, M):
    x, q, s = _case_int8(M, 70, 100, seed=5, device=device)
    xs, qs = x[::2, 3:60], q[1::3, 3:60]
    ss = s[1::3].contiguous()
    _check_int8(sbd_ext.row_linear(xs, qs, ss), xs, qs, ss)
    if device == "cpu":
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = sbd_ext.row_linear(x, q, s)
            torch.set_num_threads(2)
            assert torch.equal(one, sbd_ext.row_linear(x, q, s))
        finally:
            torch.set_num_threads(before)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda x, q, s: (x, q, None), "an int8 weight needs scale"),
        (lambda x, q, s: (x, q.float(), s), "scale is for an int8 weight"),
        (lambda x, q, s: (x, q, s.double()), "scale must have dtype Float"),
        (lambda x, q, s: (x, q, s[None]), "scale must be 1-D"),
        (lambda x, q, s: (x, q, s[:-1]), r"scale.size\(0\) must equal weight.size\(0\) \(N\)"),
        (lambda x, q, s: (x, q, torch.stack([s, s], 1)[:, 0]), "scale must be contiguous"),
        (lambda x, q, s: (x, q, s.to("meta")), "scale is on meta"),
        (lambda x, q, s: (x, q.to(torch.int16), s), "weight must have dtype Float, Char, Byte, BFloat16"),
        (lambda x, q, s: (x, q.to(torch.uint8), s), r"weight must be 4-D \(a packed int8 weight"),
        (lambda x, q, s: (x, q[:, :-1], s), r"weight.size\(1\) must equal x.size\(1\)"),
    ],
)
def test_int8_bad_inputs(device, change, match):
    """Through the wrapper and past it (torch.ops directly: the binding's own checks, on every device present)."""
    x, q, s = change(*_case_int8(4, 6, 8, seed=2, device=device))
    with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
        sbd_ext.row_linear(x, q, s)
    if not (isinstance(s, torch.Tensor) and s.device.type == "meta"):
        with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
            torch.ops.sbd_ext.row_linear(x, q, s)


def test_int8_scale_requiring_grad_is_refused():
    x, q, s = _case_int8(2, 3, 4, seed=4, device="cpu")
    s.requires_grad_(True)
    with pytest.raises(RuntimeError, match="has no backward, but scale require"):
        sbd_ext.row_linear(x, q, s)
    with pytest.raises(RuntimeError, match="has no backward, but scale require"):
        torch.ops.sbd_ext.row_linear(x, q, s)
    with torch.no_grad():
        _check_int8(sbd_ext.row_linear(x, q, s), x, q, s.detach())


def test_int8_fake_kernel_checks_what_the_binding_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.sbd_ext.row_linear
    with FakeTensorMode():
        x, q, s = torch.empty(4, 64), torch.empty(5, 64, dtype=torch.int8), torch.empty(5)
        assert op(x, q, s).shape == (4, 5) and op(x, q, s).dtype == torch.float32
        with pytest.raises(ValueError, match="an int8 weight needs scale"):
            op(x, q)
        with pytest.raises(ValueError, match="scale is for an int8 weight"):
            op(x, torch.empty(5, 64), s)
        with pytest.raises(ValueError, match=r"scale.size\(0\) must equal weight.size\(0\)"):
            op(x, q, torch.empty(4))
        with pytest.raises(TypeError, match="scale must have dtype Float"):
            op(x, q, torch.empty(5, dtype=torch.float16))


# ---- fp32 weights packed in panels of 16 rows (sbd_ext.quantize(model, "packed")) -------------------------------


def test_pack_layout_and_round_trip():
    """packed[n // 16, k, n % 16] is weight[n, k]; unpack inverts it (with pad, the extra rows are zero)."""
    w = torch.arange(32 * 5, dtype=torch.float32).view(32, 5)
    p = pack_row_linear_weight(w)
    assert p.shape == (2, 5, 16) and p.is_contiguous()
    for n in (0, 7, 15, 16, 31):
        for k in range(5):
            assert p[n // 16, k, n % 16] == w[n, k]
    assert torch.equal(unpack_row_linear_weight(p), w)
    w3 = torch.randn(35, 4)
    p3 = pack_row_linear_weight(w3, pad=True)
    assert p3.shape == (3, 4, 16) and bool((unpack_row_linear_weight(p3)[35:] == 0).all())
    assert torch.equal(unpack_row_linear_weight(p3, 35), w3)


@pytest.mark.parametrize(
    "weight, match",
    [
        (torch.randn(20, 8), "not a multiple of 16"),
        (torch.randn(16, 8).double(), "for fp32 or bf16 weights"),
        (torch.randn(16), "must be 2-D"),
        ("w", "must be a torch.Tensor"),
    ],
)
def test_pack_refuses(weight, match):
    with pytest.raises((TypeError, ValueError), match=match):
        pack_row_linear_weight(weight)


# M: 1-24 rows in one tile (AVX-512) or tiles of 6 (AVX2 / default), 25-32 two tiles, 33 and 70 slices of 32 (a
# prefill); K: odd (the K-split accumulator sets' tail), SmolLM2's 576 / 1536; N: one panel to nine, chunk edges (64).
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 23, 24, 25, 32, 33, 70])
@pytest.mark.parametrize("N, K", [(16, 1), (16, 7), (32, 17), (48, 576), (80, 577), (144, 1537)])
def test_packed_matches_reference(device, cpu_isa, M, N, K):
    x, w = _case(M, N, K, seed=M * 10000 + N * 10 + K + 1, device=device)
    y = sbd_ext.row_linear(x, pack_row_linear_weight(w.cpu()).to(device))
    _check(y, x, w, f"packed M={M} N={N} K={K}")


def test_packed_reference_is_the_weights_product():
    x, w = _case(5, 48, 33, seed=11, device="cpu")
    assert torch.equal(R.row_linear(x, pack_row_linear_weight(w)), R.row_linear(x, w))


def test_packed_head_and_strided_rows(device, cpu_isa):
    """An output head (49152 rows) for a 17-row verify forward, x rows strided (a slice of a wider tensor)."""
    xb, w = _case(34, 49152, 576, seed=12, device=device)
    x = xb[::2]
    _check(sbd_ext.row_linear(x, pack_row_linear_weight(w.cpu()).to(device)), x, w)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda x, p: (x, p[:, :-1]), r"weight.size\(1\) must equal x.size\(1\)"),
        (lambda x, p: (x, p.transpose(0, 1).contiguous().transpose(0, 1)), "packed weight .* must be contiguous"),
        (lambda x, p: (x, p.double()), "weight must have dtype Float"),
        (lambda x, p: (x, p[..., :8]), "weight must be 2-D"),
        (lambda x, p: (x, p.to("meta")), "weight is on meta"),
    ],
)
def test_packed_bad_inputs(device, change, match):
    x, w = _case(4, 32, 8, seed=2, device=device)
    x, p = change(x, pack_row_linear_weight(w.cpu()).to(device))
    with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
        sbd_ext.row_linear(x, p)


def test_packed_bad_inputs_past_the_wrapper(device):
    """The binding's own checks (torch.ops directly): a scale, quantize_x, a packed int8 tensor, strides."""
    x, w = _case(4, 32, 8, seed=2, device=device)
    p = pack_row_linear_weight(w.cpu()).to(device)
    op = torch.ops.sbd_ext.row_linear
    with pytest.raises(ValueError, match="scale is for an int8 weight"):
        op(x, p, torch.ones(32, device=device))
    with pytest.raises(ValueError, match="quantize_x=True multiplies int8 x with an int8 weight"):
        op(x, p, None, True)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        op(x, p.to(torch.int8))
    with pytest.raises(ValueError, match=r"a packed weight \[N / 16, K, 16\] must be contiguous"):
        op(x, p.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match=r"a packed weight \[N / 16, K, 16\] must be contiguous"):
        op(x, torch.zeros(1, 8, 16, device=device).expand(2**40, 8, 16))  # stride 0: 2^44 rows of one panel


def test_packed_fake_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.sbd_ext.row_linear
    with FakeTensorMode():
        x = torch.empty(4, 64)
        assert op(x, torch.empty(3, 64, 16)).shape == (4, 48)
        with pytest.raises(ValueError, match=r"weight.size\(1\) must equal x.size\(1\) \(K\) = 64"):
            op(x, torch.empty(3, 63, 16))
        with pytest.raises(ValueError, match="weight must be 2-D"):
            op(x, torch.empty(3, 64, 8))


# ---- RowLinear in a model -------------------------------------------------------------------------------------
class _Quantised(nn.Linear):
    """A subclass of nn.Linear with its own forward: use_row_linear must leave it alone."""


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False), _Quantised(8, 4))


def test_use_row_linear_switches_plain_linears_only():
    m = _model()
    keys = list(m.state_dict())
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        plain = m(x)
        assert use_row_linear(m) == 2
        assert [type(mod) for mod in m] == [RowLinear, nn.ReLU, RowLinear, _Quantised]
        assert list(m.state_dict()) == keys
        fast = m(x)
        assert_close(fast, plain, atol=1e-5, rtol=1e-5)
        assert use_row_linear(m, False) == 2
        assert [type(mod) for mod in m] == [nn.Linear, nn.ReLU, nn.Linear, _Quantised]


def test_row_linear_layer_uses_the_op_only_where_it_should(monkeypatch):
    calls = []
    real = sbd_ext.linear.row_linear
    monkeypatch.setattr(sbd_ext.linear, "row_linear", lambda x, w: calls.append(tuple(x.shape)) or real(x, w))
    lin = nn.Linear(8, 4)
    use_row_linear(lin)
    with torch.no_grad():
        y = lin(torch.randn(2, 3, 8))
        assert calls == [(6, 8)] and y.shape == (2, 3, 4)
        x = torch.randn(ROW_LIMIT + 7, 8)  # a prefill: the op too (it runs the GEMM itself past ROW_LIMIT rows)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        lin(torch.randn(0, 8))  # no rows
        lin.double()(torch.randn(4, 8, dtype=torch.float64))  # another dtype
    assert calls == [(6, 8), (ROW_LIMIT + 7, 8)]
    lin.float()
    x = torch.randn(4, 8, requires_grad=True)
    lin(x).sum().backward()  # autograd needs a graph: F.linear, and gradients flow
    assert len(calls) == 2 and x.grad is not None and lin.weight.grad is not None


def test_ensure_row_linear_respects_device_dtype_and_opt_out():
    m = _model()
    ensure_row_linear(m, torch.device("cpu"), torch.float16)
    assert type(m[0]) is nn.Linear
    ensure_row_linear(m, torch.device("meta"), torch.float32)
    assert type(m[0]) is nn.Linear
    ensure_row_linear(m, torch.device("cpu"), torch.float32)
    assert type(m[0]) is RowLinear
    use_row_linear(m, False)
    ensure_row_linear(m, torch.device("cpu"), torch.float32)  # opted out: stays off
    assert type(m[0]) is nn.Linear


def test_generate_switches_an_fp32_cpu_model_and_matches_the_plain_linears():
    """sbd_ext.generate on a tiny Llama switches its linears; tokens equal those of a copy kept on nn.Linear."""
    model = tiny_llama(hidden=64, intermediate=128).eval()
    plain = tiny_llama(hidden=64, intermediate=128).eval()
    plain.load_state_dict(model.state_dict())
    use_row_linear(plain, False)
    prompt = torch.randint(0, 50, (2, 7))
    out = sbd_ext.generate(model, prompt, max_new_tokens=12, block_size=4, threshold=0.35)
    ref = sbd_ext.generate(plain, prompt, max_new_tokens=12, block_size=4, threshold=0.35)
    assert type(model.lm_head) is RowLinear and type(plain.lm_head) is nn.Linear
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(8, 3).t(),  # 2-D, transposed: K is the strided dimension (issue 35, item 14)
        lambda: torch.randn(3, 16)[:, ::2],  # 2-D, every other column
        lambda: torch.randn(4, 3, 8).transpose(0, 1),  # 3-D, rows permuted (reshape copies)
        lambda: torch.randn(1, 8).expand(5, 8),  # stride-0 rows
        lambda: torch.randn(8),  # 1-D
    ],
)
def test_row_linear_layer_takes_any_input_nn_linear_takes(make):
    """A RowLinear computes wherever nn.Linear computes (a non-contiguous view included) and equals it."""
    torch.manual_seed(0)
    plain = nn.Linear(8, 6)
    fast = nn.Linear(8, 6)
    fast.load_state_dict(plain.state_dict())
    use_row_linear(fast)
    x = make()
    with torch.no_grad():
        assert_close(fast(x), plain(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("M", [1, 3, 16, 40])  # 40: past ROW_LIMIT, the kernel on slices
@pytest.mark.parametrize("N,K", [(48, 37), (192, 576), (5, 3)])
def test_bf16_weight_matches_reference(cpu_isa, M, N, K):
    """A bf16 weight [N, K] (a bf16 model's RowLinear): widened exactly, products summed in fp32."""
    gen = torch.Generator().manual_seed(M * N + K)
    w = torch.randn(N, K, generator=gen).bfloat16()
    x = torch.randn(M, K, generator=gen)
    _check(sbd_ext.row_linear(x, w), x, w)


def test_bf16_row_linear_layer_is_f_linear_to_bf16_rounding():
    """RowLinear in bf16: the op on fp32 x and the bf16 weight, rounded to bf16 once; F.linear in bf16 rounds the
    same exact products' fp32 sum once, so the two differ by at most one bf16 step (sum order)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 40, bias=True).bfloat16()
    x = torch.randn(2, 7, 96).bfloat16()
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    use_row_linear(layer)
    with torch.no_grad():
        out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=0.02, rtol=2**-7)


def test_bf16_x_with_a_bf16_weight_rounds_once_and_other_weights_refuse_it(cpu_isa):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=gen).bfloat16()
    x = torch.randn(5, 96, generator=gen).bfloat16()
    out = sbd_ext.row_linear(x, w)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, sbd_ext.row_linear(x.float(), w).bfloat16())  # the fp32 result, rounded once
    for bad in (w.float(), torch.zeros(40, 96, dtype=torch.int8)):
        with pytest.raises(TypeError, match="bf16 x goes with a bf16 weight"):
            sbd_ext.row_linear(x, bad, torch.ones(40) if bad.dtype == torch.int8 else None)
        with pytest.raises(TypeError, match="bf16 x goes with a bf16 weight"):
            torch.ops.sbd_ext.row_linear(x, bad, torch.ones(40) if bad.dtype == torch.int8 else None, False)


def test_cpu_core_is_the_cpuid_family():
    """build_info()["cpu_core"] (the core that picks row_linear's per-core prefetch distances, cpu/isa.h) is "zen5"
    exactly on an AMD family 26 (0x1A) CPU, "zen4" exactly on an AMD family 25 (0x19) CPU with AVX-512F, "intel"
    exactly on an Intel CPU with AVX-512F, as /proc/cpuinfo reports them, and "other" everywhere else."""
    try:
        with open("/proc/cpuinfo") as f:
            fields = {}
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pytest.skip("no /proc/cpuinfo on this platform")
    if "cpu family" not in fields:
        pytest.skip("/proc/cpuinfo names no CPU family")
    amd, family = fields.get("vendor_id") == "AuthenticAMD", int(fields["cpu family"])
    zen4 = amd and family == 0x19 and "avx512f" in fields.get("flags", "").split()
    intel = fields.get("vendor_id") == "GenuineIntel" and "avx512f" in fields.get("flags", "").split()
    expected = "zen5" if amd and family == 0x1A else "zen4" if zen4 else "intel" if intel else "other"
    assert sbd_ext.build_info()["cpu_core"] == expected
