"""topk_logsumexp against sbd_ext.reference.topk_logsumexp (a stable descending sort and a float64 logsumexp), per
CPU ISA: random rows, ties, -inf, +inf and NaN rows, k from 0 to V, strided rows, threads; bad input refused alike
by the wrapper and the binding; the fake kernel's shapes."""

import math

import pytest
import torch
from sbd_models import num_threads

import sbd_ext
from sbd_ext import reference as R
from sbd_ext.ops import topk_logsumexp


def _check(x, k):
    v, i, lse = topk_logsumexp(x, k)
    rv, ri, rl = R.topk_logsumexp(x, k)
    assert v.shape == i.shape == (x.shape[0], k) and lse.shape == (x.shape[0],)
    assert v.dtype == lse.dtype == torch.float32 and i.dtype == torch.int64
    assert torch.equal(i, ri)  # the order: value descending, equal values lower index first, NaN first
    assert torch.equal(v.nan_to_num(), rv.nan_to_num()) and torch.equal(v.isnan(), rv.isnan())
    torch.testing.assert_close(lse, rl, rtol=2e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("V, k", [(1, 1), (7, 3), (16, 16), (17, 5), (1000, 64), (49152, 64), (49152, 1), (333, 0)])
def test_matches_reference(cpu_isa, V, k):
    g = torch.Generator().manual_seed(V + k)
    _check(torch.randn(3, V, generator=g) * 4, k)


def test_ties_and_infinities(cpu_isa):
    g = torch.Generator().manual_seed(1)
    ties = torch.randint(0, 5, (4, 300), generator=g).float()  # many equal values across the k-th place
    for k in (1, 10, 64, 300):
        _check(ties, k)
    x = torch.randn(5, 200, generator=g)
    x[0] = -math.inf  # all -inf: lse -inf, the first k indices
    x[1, ::3] = -math.inf  # the banned mask token and the like
    x[2, 17] = math.inf  # lse +inf
    x[3, :150] = -math.inf  # fewer finite entries than k
    x[4, 40:60] = 2.5
    for k in (0, 1, 64, 100, 200):
        _check(x, k)


def test_nan_rows(cpu_isa):
    """A NaN ranks above every number (torch.topk's order) and makes the row's lse NaN; other rows are untouched."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 500, generator=g)
    x[1, 7] = x[1, 300] = math.nan
    x[1, 9] = math.inf
    for k in (1, 2, 3, 50):
        _check(x, k)
    v, i, lse = topk_logsumexp(x, 3)
    assert i[1].tolist() == [7, 300, 9] and bool(lse[1].isnan()) and not bool(lse[[0, 2]].isnan().any())


def test_strided_rows_threads_and_empty():
    g = torch.Generator().manual_seed(3)
    big = torch.randn(9, 3000, generator=g)
    x = big[::2, 100:2100]  # rows of stride 6000, contiguous along V
    with num_threads(2):
        two = topk_logsumexp(x, 32)
    one = topk_logsumexp(x.contiguous(), 32)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    _check(x, 32)
    v, i, lse = topk_logsumexp(torch.empty(0, 10), 4)
    assert v.shape == i.shape == (0, 4) and lse.shape == (0,)


@pytest.mark.parametrize(
    "args, err",
    [
        ((torch.randn(3), 1), ValueError),  # not [N, V]
        ((torch.randn(2, 5, dtype=torch.float64), 1), ValueError),
        ((torch.randn(2, 5), 6), ValueError),  # k > V
        ((torch.randn(2, 5), -1), ValueError),
        ((torch.randn(5, 2).t(), 1), ValueError),  # not contiguous along V
    ],
)
def test_bad_input_refused_by_wrapper_and_binding(args, err):
    with pytest.raises(err):
        topk_logsumexp(*args)
    if args[0].dim() == 2 and args[0].dtype == torch.float32 and args[1] <= args[0].shape[1] and args[1] >= 0:
        with pytest.raises(ValueError, match="contiguous"):
            torch.ops.sbd_ext.topk_logsumexp(*args)
    else:
        with pytest.raises(ValueError, match="topk_logsumexp"):
            torch.ops.sbd_ext.topk_logsumexp(*args)
    with pytest.raises(TypeError):
        topk_logsumexp(torch.randn(2, 5), 1.0)


def test_fake_kernel():
    with torch.device("meta"):
        v, i, lse = torch.ops.sbd_ext.topk_logsumexp(torch.empty(4, 100), 7)
    assert v.shape == (4, 7) and i.dtype == torch.int64 and lse.shape == (4,)
    with pytest.raises(ValueError, match="k must be"):
        torch.ops.sbd_ext.topk_logsumexp(torch.empty(4, 100, device="meta"), 101)
    assert "topk_logsumexp" in sbd_ext.ops.__all__
