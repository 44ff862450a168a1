"""screened_head (greedy decoding's head over a bf16 screen) vs what a packed fp32 head ran before it (row_linear over
its fp32 panels), vs the screen alone (row_linear over the bf16 panels: the floor, without the fp32 recompute and the
bound's sweeps) and vs its reference, on the CPU.

Reproduce: OMP_NUM_THREADS=1 pytest bench/ops/bench_screened_head.py --benchmark-only
Shapes: SmolLM2-135M's head (49152 x 576) and a Llama-3.2-1B-sized one (128256 x 2048), random rows N(0, 9 / K);
1 row (greedy NTP) and 6 (a verify + branch forward); x pointing at head rows (x = 40 w_j / |w_j|, a decoder's peaked
state: one or two fp32 panels run again). The groups name the CPU kernel variant (sbd_ext.build_info()["cpu_isa"]).
"""

import pytest
import torch

import sbd_ext
from sbd_ext import reference as R
from sbd_ext.ops import row_linear, screened_head
from sbd_ext.packing import pack_row_linear_weight, pack_screened_head

ISA = sbd_ext.build_info()["cpu_isa"]
SHAPES = [(49152, 576), (128256, 2048)]
_HEADS: dict = {}


def _head(n, k):
    if (n, k) not in _HEADS:
        _HEADS.clear()  # one head in memory at a time (the larger: 1 GB fp32 + 0.5 GB screen)
        g = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=g) * (3 / k**0.5)
        _HEADS[(n, k)] = (w, pack_row_linear_weight(w, pad=True), *pack_screened_head(w))
    return _HEADS[(n, k)]


IMPLS = {
    "ours": lambda x, w, wp, sp, sn: screened_head(x, wp, sp, sn),
    "baseline": lambda x, w, wp, sp, sn: row_linear(x, wp),
    "screen alone": lambda x, w, wp, sp, sn: row_linear(x, sp),
    "reference": lambda x, w, wp, sp, sn: R.screened_head(x, wp, sp, sn),
}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_screened_head(benchmark, shape, rows, impl):
    w, wp, sp, sn = _head(*shape)
    picks = torch.arange(rows) * 7919 % shape[0]
    x = (w[picks] * (40 / w[picks].norm(dim=1, keepdim=True))).contiguous()
    benchmark.group = f"screened_head {shape[0]}x{shape[1]}, {rows} row(s) (CPU, {ISA}, {torch.get_num_threads()} thr)"
    benchmark.extra_info["role"] = impl
    slow = impl == "reference"
    benchmark.pedantic(IMPLS[impl], args=(x, w, wp, sp, sn), rounds=3 if slow else 20, warmup_rounds=1, iterations=1)
    if impl == "ours":  # the fp32 head's choice
        assert torch.equal(screened_head(x, wp, sp, sn).argmax(1), row_linear(x, wp).argmax(1))
