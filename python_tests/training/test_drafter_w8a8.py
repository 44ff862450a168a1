"""The gated drafter over a w8a8 base whose weights are in row_linear's packed int8 layout (AVX512-VNNI): its
adapters fuse A into the base's int8 panels (GatedLoRALinear.fused_weight) and a compiled verify forward runs each
in one gated_lora_linear call; the clean rows stay the w8a8 base's own outputs bit for bit, so verify still equals
the w8a8 model's NTP decoding (compiled: test_drafter's test of the fused path)."""

from __future__ import annotations

import pytest
import torch
from sbd_models import random_drafter, single_thread  # noqa: F401

import sbd_ext
from sbd_ext import reference as R
from sbd_ext.packing import PANEL

pytestmark = pytest.mark.usefixtures("single_thread")


def _w8a8_drafter(seed: int):
    _, model = random_drafter(seed)
    sbd_ext.quantize(model, "w8a8")
    layer = next(m for _, m in model.sbd_drafter.lora_modules(model))
    if "weight_int8_packed" not in layer.base._buffers:
        pytest.skip("this CPU keeps w8a8 weights unpacked (no AVX512-VNNI): no int8 fused path")
    return model, layer


def test_fused_int8_adapter_keeps_the_base_bitwise():
    model, layer = _w8a8_drafter(seed=31)
    gate = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 1.0, 1.0]]).unsqueeze(-1)
    x = torch.randn(2, 5, layer.in_features, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = layer.base(x)  # the w8a8 base's own call, before any fusing
        w = layer.base.int8_weight().clone()
        layer.holder.gate = gate
        got = layer(x)
        fused, scale = layer.fused_weight(), layer.fused_scale()
        assert fused is not None and fused.dtype == torch.uint8 and scale is not None
        assert layer.base.weight_int8_packed.data_ptr() == fused.data_ptr()  # W stored once
        assert torch.equal(layer.base.int8_weight(), w)
        assert scale.shape == (fused.shape[0] * PANEL,)
        clean = gate[..., 0] == 0
        assert torch.equal(got[clean], plain[clean])  # bit for bit
        b = layer.packed_b()
        want = R.gated_lora_linear(x.reshape(10, -1), fused, b, gate.reshape(10), scale).view(2, 5, -1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # the adapter is the training definition's up to A's and x's int8 rounding
        ref = plain + layer._delta(x) * gate
        assert float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())
        layer.holder.gate, layer.holder.rows = None, (1, 4)  # eager: the adapter on a slice of rows, same path
        sliced = layer(x)
        assert torch.equal(sliced[:, [0, 4]], plain[:, [0, 4]])
        want_rows = R.gated_lora_linear(x.reshape(10, -1), fused, b, torch.ones(10), scale).view(2, 5, -1)
        torch.testing.assert_close(sliced[:, 1:4], want_rows[:, 1:4], rtol=1e-4, atol=1e-4)
        layer.holder.gate, layer.holder.rows = gate, None
        layer.lora_A.mul_(-1.5)  # in place, as an optimizer step: the fused int8 rows and scales follow
        again = layer(x)
        assert layer.fused_weight() is fused
        want2 = R.gated_lora_linear(x.reshape(10, -1), fused, b, gate.reshape(10), layer.fused_scale()).view(2, 5, -1)
        torch.testing.assert_close(again, want2, rtol=1e-4, atol=1e-4)
        assert not torch.equal(again[~clean], got[~clean])
        layer.holder.clear()
        assert torch.equal(layer(x), plain)
