"""gated_lora_linear over a packed int8 [W; A] (a w8a8 base's fused adapter): against
sbd_ext.reference.gated_lora_linear (float64 over the quantised values), the base's own row_linear call bit for bit on
rows with gate 0, and the int8 contract (the scale, its shape) refused alike by the wrapper, the binding and the fake
kernel."""

import pytest
import torch
from sbd_models import num_threads, one_thread, refused_alike

from sbd_ext import reference as R
from sbd_ext.ops import gated_lora_linear, row_linear
from sbd_ext.packing import PANEL, pack_row_linear_int8, pack_row_linear_weight
from sbd_ext.quantization import quantize_weight


def _case(M, N, K, r, seed, gate="mixed"):
    """(x, [Wq; Aq] packed uint8, scale [P * 16], scale * B packed, gate, (Wq packed, W's scale))."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    a, b = torch.randn(r, K, generator=g), torch.randn(N, r, generator=g) * 0.3
    wq, ws = quantize_weight(w)
    aq, as_ = quantize_weight(a)
    wp, ap = pack_row_linear_int8(wq), pack_row_linear_int8(aq, pad=True)
    scale = torch.cat([ws, torch.nn.functional.pad(as_, (0, ap.shape[0] * PANEL - r))])
    gates = {
        "mixed": (torch.rand(M, generator=g) > 0.4).float(),
        "zero": torch.zeros(M),
        "one": torch.ones(M),
        "scaled": torch.rand(M, generator=g) * 2 - 0.5,
    }
    return x, torch.cat([wp, ap]), scale, pack_row_linear_weight(b), gates[gate], (wp, ws)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 16, 33])
@pytest.mark.parametrize("N, K, r", [(16, 9, 3), (48, 64, 16), (64, 40, 20), (192, 576, 16), (1536, 576, 16)])
def test_matches_reference(cpu_isa, M, N, K, r):
    x, fused, scale, bp, gate, _ = _case(M, N, K, r, seed=M * 1000 + N + K + r)
    y = gated_lora_linear(x, fused, bp, gate, scale)
    ref = R.gated_lora_linear(x, fused, bp, gate, scale)
    assert y.shape == ref.shape == (M, N) and y.dtype == torch.float32
    # fp32 sums of exact integer block products (K / 32 blocks) and of the r-term B product
    torch.testing.assert_close(y, ref, rtol=2e-5, atol=2e-5 * (K**0.5 + 1))


@pytest.mark.parametrize("gate", ["mixed", "zero", "one", "scaled"])
def test_rows_with_gate_zero_are_row_linear_bit_for_bit(cpu_isa, gate):
    """Rows with gate 0 are the w8a8 base's own call (row_linear over W's panels, x quantised), bit for bit; the
    other rows add their gate times the adapter, whose A product is row_linear over A's int8 rows."""
    x, fused, scale, bp, g, (wp, ws) = _case(7, 576, 576, 16, seed=3, gate=gate)
    y, base = gated_lora_linear(x, fused, bp, g, scale), row_linear(x, wp, ws, True)
    off = g == 0
    assert torch.equal(y[off], base[off])
    h = row_linear(x, fused[wp.shape[0] :], scale[wp.shape[0] * PANEL :], True)[:, :16]
    want = base + g[:, None] * row_linear(h.contiguous(), bp)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    if bool((~off).any()):
        assert not torch.equal(y[~off], base[~off])


def test_slices_threads_and_empty():
    """Past the kernel's row slices, any thread count, no rows; a NaN stays in its row."""
    x, fused, scale, bp, gate, _ = _case(40, 192, 576, 16, seed=5)
    with num_threads(2):
        two = gated_lora_linear(x, fused, bp, gate, scale)
    with one_thread():
        one = gated_lora_linear(x, fused, bp, gate, scale)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, R.gated_lora_linear(x, fused, bp, gate, scale), rtol=2e-5, atol=1e-3)
    assert gated_lora_linear(x[:0], fused, bp, gate[:0], scale).shape == (0, 192)
    x[1, 2] = float("nan")
    y = gated_lora_linear(x[:3], fused, bp, torch.ones(3), scale)
    assert bool(y[1].isnan().all()) and not bool(y[0].isnan().any())


def test_many_rows_past_the_kept_scratch():
    """A prefill's rows: [W; A]'s outputs over 4 MB go to a buffer of the call's own (the kept scratch is for few
    rows), the same values as row by row; then a few rows again (the kept scratch, after the large call)."""
    x, fused, scale, bp, gate, _ = _case(1100, 1536, 64, 16, seed=11)
    y = gated_lora_linear(x, fused, bp, gate, scale)
    torch.testing.assert_close(y, R.gated_lora_linear(x, fused, bp, gate, scale), rtol=2e-5, atol=2e-4)
    rows = torch.cat([gated_lora_linear(x[i : i + 3], fused, bp, gate[i : i + 3], scale) for i in (0, 500, 1097)])
    assert torch.equal(rows, torch.cat([y[0:3], y[500:503], y[1097:1100]]))


def _bad(change):
    x, fused, scale, bp, gate, _ = _case(4, 32, 40, 4, seed=8)
    args = dict(x=x, weight=fused, lora_b=bp, gate=gate, scale=scale)
    name, value = change
    args[name] = value(args[name])
    return args


BAD = [
    (("scale", lambda t: None), ValueError, r"packed int8 \[W; A\] \(uint8\) needs its scale"),
    (("weight", lambda t: torch.zeros(3, 40, 16)), ValueError, "scale is for a packed int8"),
    (("scale", lambda t: t.double()), TypeError, "scale must have dtype Float"),
    (("scale", lambda t: t[:-16]), ValueError, r"scale.size\(0\) must equal 16 \* weight.size\(0\)"),
    (("scale", lambda t: t[:, None]), ValueError, "scale must be 1-D"),
    (("weight", lambda t: t[:, :8].contiguous()), ValueError, r"weight.size\(1\) must equal ceil"),
    (("weight", lambda t: t.reshape(t.shape[0], -1, 16)), ValueError, "weight must be 4-D"),
    (("weight", lambda t: t[:2]), ValueError, r"scale.size\(0\) must equal|weight must hold the base's"),
]


@pytest.mark.parametrize("change, exc, match", BAD, ids=[f"{c[0]}-{i}" for i, (c, _, _) in enumerate(BAD)])
def test_bad_inputs(change, exc, match):
    """The Python wrapper, the binding behind torch.ops and the fake kernel refuse the same inputs."""
    refused_alike("gated_lora_linear", gated_lora_linear, _bad(change), exc, match)


def test_compiles_and_equals_eager():
    x, fused, scale, bp, gate, _ = _case(5, 64, 40, 8, seed=10)

    def f(x, gate):
        return gated_lora_linear(x * 2, fused, bp, gate, scale) + 1

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(x, gate), f(x, gate))
