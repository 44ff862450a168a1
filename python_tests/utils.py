"""Shared test helpers: device list, tolerance table, a comparison that says where values differ."""

from __future__ import annotations

import pytest
import torch

import sbd_ext
from sbd_ext import reference

CUDA_OK = torch.cuda.is_available() and sbd_ext.build_info()["cuda"]


def cuda_only(test):
    """Mark a test as CUDA-only (``-m cuda`` / ``-k cuda`` select it): skipped without a GPU and the CUDA kernels."""
    skip = pytest.mark.skipif(not CUDA_OK, reason="needs an NVIDIA GPU and sbd_ext built with its CUDA kernels")
    return pytest.mark.cuda(skip(test))


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


# ---- entropy_sample helpers (the op tests and the CUDA emulator tests) ----------------------------------
def entropy_f64(x: torch.Tensor) -> torch.Tensor:
    """The entropy of softmax(x) per row in fp64, relatively accurate however small: log1p(r) + u / (1 + r) with r the
    sum of e^(x - max) over all entries but the argmax and u = sum e^(x - max)(max - x) (no 1 - p rounding)."""
    x = x.double().cpu()
    m, im = x.max(-1, keepdim=True)
    d = m - x
    e = torch.exp(-d)
    r = e.scatter(-1, im, 0.0).sum(-1)
    u = torch.where(e > 0, e * d, 0.0).sum(-1)
    return torch.log1p(r) + u / (1 + r)


def max_prob_f64(x: torch.Tensor) -> torch.Tensor:
    """The largest softmax probability per row in fp64 (NaN for a row with NaN, +inf or only -inf entries)."""
    return torch.softmax(x.double().cpu(), -1).amax(-1)


def expf_error_bound(x: torch.Tensor) -> torch.Tensor:
    """Per row, how far the CUDA kernel's entropy may move because its exponentials are __expf, not expf.

    __expf(-d) has a relative error of at most (2 + 1.173 d) ulp (CUDA programming guide; it rounds -d log2(e) to fp32
    and takes ex2.approx). With p_i = softmax and d_i = max - x_i, H = ln s + sum_i p_i d_i and dH / d(ln e_i) =
    p_i (1 + d_i - E[d]), so relative errors eps_i in the e_i move H by at most sum_i p_i eps_i (1 + d_i + E[d]). For
    a near-one-hot row that is eps relative to H itself (its max term is exact); for a flat row of large d, up to
    ~1e-4 absolute: more than twice the error of an fp32 softmax, which uses an accurate expf.
    """
    x = x.double().cpu()
    d = x.max(-1, keepdim=True).values - x
    p = torch.softmax(x, -1)
    eps = (2 + torch.floor(1.173 * d)) * 2.0**-23
    mean_d = torch.where(p > 0, p * d, 0.0).sum(-1, keepdim=True)
    return torch.where(p > 0, p * eps * (1 + d + mean_d), 0.0).sum(-1)


def near_one_hot_logits(device, dtype=torch.float32) -> torch.Tensor:
    """Rows whose entropy spans 1e-24 .. 1e-2 nats: one max, the rest 15 to 70 below it (e^-70 is still a normal
    fp32), then a row with a tie at the max and one with a runner-up."""
    g = torch.Generator().manual_seed(11)
    rows = []
    for gap in (15.0, 20.0, 25.0, 30.0, 40.0, 60.0):
        for v in (7, 1000, 50000):
            x = -gap - 10 * torch.rand(v, generator=g)
            x[v // 3] = 4.0
            rows.append(x - 4.0)
    x = torch.full((len(rows) + 2, 50000), float("-inf"))
    for i, row in enumerate(rows):
        x[i, : row.numel()] = row
    x[-2, :20] = -25.0  # a max tie: two entries at 0, the rest far below
    x[-2, 5] = x[-2, 17] = 0.0
    x[-1, :1000] = -30.0
    x[-1, 999] = 0.0
    x[-1, 3] = -2.0  # a runner-up
    return x.to(dtype).to(device)


def sampling_cases():
    """Logit rows that exercise every branch of the sampling fast path (sbd/gumbel.h)."""
    g = torch.Generator().manual_seed(2)
    v = 3001  # not a multiple of the 32-entry groups, the 1024-entry tiles or 4 (Philox quads)
    randn = torch.randn(24, v, generator=g) * 3
    # LLM-like: a bulk 20+ below a few top tokens, so most groups and tiles are skipped without Philox
    peaked = torch.randn(24, v, generator=g) * 2 - 20
    peaked[:, torch.randint(0, v, (24, 5), generator=g)] = torch.randn(24, 5, generator=g) * 2 + 10
    flat = torch.zeros(24, v)  # every entry may win: the bounds filter nothing
    ties = torch.randint(0, 3, (24, v), generator=g).float()
    # the best entry late in the row, a ramp of near-winners before it, and banned tokens
    ramp = torch.linspace(-30, 0, v).expand(24, v).clone()
    ramp[:, ::5] = float("-inf")
    return {"randn": randn, "peaked": peaked, "flat": flat, "ties": ties, "ramp": ramp}
