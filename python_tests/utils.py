"""Shared test helpers: device list, tolerance table, a comparison that says where values differ."""

from __future__ import annotations

import torch

import sbd_ext
from sbd_ext import reference

CUDA_OK = torch.cuda.is_available() and sbd_ext.build_info()["cuda"]
DEVICES = ["cpu"] + (["cuda"] if CUDA_OK else [])
# The CPU once per kernel variant this machine can run (default / avx2 / avx512), every other device once.
DEVICE_ISAS = [("cpu", isa) for isa in sbd_ext.build_info()["cpu_isas"]] + [(d, None) for d in DEVICES if d != "cpu"]

# (atol, rtol) against the fp32 reference, per input dtype: the one table, in sbd_ext/reference.py.
TOL = reference.TOLERANCES


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


def run_block_attention(**args) -> tuple[torch.Tensor | None, ValueError | None]:
    """torch.ops.sbd_ext.block_attention(**args) on any device: (output, None), or the ValueError it raises.

    Bad lengths raise on the CPU at the call (output None). On CUDA the kernel checks them, returns an output with
    zero rows for the invalid sequences, and the error comes from sbd_ext.ops.check_cuda_errors (output, error).
    """
    try:
        out = torch.ops.sbd_ext.block_attention(**args)
    except ValueError as e:
        return None, e
    try:
        sbd_ext.ops.check_cuda_errors()
    except ValueError as e:
        return out, e
    return out, None
