"""Sampling a forward's logits: :func:`sample_block` (SBD: propose a token per block position with
``entropy_sample``, reveal by the sampler rule with ``mask_replace``) and :func:`sample_positions` (one token per
row with its own position-keyed noise: NTP and verify mode)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import ops

__all__ = ["position_key", "ban_mask", "sample_positions", "sample_block"]


def position_key(b: int, p: int) -> int:
    """The Philox offset of the next-token draw at absolute position ``p`` of batch row ``b`` (NTP mode and verify
    mode): ``b * 2**40 + p``, drawn as row 0 of its own ``entropy_sample`` call. Keyed by position rather than by
    forward, the same (seed, b, p) gives the same noise in every mode, which is what makes verify mode with
    temperature > 0 return exactly NTP mode's sample."""
    return (b << 40) + p


def ban_mask(logits: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    """Set the mask token's logit to -inf in place (last dim): the mask token is never generated, in SBD and NTP
    decoding alike (so verify mode, which checks SBD's drafts against NTP choices, can equal ``mode="ntp"``)."""
    if mask_id is not None:
        logits[..., mask_id] = float("-inf")
    return logits


def sample_positions(
    logits: torch.Tensor, temperature: float, seed: int, keys: Sequence[int] | None, impl=ops
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """entropy_sample of each row of ``logits`` [N, V] with its own Philox offset ``keys[i]`` (see
    :func:`position_key`; None where greedy). Greedy needs no noise: one call."""
    if temperature == 0.0 or logits.shape[0] == 0:
        return impl.entropy_sample(logits, 0.0, seed, 0)
    outs = [impl.entropy_sample(logits[i : i + 1], temperature, seed, int(key)) for i, key in enumerate(keys)]
    return tuple(torch.cat([o[n] for o in outs]) for n in range(3))


def sample_block(
    logits: torch.Tensor,
    block: torch.Tensor,
    mask_id: int,
    sampler: str = "eb",
    threshold: float = 0.35,
    temperature: float = 0.0,
    seed: int = 0,
    offset: int = 0,
    impl=ops,
    keys: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One SBD sampling step: reveal masked positions of ``block`` in place.

    Args:
        logits: [B, K, V] the block positions' logits (read at the positions themselves). Modified: the mask
            token's logit is set to -inf (it is never proposed).
        block: [B, K] int64 block tokens, ``mask_id`` where masked, on logits' device. Modified in place.
        sampler, threshold: the mask_replace rule and its gamma / tau.
        temperature, seed, offset: entropy_sample's; position j of row b draws Philox row ``b * K + j``.
        impl: :mod:`sbd_ext.ops` (kernels) or :mod:`sbd_ext.reference`.
        keys: [B * K] per-position Philox offsets (:func:`position_key`) instead of ``offset`` (verify mode).
    Returns:
        (n_revealed [B], n_remaining [B], entropy [B, K], max_prob [B, K], proposals [B, K]).
    """
    B, K, V = logits.shape
    ban_mask(logits, mask_id)
    if keys is None:
        ent, pmax, tok = impl.entropy_sample(logits.reshape(B * K, V), temperature, seed, offset)
    else:
        ent, pmax, tok = sample_positions(logits.reshape(B * K, V), temperature, seed, keys, impl)
    ent, pmax, tok = ent.view(B, K), pmax.view(B, K), tok.view(B, K)
    n_rev, n_rem = impl.mask_replace(block, tok, ent, pmax, mask_id, sampler, threshold)
    return n_rev, n_rem, ent, pmax, tok
