"""mask_replace on the CPU vs its pure-PyTorch reference (sbd_ext.reference.mask_replace).

Reproduce: OMP_NUM_THREADS=1 pytest bench/bench_mask_replace.py --benchmark-only
Shapes: B blocks of K positions, B in {1, 64}, K in {16, 64}; 70 % of positions masked, entropies U(0, 2) nats, each
rule at its registry default threshold (sbd_ext.samplers). The block is restored before every round (setup), so
every round reveals the same positions. Bytes = B * K * (3 * 8 + 2 * 4): tokens read + written, proposals,
entropy and max_prob read once.
"""

import pytest
import torch

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
