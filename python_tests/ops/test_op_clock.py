"""The CPU ops' own clock (csrc/cpu/op_clock.h, ``sbd_ext._C.set_op_clock`` / ``op_clock``): off by default, each
call of a clocked op counted once in its own slot while on (a call inside another clocked call not again), nothing
counted while off, and a reset that reads and zeroes. The profile suite (bench/report_profile.py) splits a compiled
forward's time with it."""

from __future__ import annotations

import pytest
import torch

import sbd_ext
from sbd_ext import _C

OPS = {"row_linear", "gated_lora_linear", "screened_head", "block_attention", "entropy_sample", "mask_replace",
       "topk_logsumexp"}  # fmt: skip


@pytest.fixture
def clock():
    was = _C.set_op_clock(True)
    _C.op_clock(True)
    yield
    _C.set_op_clock(was)
    _C.op_clock(True)


def _attention(n_cached: int = 5):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 1, 16, generator=g) for h in (4, 2, 2))
    cache = torch.randn(2, 1, 2, 8, 16, generator=g)
    one = torch.ones(1, dtype=torch.int32)
    lens = torch.tensor([n_cached], dtype=torch.int32)
    return sbd_ext.ops.block_attention(q, k, v, cache[0], cache[1], lens, one, one, 0.25, 0.0, -1)


def test_the_clock_is_off_by_default_and_reads_every_op():
    was = _C.set_op_clock(False)
    try:
        assert was is False  # nothing in the package switches it on outside the profile suite
        got = _C.op_clock()
        assert set(got) == OPS
        before = _C.op_clock()["row_linear"]
        sbd_ext.ops.row_linear(torch.randn(2, 8), torch.randn(4, 8))
        assert _C.op_clock()["row_linear"] == before  # off: not counted
    finally:
        _C.set_op_clock(was)


def test_each_call_counts_once_in_its_own_slot(clock):
    x, w = torch.randn(3, 64), torch.randn(32, 64)
    for _ in range(4):
        sbd_ext.ops.row_linear(x, w)
    for _ in range(2):
        _attention()
    # bf16 rows: the op widens them and calls itself; the inner call is not counted again
    sbd_ext.ops.row_linear(x.bfloat16(), w.bfloat16())
    got = _C.op_clock(True)
    assert got["row_linear"][0] == 5 and got["row_linear"][1] > 0
    assert got["block_attention"][0] == 2 and got["block_attention"][1] > 0
    assert all(got[op] == (0, 0.0) for op in OPS - {"row_linear", "block_attention"})
    assert all(c == (0, 0.0) for c in _C.op_clock().values())  # the reset zeroed every slot


def test_a_call_that_raises_is_counted_and_leaves_the_clock_usable(clock):
    with pytest.raises(ValueError, match="row_linear"):
        sbd_ext.ops.row_linear(torch.randn(2, 8), torch.randn(4, 9))  # K mismatch: a clear error
    assert _C.op_clock(True)["row_linear"][0] == 1
    sbd_ext.ops.row_linear(torch.randn(2, 8), torch.randn(4, 8))
    assert _C.op_clock()["row_linear"][0] == 1  # the failed call left no nesting behind


def test_the_time_grows_with_the_work(clock):
    x = torch.randn(1, 512)
    small, big = torch.randn(16, 512), torch.randn(4096, 512)
    for w in (small, big):
        for _ in range(3):
            sbd_ext.ops.row_linear(x, w)
    _C.op_clock(True)
    for _ in range(5):
        sbd_ext.ops.row_linear(x, small)
    t_small = _C.op_clock(True)["row_linear"][1]
    for _ in range(5):
        sbd_ext.ops.row_linear(x, big)
    t_big = _C.op_clock(True)["row_linear"][1]
    assert t_big > 4 * t_small  # 256x the weight: the clock measures the op's body, not a constant
