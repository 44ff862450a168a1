"""row_linear's packed int8 weights on AMX-INT8 tiles (issue 63; csrc/cpu/row_linear_amx_kernel.cpp): where AMX is
usable the tests run the hardware path ("on"); on any AVX512-VNNI CPU they run the same kernel over the extension's
model of the tile instructions ("emulate"), so the layouts and the loop are checked where no AMX exists. Both must
give the VNNI path's bits exactly (integer block sums, the same fp32 epilogue): that is what keeps row_linear batch
invariant when the path is chosen by row count. Elsewhere only the status and the fallback are checked."""

import pytest
import torch
from sbd_models import tiny_llama

import sbd_ext
from sbd_ext import reference as R
from sbd_ext.cache import SBDCache
from sbd_ext.ops import gated_lora_linear
from sbd_ext.packing import pack_row_linear_int8, pack_row_linear_weight
from sbd_ext.quantization import quantize_weight

INFO = sbd_ext.build_info()
MIN_ROWS = INFO["cpu_amx_min_rows"]
_VNNI_AVX512 = "avx512" in INFO["cpu_isas"] and INFO["cpu_vnni"]
MODES = (["emulate"] if _VNNI_AVX512 else []) + (["on"] if INFO["cpu_amx_int8"] else [])


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


@pytest.fixture
def restore_amx():
    yield
    sbd_ext._C.set_cpu_amx("auto")
    sbd_ext._C.set_cpu_isa("")


