"""row_linear with a bf16 weight in AMX-BF16's tile layout (sbd_ext.packing.pack_row_linear_weight(..., tiles=True)):
x rounded to bf16, exact products summed in fp32. Every mode this CPU has: the tiles ("on", where AMX-BF16 is usable),
their emulation (an AVX512-VNNI CPU) and the model on the vector units ("off"); against sbd_ext.reference in float64,
and each row bit for bit what it is alone (verify's exactness rests on it)."""

import pytest
import torch
from utils import assert_close

import sbd_ext
from sbd_ext import _C
from sbd_ext import reference as R
from sbd_ext.packing import is_bf16_tiles, pack_row_linear_weight, unpack_row_linear_weight

INFO = sbd_ext.build_info()
MODES = ["off"]
if "avx512" in INFO["cpu_isas"] and INFO["cpu_vnni"]:
    MODES.append("emulate")
if INFO["cpu_amx_bf16"]:
    MODES.append("on")


@pytest.fixture(params=MODES)
def mode(request):
    _C.set_cpu_amx(request.param)
    yield request.param
    _C.set_cpu_amx("auto")


def _weight(n, k, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
    return w, pack_row_linear_weight(w, tiles=True)


@pytest.mark.parametrize("k", [1, 2, 31, 32, 97, 576])
def test_pack_round_trip(k):
    w, wt = _weight(48, k)
    assert is_bf16_tiles(wt) and tuple(wt.shape) == (3, (k + 31) // 32, 16, 32)
    assert torch.equal(unpack_row_linear_weight(wt, k=k), w)
    assert not unpack_row_linear_weight(wt)[:, k:].float().any()  # K padded with zeros
    with pytest.raises(TypeError, match="tiles=True is for bf16"):
        pack_row_linear_weight(w.float(), tiles=True)


@pytest.mark.parametrize("n,k", [(16, 32), (48, 97), (64, 576), (32, 1537)])
@pytest.mark.parametrize("m", [1, 2, 7, 16, 17, 33, 40])
def test_matches_reference_and_each_row_alone(mode, n, k, m):
    _, wt = _weight(n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = sbd_ext.row_linear(x, wt)
    assert_close(out, R.row_linear(x, wt), atol=1e-5 * k**0.5, rtol=1e-5)
    alone = torch.cat([sbd_ext.row_linear(x[i : i + 1], wt) for i in range(m)])
    assert torch.equal(alone, out)
    if mode == "off" and "emulate" in MODES:  # the emulated tiles follow the same model, bit for bit
        _C.set_cpu_amx("emulate")
        assert torch.equal(sbd_ext.row_linear(x, wt), out)


def test_rounds_x_to_bf16_and_passes_nan(mode):
    _, wt = _weight(32, 64)
    x = torch.randn(3, 64)
    x_r = x.bfloat16().float()
    assert torch.equal(sbd_ext.row_linear(x, wt), sbd_ext.row_linear(x_r, wt))  # x rounded once, to nearest even
    x[1, 5] = float("nan")
    out = sbd_ext.row_linear(x, wt)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()
    assert sbd_ext.row_linear(x.bfloat16(), wt).dtype == torch.bfloat16


def test_gated_lora_linear_on_tiles(mode):
    """[W; A] in tiles: a gate-0 row is row_linear(x, W) bit for bit; every row is the reference's."""
    n, r, k = 32, 5, 97
    w, _ = _weight(n, k)
    a = torch.randn(r, k).bfloat16()
    wa = pack_row_linear_weight(torch.cat([w, a]), pad=True, tiles=True)
    b = pack_row_linear_weight(torch.randn(n, r))
    x = torch.randn(6, k)
    gate = torch.tensor([0.0, 1.0, 0.0, 0.5, 1.0, 0.0])
    out = sbd_ext.ops.gated_lora_linear(x, wa, b, gate)
    assert_close(out, R.gated_lora_linear(x, wa, b, gate), atol=1e-4, rtol=1e-5)
    base = sbd_ext.row_linear(x, pack_row_linear_weight(w, tiles=True))
    assert torch.equal(out[gate == 0], base[gate == 0])


def test_bad_inputs_and_fake_kernel():
    _, wt = _weight(32, 97)
    with pytest.raises(ValueError, match=r"ceil\(x.size\(1\) / 32\)"):
        sbd_ext.row_linear(torch.randn(2, 64), wt)
    with pytest.raises(ValueError, match="must be contiguous"):
        sbd_ext.row_linear(torch.randn(2, 97), wt.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="scale is for an int8 weight"):
        sbd_ext.row_linear(torch.randn(2, 97), wt, torch.ones(32))
    with pytest.raises(ValueError, match="size"):
        sbd_ext.row_linear(torch.randn(2, 97), wt[:, :, :8].contiguous())
    with torch.device("meta"):
        out = torch.ops.sbd_ext.row_linear(torch.empty(3, 97), torch.empty(2, 4, 16, 32, dtype=torch.bfloat16))
    assert tuple(out.shape) == (3, 32)
    with torch.device("meta"):  # gated_lora_linear's fake over [W; A] in tiles (a compiled drafter step traces it)
        wa, b = torch.empty(3, 4, 16, 32, dtype=torch.bfloat16), torch.empty(2, 5, 16)
        out = torch.ops.sbd_ext.gated_lora_linear(torch.empty(3, 97), wa, b, torch.empty(3))
        assert tuple(out.shape) == (3, 32)
        with pytest.raises(ValueError, match=r"size\(3\) must equal 32"):
            torch.ops.sbd_ext.gated_lora_linear(torch.empty(3, 97), wa[..., :16], b, torch.empty(3))
