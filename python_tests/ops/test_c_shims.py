"""The compiled CPU step calls sbd_ext's ops through C functions (csrc/cpu/aoti_shims.cpp, listed for inductor by
sbd_ext/decoding/c_shims.py) instead of the dispatcher: inductor's C++ wrapper calls them, the results are the ops'
eager results bit for bit (the cache append in place included), an error raised inside one reaches the caller as
an exception, and with ``SBD_EXT_C_SHIMS=0`` the options are inductor's own (the dispatcher)."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from sbd_models import single_thread  # noqa: F401
from torch._inductor.codecache import output_code_log
from torch._inductor.utils import fresh_cache

from sbd_ext.decoding import c_shims, compiled
from sbd_ext.packing import pack_row_linear_int8, pack_row_linear_weight, pack_screened_head
from sbd_ext.quantization import quantize_weight

pytestmark = pytest.mark.usefixtures("single_thread")

OPS = torch.ops.sbd_ext


def _inputs():
    g = torch.Generator().manual_seed(0)
    M, N, K, r = 3, 32, 64, 4
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    w8, sq = quantize_weight(w)
    wq = pack_row_linear_int8(w8)
    a, b = torch.randn(r, K, generator=g), torch.randn(N, r, generator=g) * 0.3
    fused = torch.cat([pack_row_linear_weight(w), pack_row_linear_weight(a, pad=True)])
    gate = torch.tensor([1.0, 0.0, 1.0])
    B, Hkv, grp, T, D, S = 1, 2, 2, 3, 64, 16
    q = torch.randn(B, Hkv * grp, T, D, generator=g)
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    kc, vc = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    lens = torch.tensor([5], dtype=torch.int32)
    commit, valid = torch.tensor([1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    # two projections of 16 outputs with their adapters, one after another (gated_lora_linear's segments)
    segs = torch.cat([pack_row_linear_weight(w[:16]), pack_row_linear_weight(a, pad=True),
                      pack_row_linear_weight(w[16:]), pack_row_linear_weight(a * 0.5, pad=True)])  # fmt: skip
    return [x, pack_row_linear_weight(w), wq, sq, fused, pack_row_linear_weight(b), gate, q, k, v, kc, vc, lens, commit,
            valid, *pack_screened_head(w), segs]  # fmt: skip


def _layer(x, wp, wq, sq, fused, bp, gate, q, k, v, kc, vc, lens, commit, valid, sp, sn, segs):
    a = OPS.row_linear(x, wp, None, False)
    b = OPS.row_linear(x, wq, sq, True)
    c = OPS.gated_lora_linear(x, fused, bp, gate, None)
    o = OPS.block_attention(q, k, v, kc, vc, lens, commit, valid, 0.125, 0.0, -1)
    h = OPS.screened_head(x, wp, sp, sn, 3)
    d = OPS.gated_lora_linear(x, segs, bp, gate, None, [16, 16])
    return a + 1.0, b + 1.0, c + 1.0, o + 1.0, h + 1.0, d + 1.0


def _compiled_code(fn, args):
    """(fn compiled as the CPU step compiles, called on ``args``; the C++ wrapper inductor wrote for it)."""
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    level = output_code_log.level
    output_code_log.addHandler(handler)
    output_code_log.setLevel(logging.DEBUG)
    try:
        with fresh_cache(), torch.no_grad():
            out = torch.compile(
                fn, fullgraph=True, dynamic=False, options=c_shims.cpu_options(compiled.CPU_COMPILE_OPTIONS)
            )(*args)
    finally:
        output_code_log.setLevel(level)
        output_code_log.removeHandler(handler)
    return out, log.getvalue()


def test_the_compiled_step_calls_the_ops_through_their_c_functions_with_the_same_bits():
    assert c_shims.shims_available()
    args = _inputs()
    want_args = [t.clone() for t in args]
    with torch.no_grad():
        want = _layer(*want_args)
    got, code = _compiled_code(_layer, args)
    for op in ("row_linear", "gated_lora_linear", "block_attention", "screened_head"):
        assert f"aoti_torch_cpu_{op}(" in code, op
        assert f'aoti_torch_call_dispatcher("sbd_ext::{op}"' not in code, op
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(args[10], want_args[10]) and torch.equal(args[11], want_args[11])  # the appended caches
    assert not torch.equal(args[10], _inputs()[10])


def test_an_error_inside_a_c_function_reaches_the_caller(capfd):
    """A full cache: only the kernel's run-time check sees it (the lengths' values are not traced). inductor's code
    raises a RuntimeError naming the call; the reason is on stderr."""
    args = _inputs()
    args[12] = torch.tensor([16], dtype=torch.int32)  # no row left for the committed one
    with pytest.raises(RuntimeError, match="aoti_torch_cpu_block_attention"):
        _compiled_code(_layer, args)
    assert "sbd_ext block_attention (compiled step): block_attention: cache overflow" in capfd.readouterr().err


def test_without_the_c_functions_the_options_are_inductors(monkeypatch):
    monkeypatch.setenv("SBD_EXT_C_SHIMS", "0")
    c_shims.shims_available.cache_clear()
    try:
        assert not c_shims.shims_available()
        opts = c_shims.cpu_options(compiled.CPU_COMPILE_OPTIONS)
        assert opts == compiled.CPU_COMPILE_OPTIONS and opts is not compiled.CPU_COMPILE_OPTIONS
        args = _inputs()
        want_args = [t.clone() for t in args]
        with torch.no_grad():
            want = _layer(*want_args)
        got, code = _compiled_code(_layer, args)
        assert 'aoti_torch_call_dispatcher("sbd_ext::row_linear"' in code and "aoti_torch_cpu_row_linear(" not in code
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
    finally:
        monkeypatch.delenv("SBD_EXT_C_SHIMS")
        c_shims.shims_available.cache_clear()
    assert "aot_inductor.custom_ops_to_c_shims" in c_shims.cpu_options(compiled.CPU_COMPILE_OPTIONS)
