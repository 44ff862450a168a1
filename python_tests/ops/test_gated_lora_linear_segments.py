"""gated_lora_linear with ``segments``: S sibling projections (q/k/v, gate/up) with their adapters in one call over
their [W_1; A_1; ...; W_S; A_S] (sbd_ext.merged_linears). Each projection's columns must be, bit for bit, what a
call on its own [W_i; A_i] and B'_i gives, in every weight layout and at every row count; the reference must agree;
bad segments are refused alike by the wrapper, the binding and the fake kernel."""

from __future__ import annotations

import pytest
import torch
from sbd_models import refused_alike

from sbd_ext import reference as R
from sbd_ext.ops import gated_lora_linear
from sbd_ext.packing import pack_row_linear_int8, pack_row_linear_weight
from sbd_ext.quantization import quantize_weight

LAYOUTS = ["fp32", "bf16", "bf16-tiles", "int8"]


def _member(layout, w, a):
    """(one projection's [W; A] in ``layout``, its scales or None)."""
    if layout == "int8":
        (wq, ws), (aq, as_) = quantize_weight(w), quantize_weight(a)
        wp, ap = pack_row_linear_int8(wq), pack_row_linear_int8(aq, pad=True)
        return torch.cat([wp, ap]), torch.cat([ws, torch.nn.functional.pad(as_, (0, ap.shape[0] * 16 - len(a)))])
    if layout == "bf16-tiles":
        n_pad = -(-len(a) // 16) * 16
        wa = torch.cat([w, a, torch.zeros(n_pad - len(a), w.shape[1])])
        return pack_row_linear_weight(wa.bfloat16(), tiles=True), None
    dtype = torch.bfloat16 if layout == "bf16" else torch.float32
    return torch.cat([pack_row_linear_weight(w.to(dtype)), pack_row_linear_weight(a.to(dtype), pad=True)]), None


def _case(layout, M, ns, K, r, seed, b_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    members = [_member(layout, torch.randn(n, K, generator=g), torch.randn(r, K, generator=g)) for n in ns]
    bs = [pack_row_linear_weight((torch.randn(n, r, generator=g) * 0.3).to(b_dtype)) for n in ns]
    gate = (torch.rand(M, generator=g) > 0.4).float()
    gate[0] = 1.0
    return x, members, bs, gate


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("M", [1, 3, 6, 16, 33])
@pytest.mark.parametrize("ns, K, r", [((576, 192, 192), 576, 16), ((48, 16), 40, 5), ((32, 64), 64, 20)])
def test_each_projection_is_its_own_call_bit_for_bit(cpu_isa, layout, M, ns, K, r):
    x, members, bs, gate = _case(layout, M, ns, K, r, seed=M + sum(ns) + K + r + len(layout))
    weight, lora_b = torch.cat([m[0] for m in members]), torch.cat(bs)
    scale = None if members[0][1] is None else torch.cat([m[1] for m in members])
    own = torch.cat([gated_lora_linear(x, w, b, gate, s) for (w, s), b in zip(members, bs, strict=True)], dim=1)
    got = gated_lora_linear(x, weight, lora_b, gate, scale, list(ns))
    assert got.shape == (M, sum(ns)) and torch.equal(got, own)
    ref = R.gated_lora_linear(x, weight, lora_b, gate, scale, list(ns))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    other = gated_lora_linear(x, weight, lora_b, torch.zeros(M), scale, list(ns))  # the adapters do add something
    assert not torch.equal(got[gate != 0], other[gate != 0])


def test_bf16_lora_b_and_threads_keep_the_bits(cpu_isa):
    x, members, bs, gate = _case("fp32", 7, (64, 32), 96, 16, seed=5, b_dtype=torch.bfloat16)
    weight, lora_b = torch.cat([m[0] for m in members]), torch.cat(bs)
    want = torch.cat([gated_lora_linear(x, m[0], b, gate) for m, b in zip(members, bs, strict=True)], dim=1)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(gated_lora_linear(x, weight, lora_b, gate, None, (64, 32)), want)
    finally:
        torch.set_num_threads(threads)
    empty = gated_lora_linear(x[:0], weight, lora_b, gate[:0], None, [64, 32])
    assert empty.shape == (0, 96)


def _bad(segments, drop_panels=0):
    x, members, bs, gate = _case("fp32", 4, (32, 16), 8, 4, seed=9)
    weight = torch.cat([m[0] for m in members])
    weight = weight[: weight.shape[0] - drop_panels].contiguous()
    return dict(x=x, weight=weight, lora_b=torch.cat(bs), gate=gate, scale=None, segments=segments)


BAD = [
    (([40, 8],), ValueError, "positive multiple of 16"),
    (([0, 48],), ValueError, "positive multiple of 16"),
    (([-16, 64],), ValueError, "positive multiple of 16"),
    (([16, 16],), ValueError, "must sum to N = 48"),
    (([16, 16, 16],), ValueError, "hold their"),  # three A panels where the weight has two
    (([32, 16], 1), ValueError, "hold their"),  # the last A panel missing
    (([64, 16],), ValueError, "up to 48"),
]


@pytest.mark.parametrize("case, exc, match", BAD, ids=[str(c) for c, _, _ in BAD])
def test_bad_segments(case, exc, match):
    refused_alike("gated_lora_linear", gated_lora_linear, _bad(*case), exc, match)


def test_segments_must_be_ints():
    args = _bad([32, 16])
    with pytest.raises(TypeError, match="segments"):
        gated_lora_linear(**{**args, "segments": "32"})
    with pytest.raises(TypeError, match="integer"):
        gated_lora_linear(**{**args, "segments": [32.0, 16]})


def test_compiles_and_equals_eager():
    x, members, bs, gate = _case("int8", 5, (48, 16), 64, 8, seed=11)
    weight, lora_b, scale = torch.cat([m[0] for m in members]), torch.cat(bs), torch.cat([m[1] for m in members])

    def f(x, gate):
        return gated_lora_linear(x * 2, weight, lora_b, gate, scale, (48, 16)) + 1

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True)(x, gate), f(x, gate))
