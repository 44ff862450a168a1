"""One eager sbd_ext forward of new rows over a prefilled cache, for the benches that time a forward by its row count
(bench_smollm2.py, bench_cpu_peers.py, profile_forward.py): the rows are a set block (nothing committed), so the
cache stays as it is between calls, and logits are computed for every row, as an SBD forward needs (eager, or the
compiled step's forward: :func:`compiled_block_forward`). And
:func:`decode_settings`: the decoding settings a bench row's name stands for, over a model's shipped settings
(bench_smollm2_sbd.py, bench_cpu_peers.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sbd_ext.cache import SBDCache
from sbd_ext.decoding.compiled import _compiled_forward


def prefilled_cache(model, prefix: torch.Tensor, spare: int = 64) -> SBDCache:
    """An :class:`SBDCache` holding ``prefix`` [1, C] committed by one forward, with room for ``spare`` more rows."""
    n = prefix.shape[1]
    cache = SBDCache(model.config, 1, n + spare)
    with torch.no_grad(), cache.forward_plan([n], [n]) as plan:
        model(
            input_ids=prefix,
            position_ids=torch.arange(n)[None],
            past_key_values=cache,
            use_cache=True,
            sbd_plan=plan,
            logits_to_keep=1,
        )
    return cache


def block_forward(model, cache: SBDCache, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A function running one forward of ``ids`` [1, T] after the cache's rows; returns the [1, T, V] logits."""
    start, rows = cache.seq_lens[0], ids.shape[1]
    pos = torch.arange(start, start + rows)[None]

    def run() -> torch.Tensor:
        with torch.no_grad(), cache.forward_plan([0], [rows]) as plan:  # nothing committed: the cache stays
            return model(
                input_ids=ids,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                sbd_plan=plan,
                logits_to_keep=rows,
            ).logits

    return run


def compiled_block_forward(model, cache: SBDCache, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """:func:`block_forward` through the compiled step's forward (``generate(..., compile=True)``: torch.compile of
    the decoder and head, fullgraph, C++ wrapper on the CPU), the same rows and logits. The first call compiles."""
    start, rows = cache.seq_lens[0], ids.shape[1]
    tokens = torch.stack([ids, torch.arange(start, start + rows)[None]])  # [2, 1, T]: ids, positions
    meta = torch.tensor([[start], [0], [rows]], dtype=torch.int32)  # cache length, committed (none), valid rows
    fwd = _compiled_forward(torch.device("cpu"))

    def run() -> torch.Tensor:
        with torch.no_grad(), cache.static_forwards():
            return fwd(model, cache, tokens, meta, 0)

    return run


def decode_settings(info: dict, impl: str) -> dict:
    """``sbd_ext.generate`` keywords for a bench row named ``impl`` (``..._ntp``, ``..._verify``, ``..._compiled``)
    at the shipped settings in ``info`` (a model's ``sbd_demo.json``: block size, sampler, ``gamma_low``)."""
    return dict(
        block_size=info["block_size"],
        sampler=info["sampler"],
        threshold=info["gamma_low"],
        verify="verify" in impl,
        compile="compiled" in impl,
        mode="ntp" if "ntp" in impl else "sbd",
    )
