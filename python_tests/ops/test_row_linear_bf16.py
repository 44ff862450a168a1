"""row_linear with a bf16 weight packed in panels (``sbd_ext.quantize(model, "bf16")``): against the float64
reference, bit for bit the fp32 panel path on the widened values, its checks, and the model scheme end to end."""

import copy

import pytest
import torch
from sbd_models import tiny_llama
from utils import assert_close

import sbd_ext
from sbd_ext import reference as R
from sbd_ext.linear import bf16_tiles_in_use
from sbd_ext.packing import is_bf16_tiles, pack_row_linear_weight, unpack_row_linear_weight
from sbd_ext.quantization import PackedLinear, quantize

EPS32 = 2.0**-24


def _case(M, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).bfloat16()


def test_pack_bf16_layout_and_round_trip():
    w = torch.randn(35, 9).bfloat16()
    p = pack_row_linear_weight(w, pad=True)
    assert p.dtype == torch.bfloat16 and p.shape == (3, 9, 16) and p.is_contiguous()
    assert p[20 // 16, 4, 20 % 16] == w[20, 4]
    assert torch.equal(unpack_row_linear_weight(p, 35), w)
    assert bool((unpack_row_linear_weight(p)[35:] == 0).all())


# M: one row (the stream), tile edges (AVX2: tiles of 6; AVX-512: 16), two tiles, slices of 32 (a prefill);
# K: odd (segment tails) and SmolLM2's 576 / 1536; N: one panel to nine.
@pytest.mark.parametrize("M", [1, 2, 3, 4, 6, 7, 9, 16, 17, 25, 33, 70])
@pytest.mark.parametrize("N, K", [(16, 1), (16, 7), (32, 17), (48, 576), (80, 577), (144, 1537)])
def test_packed_bf16_matches_reference_and_the_fp32_panels(device, cpu_isa, M, N, K):
    """Within the fp32 summation bound of the exact product, and bit for bit the fp32 panel path over the same
    values widened (the same tiles and sum order: only the load differs)."""
    x, w = _case(M, N, K, seed=M * 10000 + N * 10 + K)
    p = pack_row_linear_weight(w).to(device)
    y = sbd_ext.row_linear(x.to(device), p).cpu()
    ref = R.row_linear(x, w).double()
    bound = (x.double().abs() @ w.double().abs().t()) * (K + 2) * EPS32 + 1e-30
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert bool(((y.double() - ref).abs() <= bound).all()), f"M={M} N={N} K={K}"
    if device == "cpu":
        assert torch.equal(y, sbd_ext.row_linear(x, pack_row_linear_weight(w.float())))


def test_packed_bf16_output_head_rows(cpu_isa):
    """SmolLM2's head shape (49152 x 576) at 1 and 9 rows, x rows strided."""
    xb, w = _case(18, 49152, 576, seed=5)
    x = xb[::2]
    p = pack_row_linear_weight(w)
    y = sbd_ext.row_linear(x, p)
    assert torch.equal(y, sbd_ext.row_linear(x, pack_row_linear_weight(w.float())))
    assert torch.equal(y[:1], sbd_ext.row_linear(x[:1], p))  # a row alone: the same bits


def test_packed_bf16_with_bf16_x_rounds_once():
    x, w = _case(5, 32, 40, seed=3)
    p = pack_row_linear_weight(w)
    out = sbd_ext.row_linear(x.bfloat16(), p)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, sbd_ext.row_linear(x.bfloat16().float(), p).bfloat16())


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda p: p[:, :-1], r"weight.size\(1\) must equal x.size\(1\)"),
        (
            lambda p: p.transpose(0, 1).contiguous().transpose(0, 1),
            r"a packed weight \[N / 16, K, 16\] must be contiguous",
        ),
        (lambda p: p[..., :8], "weight must be 2-D"),
        (lambda p: p.half(), "weight must have dtype"),
    ],
)
def test_packed_bf16_bad_inputs(change, match):
    x, w = _case(4, 32, 8, seed=2)
    p = change(pack_row_linear_weight(w))
    for call in (lambda: sbd_ext.row_linear(x, p), lambda: torch.ops.sbd_ext.row_linear(x, p, None, False)):
        with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
            call()
    with pytest.raises(ValueError, match="scale is for an int8 weight"):
        torch.ops.sbd_ext.row_linear(x, pack_row_linear_weight(w), torch.ones(32), False)


def test_packed_bf16_fake_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.sbd_ext.row_linear(torch.empty(4, 64), torch.empty(3, 64, 16, dtype=torch.bfloat16))
        assert out.shape == (4, 48) and out.dtype == torch.float32


# ---- the model scheme (decoding on it, verify == its own NTP: python_tests/hf/test_quantize.py's arith cases) --------
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 17, 40])
def test_bf16_model_equals_the_rounded_fp32_model(tie, rows):
    """quantize(model, "bf16") computes what the fp32 model with its linear weights rounded to bf16 computes (with
    AMX-BF16's tiles in use, the layers' inputs rounded to bf16 as well)."""
    model = tiny_llama(tie=tie)
    ref = copy.deepcopy(model)
    tiles = bf16_tiles_in_use()
    with torch.no_grad():
        for m in ref.modules():
            if type(m) is torch.nn.Linear:
                m.weight = torch.nn.Parameter(m.weight.bfloat16().float(), requires_grad=False)
                if tiles:
                    m.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
    quantize(model, "bf16")
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.weight_packed.dtype == torch.bfloat16 for m in layers)
    assert "bfloat16 packed" in repr(layers[0])
    assert all(is_bf16_tiles(m.weight_packed) == tiles for m in layers)
    ids = torch.randint(0, 90, (1, rows), generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        # tiles: an fp32 activation a sum order away from a bf16 rounding boundary rounds the other way (2^-8 relative)
        tol = 5e-2 if tiles else 1e-5
        assert_close(model(ids).logits, ref(ids).logits, atol=4 * tol, rtol=tol)
    assert model.get_input_embeddings().weight.dtype == torch.float32  # a lookup reads one row: it stays fp32


def test_bf16_scheme_transitions_and_save(tmp_path):
    model = tiny_llama()
    quantize(model, "packed")
    quantize(model, "bf16")  # packed -> bf16: the fp32 panels rounded
    assert all(m.weight_packed.dtype == torch.bfloat16 for m in model.modules() if isinstance(m, PackedLinear))
    assert quantize(model, "bf16") is model  # a no-op
    for other in ("packed", "int8", "w8a8"):
        with pytest.raises(ValueError, match=r"already rounded to 'bf16'; .*reload the fp32 model"):
            quantize(model, other)
    with pytest.raises(ValueError, match=r"quantized with scheme 'bf16' .* rounded weights"):
        model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"already rounded to 'int8'"):
        quantize(quantize(tiny_llama(), "int8"), "bf16")
