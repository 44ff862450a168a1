"""topk_logsumexp vs what a sampler head's rescoring ran before it (torch.topk and torch.logsumexp) and vs its
reference, on the CPU (the op is CPU only; other devices run that composite).

Reproduce: OMP_NUM_THREADS=1 pytest bench/ops/bench_topk_logsumexp.py --benchmark-only
Shapes: the rows a verify reveal rescores (1 with the block, 4-8 with the branch and the alternates) x 49152
(SmolLM2's vocabulary) and 128256 (Llama 3's), k = 64 (the shipped sampler head's candidates); logits N(0, 3^2)
(every entry a candidate early on) and LLM-like rows (a bulk ~20 below a few top tokens). The groups name the CPU
kernel variant that ran (sbd_ext.build_info()["cpu_isa"]).
"""

import pytest
import torch

import sbd_ext
from sbd_ext import reference as R

ISA = sbd_ext.build_info()["cpu_isa"]
SHAPES = [(1, 49152), (8, 49152), (1, 128256)]
K = 64


def composite(x):
    """SamplerHead.rescore_'s calls before this op: torch.topk, then torch.logsumexp over the row."""
    v, i = x.topk(K, dim=-1)
    return v, i, x.logsumexp(-1)


def _logits(n, v, kind):
    g = torch.Generator().manual_seed(0)
    if kind == "normal":
        return torch.randn(n, v, generator=g) * 3
    x = torch.randn(n, v, generator=g) * 2 - 20
    return x.scatter_(1, torch.randint(0, v, (n, 5), generator=g), torch.randn(n, 5, generator=g) * 2 + 10)


IMPLS = {
    "ours": lambda x: sbd_ext.ops.topk_logsumexp(x, K),
    "baseline": composite,
    "reference": lambda x: R.topk_logsumexp(x, K),
}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("kind", ["normal", "peaked"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_topk_logsumexp(benchmark, shape, kind, impl):
    x = _logits(*shape, kind)
    benchmark.group = f"topk_logsumexp {shape[0]}x{shape[1]} k={K} {kind} (CPU, {ISA}, {torch.get_num_threads()} thr)"
    benchmark.extra_info["role"] = impl
    benchmark.pedantic(IMPLS[impl], args=(x,), rounds=30 if impl != "reference" else 5, warmup_rounds=2, iterations=1)