def _packed_case(M, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    x[:, ::7] *= 30.0  # outlier channels: blocks of very different scales
    q, s = quantize_weight(w)
    qp = pack_row_linear_int8(q, pad=True)
    return x, q, s, qp, torch.nn.functional.pad(s, (0, qp.shape[0] * 16 - N), value=1.0)


def _run(mode, fn):
    """fn() under AMX mode `mode`, and how many weight ranges ran on the tiles."""
    sbd_ext._C.set_cpu_amx(mode)
    before = sbd_ext._C.row_linear_amx_calls()
    out = fn()
    return out, sbd_ext._C.row_linear_amx_calls() - before


def test_status_names_the_cpu_and_the_start_up_mode(restore_amx):
    """Usable only where the CPU reports AMX-INT8; otherwise the reason is given. At start-up (no SBD_EXT_CPU_AMX) the
    mode is "on" exactly where usable."""
    flags = _cpu_flags()
    if "amx_int8" not in flags or "amx_tile" not in flags:
        assert not INFO["cpu_amx_int8"] and "AMX" in INFO["cpu_amx_int8_status"]
    status = INFO["cpu_amx_int8_status"]
    assert (status == "usable") == INFO["cpu_amx_int8"] and status
    assert INFO["cpu_amx"] in ("on", "off", "emulate")
    sbd_ext._C.set_cpu_amx("auto")
    assert sbd_ext.build_info()["cpu_amx"] == ("on" if INFO["cpu_amx_int8"] else "off")


def test_bad_or_unusable_modes_are_refused(restore_amx):
    with pytest.raises(ValueError, match='unknown AMX mode "tiles".*"auto", "off", "on" or "emulate"'):
        sbd_ext._C.set_cpu_amx("tiles")
    if not INFO["cpu_amx_int8"]:
        with pytest.raises(ValueError, match="AMX-INT8 is not usable here: "):
            sbd_ext._C.set_cpu_amx("on")
    if not _VNNI_AVX512:
        with pytest.raises(ValueError, match="emulation runs in the AVX-512 variant"):
            sbd_ext._C.set_cpu_amx("emulate")
    sbd_ext._C.set_cpu_amx("off")
    assert sbd_ext.build_info()["cpu_amx"] == "off"


def test_fallback_without_amx_matches_the_reference(restore_amx):
    """With the tiles off (every CPU) a packed int8 row_linear of many rows takes no tile range and stays within the
    fp32 rounding of the reference's exact integer block sums."""
    if not INFO["cpu_vnni"]:
        pytest.skip("packed int8 weights are used only where the CPU has AVX512-VNNI")
    x, q, s, qp, sp = _packed_case(16, 80, 576, seed=3)
    out, calls = _run("off", lambda: sbd_ext.row_linear(x, qp, sp, quantize_x=True)[:, :80])
    assert calls == 0
    torch.testing.assert_close(out, R.row_linear(x, q, s, quantize_x=True), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("M", [1, 3, 4, 5, 7, 16, 17, 20, 31, 32, 33, 70])  # groups of <= 16 rows; slices of 32
@pytest.mark.parametrize("N, K", [(16, 32), (48, 100), (80, 576), (130, 1537), (64, 1536)])
def test_tiles_give_the_vnni_paths_bits(restore_amx, mode, threads, M, N, K):
    """Rows from cpu_amx_min_rows on run on the tiles (counted), fewer on the VNNI panels; either way every output
    equals the VNNI path's bit for bit, for whole and shorter last blocks, odd panel counts and 1-2 threads."""
    x, _, _, qp, sp = _packed_case(M, N, K, seed=M * 1000 + N + K)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref, ref_calls = _run("off", lambda: sbd_ext.row_linear(x, qp, sp, quantize_x=True))
        out, calls = _run(mode, lambda: sbd_ext.row_linear(x, qp, sp, quantize_x=True))
    finally:
        torch.set_num_threads(old)
    assert ref_calls == 0
    assert (calls > 0) == (M >= MIN_ROWS), f"M={M}: {calls} tile ranges"
    assert torch.equal(out, ref), f"M={M} N={N} K={K}: {(out != ref).sum().item()} outputs differ"


@pytest.mark.parametrize("mode", MODES)
def test_narrower_isa_never_takes_the_tiles(restore_amx, mode):
    """The tiles live in the AVX-512 variant: under the AVX2 or default variant the same call runs no tile range."""
    x, _, _, qp, sp = _packed_case(16, 64, 576, seed=5)
    sbd_ext._C.set_cpu_amx(mode)
    for isa in [i for i in INFO["cpu_isas"] if i != "avx512"]:
        sbd_ext._C.set_cpu_isa(isa)
        _, calls = _run(mode, lambda: sbd_ext.row_linear(x, qp, sp, quantize_x=True))
        assert calls == 0, isa


@pytest.mark.parametrize("mode", MODES)
def test_gated_lora_linear_over_int8_takes_the_tiles_with_the_same_bits(restore_amx, mode):
    """A w8a8 drafter's projection (one row_linear over the packed [W; A], then the gated B step) on the tiles."""
    g = torch.Generator().manual_seed(7)
    M, N, K, r = 9, 64, 192, 16
    x, w, a = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(r, K, generator=g)
    (wq, ws), (aq, as_) = quantize_weight(w), quantize_weight(a)
    ap = pack_row_linear_int8(aq, pad=True)
    weight = torch.cat([pack_row_linear_int8(wq), ap])
    s = torch.cat([ws, torch.nn.functional.pad(as_, (0, ap.shape[0] * 16 - r))])
    lora_b = pack_row_linear_weight(torch.randn(N, r, generator=g) * 0.3)
    gate = torch.tensor([0.0, 1.0] * 4 + [0.5])
    ref, _ = _run("off", lambda: gated_lora_linear(x, weight, lora_b, gate, s))
    out, calls = _run(mode, lambda: gated_lora_linear(x, weight, lora_b, gate, s))
    assert calls > 0 and torch.equal(out, ref)


@pytest.mark.parametrize("mode", MODES)
def test_w8a8_forward_rows_on_the_tiles_equal_the_rows_alone(restore_amx, mode):
    """The whole w8a8 forward (tiny Llama, GQA): each row of a forward of T committed rows on the tiles equals bit
    for bit the same row computed alone with the tiles off -- verify equals NTP across the two paths."""
    m = tiny_llama(n_heads=4, n_kv_heads=2, layers=2, hidden=128, intermediate=256, dtype=torch.float32)
    sbd_ext.quantize(m, "w8a8")
    prompt, rows = 11, 12
    ids = torch.randint(0, 90, (1, prompt + rows), generator=torch.Generator().manual_seed(1))

    def forward(cache, chunk, start):
        T = chunk.shape[1]
        with torch.no_grad(), cache.forward_plan([T], [T]) as plan:
            pos = torch.arange(start, start + T)[None]
            return m(input_ids=chunk, position_ids=pos, past_key_values=cache, sbd_plan=plan).logits[0]

    def prefilled():
        cache = SBDCache(m.config, 1, 256, dtype=torch.float32)
        forward(cache, ids[:, :prompt], 0)
        return cache

    sbd_ext._C.set_cpu_amx("off")
    cache = prefilled()
    alone = [forward(cache, ids[:, prompt + i : prompt + i + 1], prompt + i)[0] for i in range(rows)]
    out, calls = _run(mode, lambda: forward(prefilled(), ids[:, prompt:], prompt))
    assert calls > 0
    same = [torch.equal(out[i], alone[i]) for i in range(rows)]
    assert all(same), f"{same.count(False)} of {rows} rows differ from the row computed alone"
