"""Verify's alternates (``alternates=A``): the first draft's runners-up, read from each block's slot 1, and the
reveal of the alternates' groups of rows (each a base row at the first draft's position and a block behind it).
Called by :func:`sbd_ext.decoding.step.reveal`; the plan is :func:`sbd_ext.decoding.step.plan_forward`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .sampling import ban_mask, position_key, sample_block, sample_positions
from .settings import Job

if TYPE_CHECKING:
    from .state import SequenceState
    from .step import ForwardRows, StepLogits

__all__ = ["runners_up", "sample_alternates"]


def runners_up(job: Job, x: torch.Tensor) -> torch.Tensor | None:
    """Verify with alternates: slot 1's ``alternates + 1`` most likely tokens per row of ``x`` [N, K, V] (after the
    sampler head's rescoring; the mask id banned), [N, A + 1]; None without alternates or a slot 1."""
    if not job.alternates or x.shape[1] < 2:
        return None
    return ban_mask(x[:, 1], job.mask_id).topk(job.alternates + 1, dim=-1).indices


def sample_alternates(
    out: StepLogits, fw: ForwardRows, seqs: list[SequenceState], job: Job, f: int
) -> list[torch.Tensor]:
    """The alternates' rows (the forward's last ``n_alt_groups * alt_rows``): per group, the NTP choice of its
    first row (a base row: the next token after the alternate, exact) and its block, slot 0 that choice and the
    rest revealed by the sampler as the branch's are. Returns [B, A] choices, [B, A * k] blocks, [B, A * k] max
    probabilities and [B, A * (A + 1)] slot-1 runners-up (zeros without a slot 1); groups a sequence does not
    use read as filler."""
    from .step import _rescore_slot1, gather_rows  # (step imports this module)

    B, S, A, T = len(seqs), fw.alt_rows, fw.n_alt_groups, fw.ids.shape[1]
    k, device = S - 1, out.logits.device
    x = gather_rows(out, (T - A * S + torch.arange(A * S)).view(1, A * S).expand(B, A * S))
    x = x.reshape(B * A, S, x.shape[-1])
    at = fw.branch_at
    pos = [seqs[b].n_cached + at[b] if at[b] else 0 for b in range(B) for _ in range(A)]  # the alternate's position
    valid = torch.tensor([j < len(fw.alts[b]) for b in range(B) for j in range(A)], device=device)
    owner = [b for b in range(B) for _ in range(A)]
    keys = [position_key(b, p + 1) for b, p in zip(owner, pos, strict=True)]  # the first draft row's choice's key
    nxt = sample_positions(ban_mask(x[:, 0], job.mask_id), job.temperature, job.seed, keys)[2]
    block = torch.full((B * A, k), job.mask_id, dtype=torch.int64, device=device)
    block[:, 0] = torch.where(valid & (nxt >= 0), nxt, job.filler)
    block[~valid] = job.filler
    xb = x[:, 1:]
    if job.sampler_head is not None and k >= 2:
        _rescore_slot1(job, xb, block)
    top = runners_up(job, xb)
    top = torch.zeros(B * A, job.alternates + 1, dtype=torch.int64, device=device) if top is None else top
    keys = None
    if job.temperature > 0:  # drafts drawn with the noise their checks will use
        keys = [position_key(b, p + 1 + j) for b, p in zip(owner, pos, strict=True) for j in range(k)]
    _, _, _, pmax, _ = sample_block(
        xb, block, job.mask_id, job.sampler, job.threshold, job.temperature, job.seed, f, keys=keys
    )
    return [nxt.view(B, A), block.view(B, A * k), pmax.reshape(B, A * k), top.view(B, -1)]
