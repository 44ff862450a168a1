"""block_attention's model features -- logit soft-capping (``softcap``) and the sliding window (``window_left``) --
against sbd_ext.reference.block_attention, and their definitions against transformers' own eager attention and
sliding-window mask.

Same bars as test_block_attention.py: fp32 within 1e-5 (utils.TOL), bf16 / fp16 within the table's tolerance;
every CPU kernel variant with both matrix paths (isa_device), CUDA once where present.
"""

from __future__ import annotations

import math

import pytest
import test_block_attention
import torch
from test_block_attention import OP, lengths, make_inputs
from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from utils import assert_close

import sbd_ext
from sbd_ext import reference

isa_device = test_block_attention.isa_device  # the fixture: every CPU kernel variant and matrix path, CUDA once


def run_both(q, k, v, kc, vc, lens, commit, valid, softcap, window_left, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    out = sbd_ext.block_attention(q, k, v, kc1, vc1, lens, commit, valid, scale, softcap, window_left)
    ref = reference.block_attention(
        q, k, v, kc2, vc2, lens.cpu(), commit.cpu(), valid.cpu(), scale, softcap or 0.0, window_left
    )
    assert torch.equal(kc1.cpu(), kc2.cpu()) and torch.equal(vc1.cpu(), vc2.cpu()), "the append differs"
    return out, ref


# (B, Hkv, g, T, D, cache_lens, n_commit, n_valid): NTP decode, the 2k layout, a batch with padding rows and an
# empty cache, a prefill (several lane panels), an odd head dim (CPU only).
CASES = [
    (1, 2, 1, 1, 64, [257], [1], [1]),
    (1, 2, 4, 32, 128, [257], [16], [32]),
    (3, 2, 4, 16, 64, [0, 1, 200], [16, 5, 0], [16, 9, 3]),
    (1, 1, 4, 150, 64, [20], [150], [150]),
    (2, 1, 3, 6, 40, [100, 3], [3, 0], [6, 6]),
]
# (softcap, window_left): each feature alone and both; a window of one key (0); windows that cut the cache, the new
# rows, or nothing (larger than any position).
FEATURES = [(2.5, -1), (0.0, 0), (0.0, 7), (1.0, 40), (30.0, 100), (0.0, 10**6)]


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: f"cap{f[0]}-w{f[1]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hkv{}-g{}-T{}-D{}-L{}-c{}-v{}".format(*c))
def test_fp32_matches_reference(isa_device, case, features):
    B, Hkv, g, T, D, lens, commit, valid = case
    if isa_device.type == "cuda" and D not in (64, 128):
        pytest.skip("CUDA head dims are 64 and 128")
    softcap, window = features
    q, k, v, kc, vc = make_inputs(B, Hkv, g, T, D, 300, device=isa_device)
    q = q * 3.0  # scores of a few units, so that a cap of 1-2.5 bends them
    L, C, V = (lengths(x, isa_device) for x in (lens, commit, valid))
    out, ref = run_both(q, k, v, kc, vc, L, C, V, softcap, window)
    assert_close(out, ref, msg=f"softcap={softcap} window_left={window}")
    for b in range(B):
        assert not out[b, valid[b] :].any()


def test_features_change_the_result_and_defaults_are_off(isa_device):
    """The parameters are honoured (not dropped), and softcap 0 / None with window_left -1 is the plain op."""
    q, k, v, kc, vc = make_inputs(2, 2, 2, 8, 64, 64, device=isa_device, seed=4)
    q = q * 3.0
    L, C, V = lengths([40, 9], isa_device), lengths([4, 8], isa_device), lengths([8, 8], isa_device)

    def run(*features):
        return sbd_ext.block_attention(q, k, v, kc.clone(), vc.clone(), L, C, V, 0.125, *features)

    plain = run()
    assert_close(run(0.0, -1), plain)
    assert_close(run(None), plain)
    assert_close(run(0.0, 10**9), plain)  # a window past every position hides nothing
    for features in [(1.0, -1), (0.0, 3)]:
        assert (run(*features) - plain).abs().max() > 1e-2, features


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(isa_device, dtype):
    B, Hkv, g, T, D, lens, commit, valid = CASES[2]
    q, k, v, kc, vc = make_inputs(B, Hkv, g, T, D, 300, dtype=dtype, device=isa_device, seed=2)
    q = q * 3.0
    L, C, V = (lengths(x, isa_device) for x in (lens, commit, valid))
    out = sbd_ext.block_attention(q, k, v, kc.clone(), vc.clone(), L, C, V, D**-0.5, 2.0, 9)
    exact = reference.block_attention(
        q.float(), k.float(), v.float(), kc.float(), vc.float(), L.cpu(), C.cpu(), V.cpu(), D**-0.5, 2.0, 9
    )
    assert out.dtype == dtype
    assert_close(out.float(), exact, dtype=dtype)


