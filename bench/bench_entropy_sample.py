"""entropy_sample on the CPU vs its reference and vs the PyTorch composite (log_softmax, entropy, argmax).

Reproduce: pytest bench/bench_entropy_sample.py --benchmark-only
Shapes: 16 x 128256 logits (Llama-3 vocabulary, one 16-token block), fp32 and bf16; 16 x 49152 (SmolLM2).
GB/s = N * V * element size / time (the logits are read once).
"""

import pytest
import torch

import sbd_ext
from sbd_ext import reference as R

SHAPES = [(16, 128256), (16, 49152)]
DTYPES = [torch.float32, torch.bfloat16]


def composite(x):
    """What one writes in PyTorch today: log_softmax, then entropy, max-probability and argmax."""
    lp = torch.log_softmax(x.float(), dim=-1)
    return -(lp.exp() * lp).sum(-1), lp.max(-1).values.exp(), x.argmax(-1)


def _run(benchmark, fn, x, role, name):
    n, v = x.shape
    benchmark.group = f"entropy_sample {n}x{v} {str(x.dtype).replace('torch.', '')} (CPU)"
    benchmark.extra_info["role"] = role
    result = benchmark.pedantic(fn, args=(x,), rounds=30, warmup_rounds=3, iterations=1)
    benchmark.extra_info["GB/s"] = n * v * x.element_size() / benchmark.stats.stats.median / 1e9
    return result


@pytest.fixture(
    scope="module", params=[(s, d) for s in SHAPES for d in DTYPES], ids=lambda p: f"{p[0][0]}x{p[0][1]}-{p[1]}"
)
def logits(request):
    (n, v), dtype = request.param
    return (torch.randn(n, v, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)


def test_ours_greedy(benchmark, logits):
    _run(benchmark, lambda x: sbd_ext.entropy_sample(x), logits, "ours", "greedy")


def test_ours_sampled(benchmark, logits):
    _run(benchmark, lambda x: sbd_ext.entropy_sample(x, 0.8, seed=1, offset=2), logits, "ours-sampling", "sampled")


def test_composite(benchmark, logits):
    _run(benchmark, composite, logits, "baseline", "composite")


def test_reference(benchmark, logits):
    _run(benchmark, lambda x: R.entropy_sample(x), logits, "reference", "reference")
