"""The CPU ops' outputs from the output pool (csrc/cpu/output_pool.h): a block freed by one output and handed to the
next never aliases a live tensor, the values are the reference's, and a pooled tensor is an ordinary tensor (it
resizes, is freed from another thread, is 64-byte aligned)."""

from __future__ import annotations

import threading

import pytest
import torch

import sbd_ext
from sbd_ext import reference


def _linear(n_out: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_out, k, generator=g), torch.randn(3, k, generator=g)


def test_outputs_kept_alive_are_not_overwritten_by_later_calls():
    # many outputs of the same size class alive at once, then more calls: every kept one still holds its own result
    w, x = _linear(48, 40, 0)
    kept = [sbd_ext.ops.row_linear(x + i, w) for i in range(80)]
    ptrs = {t.data_ptr() for t in kept}
    assert len(ptrs) == len(kept)  # live outputs never share a block
    for i in range(200):  # frees and reuses blocks of the same class
        sbd_ext.ops.row_linear(x - i, w)
    for i, t in enumerate(kept):
        torch.testing.assert_close(t, reference.row_linear(x + i, w), rtol=1e-5, atol=1e-4)


def test_a_freed_block_is_reused_and_its_new_output_is_correct():
    w, x = _linear(64, 32, 1)
    first = sbd_ext.ops.row_linear(x, w)
    ptr = first.data_ptr()
    del first
    again = sbd_ext.ops.row_linear(2 * x, w)
    assert again.data_ptr() == ptr  # the pool handed the freed block back
    torch.testing.assert_close(again, reference.row_linear(2 * x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_out", [16, 1000, 49168, 300_000])  # from the smallest class to past the largest (1 MB)
def test_output_sizes_alignment_and_resize(n_out):
    w, x = _linear(n_out, 8, 2)
    out = sbd_ext.ops.row_linear(x, w)
    assert out.data_ptr() % 64 == 0
    assert out.is_contiguous() and out.shape == (3, n_out) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference.row_linear(x, w), rtol=1e-5, atol=1e-5)
    before = out.clone()
    out.resize_(4, n_out)  # a pooled storage grows through its allocator: the old values kept
    torch.testing.assert_close(out[:3], before)
    out[3] = 1.0
    assert torch.equal(out[:3], before) and bool((out[3] == 1.0).all())


def test_outputs_freed_on_another_thread():
    w, x = _linear(32, 16, 3)
    outs = [sbd_ext.ops.row_linear(x, w) for _ in range(50)]
    t = threading.Thread(target=outs.clear)  # the last references dropped on another thread
    t.start()
    t.join()
    assert outs == []
    res = [sbd_ext.ops.row_linear(x * i, w) for i in range(50)]
    for i, r in enumerate(res):
        torch.testing.assert_close(r, reference.row_linear(x * i, w), rtol=1e-5, atol=1e-5)


def test_block_attention_outputs_from_the_pool_stay_distinct():
    g = torch.Generator().manual_seed(4)
    B, T, Hq, Hkv, D, S = 2, 3, 4, 2, 32, 16
    q = torch.randn(B, Hq, T, D, generator=g)
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    kc, vc = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    lens = torch.tensor([5, 7], dtype=torch.int32)
    ones = torch.full((B,), T, dtype=torch.int32)
    zero = torch.zeros(B, dtype=torch.int32)  # nothing committed: the caches stay as they are
    a = sbd_ext.ops.block_attention(q, k, v, kc, vc, lens, zero, ones)
    b = sbd_ext.ops.block_attention(2 * q, k, v, kc, vc, lens, zero, ones)
    assert a.data_ptr() != b.data_ptr()
    for out, qq in ((a, q), (b, 2 * q)):
        want = reference.block_attention(qq, k, v, kc.clone(), vc.clone(), lens, zero, ones, D**-0.5)
        torch.testing.assert_close(out, want.to(out.dtype), rtol=1e-5, atol=1e-5)