@pytest.mark.parametrize("threads", [3, 8])
@pytest.mark.parametrize("T", [1, 4])
def test_window_with_cache_splits_reads_no_row_before_it(isa_device, threads, T):
    """A long cache split across threads (partial states merged) under a window: the rows before the first row's
    window are never read (NaN there would show), the rest match the reference."""
    S, Lc, wl = 1500, 1400, 300
    q, k, v, kc, vc = make_inputs(1, 1, 4, T, 64, S, device=isa_device, seed=5)
    L, C, V = lengths([Lc], isa_device), lengths([T // 2], isa_device), lengths([T], isa_device)
    ref = reference.block_attention(q, k, v, kc.clone(), vc.clone(), L.cpu(), C.cpu(), V.cpu(), 0.125, 0.0, wl)
    first = Lc - wl  # new row 0 sits at position Lc and sees keys >= Lc - wl
    kc[:, :, :first] = float("nan")
    vc[:, :, :first] = float("nan")
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = sbd_ext.block_attention(q, k, v, kc, vc, L, C, V, 0.125, 0.0, wl)
    finally:
        torch.set_num_threads(old)
    assert_close(out, ref)


# ---- the definitions are transformers' --------------------------------------------------------------------
class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.training = False


@pytest.mark.parametrize("window", [None, 1, 5, 12])
@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("past,T", [(0, 9), (20, 1), (17, 6)])
def test_matches_transformers_eager_attention(isa_device, window, softcap, past, T):
    """Plain causal rows over a cache (what HF's cached generate computes) equal transformers' eager Gemma-2
    attention under the mask transformers builds (sdpa_mask with its sliding-window mask function, ``kv > q - W``):
    window_left = W - 1, soft-capping after scaling and before the mask."""
    B, Hkv, g, D = 2, 2, 2, 64
    S = past + T
    q, k, v, kc, vc = make_inputs(B, Hkv, g, T, D, S, device=isa_device, seed=past + T)
    q = q * 3.0
    keys, vals = torch.cat([kc[:, :, :past], k], 2), torch.cat([vc[:, :, :past], v], 2)
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    mask = sdpa_mask(B, T, S, q_offset=past, mask_function=fn, allow_is_causal_skip=False, device="cpu")
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    scale = 0.2
    theirs, _ = gemma2_eager(_Module(g), q.cpu(), keys.cpu(), vals.cpu(), additive, scaling=scale, softcap=softcap)
    L, C = lengths([past] * B, isa_device), lengths([T] * B, isa_device)
    wl = -1 if window is None else window - 1
    ours = sbd_ext.block_attention(q, k, v, kc.clone(), vc.clone(), L, C, C, scale, softcap, wl)
    assert_close(ours, theirs, atol=2e-5, rtol=2e-5)


def test_set_block_rows_see_the_block_rows_after_them_within_the_window():
    """The SBD definition: a set-block row at position p sees keys at positions >= p - window_left, block rows after
    it included; a committed row stays causal."""
    mask = reference.block_attention_mask(
        lengths([5], "cpu"), lengths([2], "cpu"), lengths([5], "cpu"), T=5, S=8, window_left=3
    )[0]
    # row i sits at position 5 + i; columns 0..7 cache (positions 0..7, valid < 5), 8..12 new rows (positions 5..9)
    pos = 5 + torch.arange(5).view(-1, 1)
    col_pos = torch.cat([torch.arange(8), 5 + torch.arange(5)]).view(1, -1)
    cache = torch.arange(13).view(1, -1) < 5
    new = ~cache & (torch.arange(13).view(1, -1) >= 8)
    causal_or_block = (col_pos <= pos) | (torch.arange(5).view(-1, 1) >= 2)
    want = (cache | new) & causal_or_block & (col_pos >= pos - 3)
    assert torch.equal(mask, want)


# ---- op contract: schema defaults, fake impl, compile, bad inputs ------------------------------------------
def test_opcheck_and_compile(device):
    q, k, v, kc, vc = make_inputs(2, 2, 2, 4, 64, 16, device=device)
    L, C, V = lengths([3, 0], device), lengths([2, 4], device), lengths([4, 4], device)
    torch.library.opcheck(OP, (q, k, v, kc, vc, L, C, V, 0.125, 2.0, 2))
    torch.library.opcheck(OP, (q, k, v, kc, vc, L, C, V, 0.125))  # the schema's defaults

    def layer(q, k, v, kc, vc, L, C, V):
        return sbd_ext.block_attention(q, k, v, kc, vc, L, C, V, 0.125, 2.0, 2).flatten(2)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert_close(compiled(q, k, v, kc.clone(), vc.clone(), L, C, V), layer(q, k, v, kc.clone(), vc.clone(), L, C, V))


@pytest.mark.parametrize(
    "softcap,window,error,match",
    [
        (float("nan"), -1, ValueError, "softcap must be a finite number >= 0"),
        (-1.0, -1, ValueError, "softcap must be a finite number >= 0"),
        (math.inf, -1, ValueError, "softcap must be a finite number >= 0"),
        (1e39, -1, ValueError, "fits in fp32"),
        (0.0, -2, ValueError, "window_left must be >= 0 .* or -1"),
        (0.0, 2**63, ValueError, "window_left must be >= 0"),
        ("1", -1, TypeError, "softcap must be a number"),
        (0.0, 1.5, TypeError, "window_left must be an integer"),
        (0.0, True, TypeError, "window_left must be an integer, got a bool"),
    ],
)
def test_bad_features(device, softcap, window, error, match):
    q, k, v, kc, vc = make_inputs(1, 1, 2, 2, 64, 8, device=device)
    L, C = lengths([1], device), lengths([2], device)
    with pytest.raises(error, match=match):
        sbd_ext.block_attention(q, k, v, kc, vc, L, C, C, 0.125, softcap, window)
    if error is ValueError and not isinstance(window, int) or (error is ValueError and -(2**63) <= window < 2**63):
        with pytest.raises(ValueError, match="block_attention: "):  # the C++ check says the same without the wrapper
            OP(q, k, v, kc, vc, L, C, C, 0.125, softcap, window)
