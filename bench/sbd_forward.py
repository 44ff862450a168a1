"""One eager sbd_ext forward of new rows over a prefilled cache, for the benches that time a forward by its row count
(bench_smollm2.py, bench_cpu_peers.py, profile_forward.py): the rows are a set block (nothing committed), so the
cache stays as it is between calls, and logits are computed for every row, as an SBD forward needs. And
:func:`decode_settings`: the decoding settings a bench row's name stands for, over a model's shipped settings
(bench_smollm2_sbd.py, bench_cpu_peers.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sbd_ext.cache import SBDCache


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
