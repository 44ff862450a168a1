"""mask_replace vs its pure-PyTorch reference (sbd_ext.reference.mask_replace), per device.

Reproduce: OMP_NUM_THREADS=1 pytest bench/ops/bench_mask_replace.py --benchmark-only -m 'not cuda'
           pytest bench/ops/bench_mask_replace.py -m cuda        (the GPU; how it is timed: bench/ops/cuda_timing.py)
CPU shapes: B blocks of K positions, B in {1, 64}, K in {16, 64}; 70 % of positions masked, entropies U(0, 2) nats, each
rule at its registry default threshold (sbd_ext.samplers). The block is restored before every round (setup), so
every round reveals the same positions. Bytes = B * K * (3 * 8 + 2 * 4): tokens read + written, proposals,
entropy and max_prob read once.
CUDA: B in {1, 16, 64} fully masked blocks of 16, rule eb at 0.35, the block reset before every call (outside the
timed region). Target: < 5 us.
"""

import pytest
import torch
from cuda_timing import CUDA, REF_ROUNDS, ROUNDS, measure

import sbd_ext
from sbd_ext import reference as R
from sbd_ext import samplers

MASK = 3
SHAPES = [(1, 16), (64, 16), (64, 64)]
ISA = sbd_ext.build_info()["cpu_isa"]


def _block(B, K):
    g = torch.Generator().manual_seed(0)
    tokens = torch.where(torch.rand(B, K, generator=g) < 0.7, MASK, torch.randint(10, 1000, (B, K), generator=g))
    proposals = torch.randint(10, 1000, (B, K), generator=g)
    entropy = torch.rand(B, K, generator=g) * 2
    return tokens, proposals, entropy, torch.exp(-entropy)


def _run(benchmark, impl, shape, rule, role):
    B, K = shape
    tokens, proposals, entropy, max_prob = _block(B, K)
    thr = samplers.DEFAULT_THRESHOLDS[rule]
    benchmark.group = f"mask_replace {B}x{K} {rule} (CPU, {ISA})"
    benchmark.extra_info["role"] = role
    work = {}

    def setup():
        work["t"] = tokens.clone()
        return (work["t"], proposals, entropy, max_prob, MASK, rule, thr), {}

    benchmark.pedantic(impl, setup=setup, rounds=50, warmup_rounds=3, iterations=1)
    if benchmark.stats is not None:  # None under --benchmark-disable: nothing was timed
        benchmark.extra_info["GB/s"] = B * K * (3 * 8 + 2 * 4) / benchmark.stats.stats.median / 1e9
    return work["t"]


@pytest.mark.parametrize("rule", samplers.NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_ours(benchmark, shape, rule):
    out = _run(benchmark, sbd_ext.mask_replace, shape, rule, "ours")
    want = _block(*shape)[0]
    R.mask_replace(want, *_block(*shape)[1:], MASK, rule, samplers.DEFAULT_THRESHOLDS[rule])
    assert torch.equal(out, want)


@pytest.mark.parametrize("rule", samplers.NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_reference(benchmark, shape, rule):
    _run(benchmark, R.mask_replace, shape, rule, "reference")


# ---- CUDA ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("impl", ["sbd_ext", "reference"])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_mask_replace(benchmark, device, batch, impl):
    """The GPU cases, CUDA-event timed (cuda_timing.measure); the CPU cases are above."""
    K, mask_id = 16, 0
    tokens = torch.zeros(batch, K, dtype=torch.int64, device=device)
    proposals = torch.randint(1, 1000, (batch, K), device=device)
    ent = torch.rand(batch, K, device=device)
    conf = torch.rand(batch, K, device=device)
    op = sbd_ext.mask_replace if impl == "sbd_ext" else R.mask_replace

    # Every call starts from a fully masked block; the reset runs before the start event.
    measure(
        benchmark,
        "mask_replace",
        impl,
        f"{batch}x{K} eb",
        lambda: op(tokens, proposals, ent, conf, mask_id, "eb", 0.35),
        None,
        rounds=ROUNDS if impl == "sbd_ext" else REF_ROUNDS,
        setup=tokens.zero_,
    )
