"""gated_lora_linear (a projection plus a gated LoRA adapter in one call, the CPU kernel of a compiled drafter step)
against sbd_ext.reference.gated_lora_linear (float64), row_linear's bits on rows with gate 0, and its contract."""

import pytest
import torch
from sbd_models import num_threads, one_thread, refused_alike

from sbd_ext import reference as R
from sbd_ext.ops import gated_lora_linear, row_linear
from sbd_ext.packing import pack_row_linear_int8, pack_row_linear_weight, unpack_row_linear_weight
from sbd_ext.quantization import quantize_weight

EPS32 = 2.0**-24


def _case(M, N, K, r, seed, gate="mixed", dtype=torch.float32):
    """(x, [W; A] packed, scale * B packed, gate, W packed); ``dtype``: W's and A's (bf16: a "bf16" model's)."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).to(dtype)
    a, b = torch.randn(r, K, generator=g).to(dtype), torch.randn(N, r, generator=g) * 0.3
    wp = pack_row_linear_weight(w)
    fused = torch.cat([wp, pack_row_linear_weight(a, pad=True)])
    gates = {
        "mixed": (torch.rand(M, generator=g) > 0.4).float(),
        "zero": torch.zeros(M),
        "one": torch.ones(M),
        "scaled": torch.rand(M, generator=g) * 2 - 0.5,
    }
    return x, fused, pack_row_linear_weight(b), gates[gate], wp


def _check(y, x, fused, bp, gate, msg=""):
    """|y - reference| within the fp32 summation bound of both products (K * eps * |x| |W|^T, and the adapter's
    (K + r) * eps * |gate| |x| |A|^T |B|^T), float64 reference."""
    w, b = unpack_row_linear_weight(fused).double(), unpack_row_linear_weight(bp).double()
    n, r = b.shape
    ax = x.double().abs()
    bound = (ax @ w[:n].abs().t()) * (x.shape[1] + 2) * EPS32
    bound += gate.double().abs()[:, None] * ((ax @ w[n : n + r].abs().t()) @ b.abs().t()) * (x.shape[1] + r + 4) * EPS32
    ref = R.gated_lora_linear(x, fused, bp, gate).double()
    err = (y.double() - ref).abs()
    assert y.shape == ref.shape and y.dtype == torch.float32, msg
    assert bool((err <= bound + 1e-30).all()), f"{msg}: worst err/bound {(err / (bound + 1e-30)).max():.3g}"


# M: one row to a verify forward's rows and past the 32-row slices; N: one panel to SmolLM2's 1536; r: 1, a partial
# panel, one panel, two panels; K: a vector tail and SmolLM2's widths.
@pytest.mark.parametrize("M", [1, 2, 3, 4, 6, 7, 16, 33])
@pytest.mark.parametrize(
    "N, K, r", [(16, 1, 1), (16, 9, 3), (48, 64, 16), (64, 17, 20), (192, 576, 16), (1536, 576, 16)]
)
def test_matches_reference(cpu_isa, M, N, K, r):
    x, fused, bp, gate, _ = _case(M, N, K, r, seed=M * 1000 + N + K + r)
    _check(gated_lora_linear(x, fused, bp, gate), x, fused, bp, gate, f"M={M} N={N} K={K} r={r}")


@pytest.mark.parametrize("M", [1, 3, 7, 16, 33])
@pytest.mark.parametrize("N, K, r", [(16, 9, 3), (64, 17, 20), (192, 576, 16)])
def test_bf16_weight_matches_reference(cpu_isa, M, N, K, r):
    """[W; A] in bf16 panels (a "bf16" model's fused adapter): the products of the widened values, fp32 sums."""
    x, fused, bp, gate, _ = _case(M, N, K, r, seed=M * 7 + N + K + r, dtype=torch.bfloat16)
    _check(gated_lora_linear(x, fused, bp, gate), x, fused, bp, gate, f"bf16 M={M} N={N} K={K} r={r}")


def _fused_as(layout, w, a):
    """(``[W; A]`` packed in ``layout``, its scale or None) for gated_lora_linear."""
    if layout == "int8":
        wq, ws = quantize_weight(w)
        aq, as_ = quantize_weight(a)
        wp, ap = pack_row_linear_int8(wq), pack_row_linear_int8(aq, pad=True)
        return torch.cat([wp, ap]), torch.cat([ws, torch.nn.functional.pad(as_, (0, ap.shape[0] * 16 - len(a)))])
    if layout == "bf16-tiles":
        return pack_row_linear_weight(torch.cat([w, a]).bfloat16(), pad=True, tiles=True), None
    dtype = torch.bfloat16 if layout == "bf16" else torch.float32
    return torch.cat([pack_row_linear_weight(w.to(dtype)), pack_row_linear_weight(a.to(dtype), pad=True)]), None


@pytest.mark.parametrize("layout", ["fp32", "bf16", "bf16-tiles", "int8"])
@pytest.mark.parametrize("M", [1, 3, 4, 16, 33])
def test_bf16_lora_b_is_the_fp32_panels_of_its_values_bit_for_bit(cpu_isa, layout, M):
    """scale * B in bf16 panels (a bf16 model's B: GatedLoRALinear.packed_b packs it so) gives the bits of the fp32
    panels of the same values over every [W; A] layout: the panel path widens each value and sums alike."""
    g = torch.Generator().manual_seed(M + len(layout))
    N, K, r = 192, 576, 16
    x, w, a = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(r, K, generator=g)
    b = (torch.randn(N, r, generator=g) * 0.3).bfloat16()
    gate = (torch.rand(M, generator=g) > 0.3).float()
    gate[0] = 1.0
    fused, scale = _fused_as(layout, w, a)
    b16, b32 = pack_row_linear_weight(b), pack_row_linear_weight(b.float())
    y = gated_lora_linear(x, fused, b16, gate, scale)
    assert b16.dtype == torch.bfloat16 and torch.equal(y, gated_lora_linear(x, fused, b32, gate, scale))
    ref = R.gated_lora_linear(x, fused, b16, gate, scale)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    assert not torch.equal(y[gate != 0], gated_lora_linear(x, fused, b32, torch.zeros(M), scale)[gate != 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate", ["mixed", "zero", "one", "scaled"])
def test_rows_with_gate_zero_are_row_linear_bit_for_bit(cpu_isa, gate, dtype):
    """Rows with gate 0 are the base's own row_linear call over the same panels (same rows, same sums), bit for bit:
    the drafter's clean rows are the unmodified model's computation. Other gate values scale the adapter term."""
    x, fused, bp, g, wp = _case(7, 576, 576, 16, seed=3, gate=gate, dtype=dtype)
    y, base = gated_lora_linear(x, fused, bp, g), row_linear(x, wp)
    off = g == 0
    assert torch.equal(y[off], base[off])
    _check(y, x, fused, bp, g)
    if bool((~off).any()):
        assert not torch.equal(y[~off], base[~off])


def test_strided_rows_and_thread_count():
    """x's rows may be strided (a slice of a wider tensor); the result does not depend on the thread count."""
    xb, fused, bp, gate, _ = _case(12, 192, 576, 16, seed=5)
    wide = torch.randn(6, 700)
    wide[:, 50:626] = xb[::2]
    x = wide[:, 50:626]
    gate = gate[::2].contiguous()
    with num_threads(2):
        two = gated_lora_linear(x, fused, bp, gate)
    with one_thread():
        one = gated_lora_linear(x, fused, bp, gate)
    assert torch.equal(one, two)
    _check(one, x.contiguous(), fused, bp, gate)


def test_empty_and_nan():
    x, fused, bp, gate, _ = _case(3, 32, 8, 4, seed=6)
    assert gated_lora_linear(x[:0], fused, bp, gate[:0]).shape == (0, 32)
    z = _case(3, 32, 0, 4, seed=6)
    assert torch.equal(gated_lora_linear(*z[:4]), torch.zeros(3, 32))
    x[1, 2] = float("nan")
    y = gated_lora_linear(x, fused, bp, torch.ones(3))
    assert bool(y[1].isnan().all()) and not bool(y[0].isnan().any())


def _bad(change):
    x, fused, bp, gate, _ = _case(4, 32, 8, 4, seed=8)
    args = dict(x=x, weight=fused, lora_b=bp, gate=gate)
    name, value = change
    args[name] = value(args[name])
    return args


BAD = [
    (("x", lambda t: t.double()), TypeError, "x must have dtype Float"),
    (("weight", lambda t: t.half()), TypeError, "weight must have dtype Float"),
    (("lora_b", lambda t: t.to(torch.int8)), TypeError, "lora_b must have dtype Float"),
    (("gate", lambda t: t.long()), TypeError, "gate must have dtype Float"),
    (("x", lambda t: t[None]), ValueError, "x must be 2-D"),
    (("weight", lambda t: t.reshape(t.shape[0], -1)), ValueError, "weight must be 3-D"),
    (("lora_b", lambda t: t[0]), ValueError, "lora_b must be 3-D"),
    (("gate", lambda t: t[:, None]), ValueError, "gate must be 1-D"),
    (("weight", lambda t: t[:, :7].contiguous()), ValueError, r"weight.size\(1\) must equal x.size\(1\)"),
    (("gate", lambda t: t[:3]), ValueError, r"gate.size\(0\) must equal x.size\(0\)"),
    (("weight", lambda t: t[:2]), ValueError, "weight must hold the base's"),  # no panel left for A
    (("lora_b", lambda t: t[:, :0]), ValueError, "rank r >= 1"),
    (("weight", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "weight must be contiguous"),
    (("lora_b", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "lora_b must be contiguous"),
    (("gate", lambda t: torch.stack([t, t], 1)[:, 0]), ValueError, "gate must be contiguous"),
    (("x", lambda t: t.t().contiguous().t()), ValueError, "x must be contiguous in its last dimension"),
]


@pytest.mark.parametrize("change, exc, match", BAD, ids=[f"{c[0]}-{m}" for c, _, m in BAD])
def test_bad_inputs(change, exc, match):
    """The Python wrapper, the binding behind torch.ops and the fake kernel refuse the same inputs (no crash, no
    out-of-bounds read: the weight too short for A's panels is the one a kernel would overrun)."""
    refused_alike("gated_lora_linear", gated_lora_linear, _bad(change), exc, match)


def test_devices_and_grads():
    x, fused, bp, gate, _ = _case(2, 16, 8, 2, seed=9)
    with pytest.raises(RuntimeError, match="gate is on meta but x is on cpu"):
        gated_lora_linear(x, fused, bp, gate.to("meta"))
    with pytest.raises(RuntimeError, match="lora_b is on cpu but x is on meta"):
        torch.ops.sbd_ext.gated_lora_linear(x.to("meta"), fused.to("meta"), bp, gate.to("meta"))
    assert torch.ops.sbd_ext.gated_lora_linear(*(t.to("meta") for t in (x, fused, bp, gate))).shape == (2, 16)
    xg = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="gated_lora_linear has no backward, but x require"):
        gated_lora_linear(xg, fused, bp, gate)
    with pytest.raises(RuntimeError, match="gated_lora_linear has no backward, but x require"):
        torch.ops.sbd_ext.gated_lora_linear(xg, fused, bp, gate)
    with torch.no_grad():
        _check(gated_lora_linear(xg, fused, bp, gate), x, fused, bp, gate)
    if torch.cuda.is_available():
        with pytest.raises(NotImplementedError, match="CPU kernel only"):
            gated_lora_linear(*(t.cuda() for t in (x, fused, bp, gate)))


def test_compiles_and_equals_eager():
    """Under torch.compile (fullgraph, the fake kernel for the shapes) the op returns the eager call's bits."""
    x, fused, bp, gate, _ = _case(5, 64, 32, 8, seed=10)

    def f(x, gate):
        return gated_lora_linear(x * 2, fused, bp, gate) + 1

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(x, gate), f(x, gate))
