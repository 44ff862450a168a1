"""Shared test helpers: device list, tolerance table, a comparison that says where values differ."""

from __future__ import annotations

import torch

import sbd_ext

CUDA_OK = torch.cuda.is_available() and sbd_ext.build_info()["cuda"]
DEVICES = ["cpu"] + (["cuda"] if CUDA_OK else [])

# (atol, rtol) against the fp32 reference, per input dtype. fp32: the 1e-5 relative bar. The bf16/fp16
# rows are "within the error of PyTorch's own low-precision run"; tests that need that precise bar measure
# PyTorch's own error and assert against 2x of it (see test_block_attention.py).
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, atol=None, rtol=None, msg: str = ""
):
    """torch.testing.assert_close with the table's tolerances and a report of how many elements differ and where."""
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    assert actual.shape == expected.shape, f"{msg} shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    if actual.is_floating_point():
        a_tol, r_tol = TOL[dtype or expected.dtype] if (atol is None or rtol is None) else (atol, rtol)
        a, e = actual.double(), expected.double()
        bad = ~torch.isclose(a, e, atol=a_tol, rtol=r_tol, equal_nan=True)
        if bad.any():
            idx = bad.nonzero()[:5].tolist()
            err = (a - e).abs().nan_to_num(float("inf"))
            raise AssertionError(
                f"{msg} {int(bad.sum())}/{bad.numel()} elements differ (atol={a_tol}, rtol={r_tol}); "
                f"max abs err {err.max().item():.3g}; first at {idx}: "
                f"got {[a[tuple(i)].item() for i in idx]}, expected {[e[tuple(i)].item() for i in idx]}"
            )
    else:
        bad = actual != expected
        if bad.any():
            idx = bad.nonzero()[:5].tolist()
            raise AssertionError(
                f"{msg} {int(bad.sum())}/{bad.numel()} elements differ; first at {idx}: "
                f"got {[actual[tuple(i)].item() for i in idx]}, expected {[expected[tuple(i)].item() for i in idx]}"
            )
