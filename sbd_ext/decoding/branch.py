"""The tail rows of a verify forward: the branch (``branch=True``: a block at the first draft's position, revealed
as the block is) and the alternates (``alternates=A``: per runner-up of the first draft, a base row at its position
and a block behind it). Called by :func:`sbd_ext.decoding.step.reveal`; the plan is
:func:`sbd_ext.decoding.step.plan_forward`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .rows import gather_rows, sample_rows
from .sampling import ban_mask, position_key, sample_positions
from .settings import Job

if TYPE_CHECKING:
    from .state import SequenceState
    from .step import ForwardRows, StepLogits

__all__ = ["branch_keys", "branch_row_run", "branch_tokens", "sample_alternates", "sample_branch"]


def branch_tokens(fw: ForwardRows, job: Job, ntp: torch.Tensor, device) -> torch.Tensor:
    """The branch blocks before their reveal, [B, Rb]: slot 0 the NTP choice of committed row 0 (column 0 of ``ntp``;
    the token after the last verified one: the correction if the first draft is rejected), the other slots masked;
    a sequence without a branch gets a filler that is not the mask id (nothing revealed)."""
    B, Rb = len(fw.n_commit), fw.branch_rows
    valid = torch.tensor(fw.branch_valid).view(B, 1)
    branch = torch.where(torch.arange(Rb).view(1, Rb) < valid, job.mask_id, job.filler).long().to(device)
    first = ntp[:, 0]
    branch[:, 0] = torch.where((valid.view(B) > 0).to(device) & (first >= 0), first, branch[:, 0])
    return branch


def branch_keys(fw: ForwardRows, seqs: list[SequenceState], job: Job) -> list[int] | None:
    """The branch positions' Philox keys where its drafts are drawn with noise (their checks use the same), else
    None."""
    if job.temperature == 0:
        return None
    at = fw.branch_at or (1,) * len(seqs)
    return [position_key(b, seqs[b].n_cached + at[b] + j) for b in range(len(seqs)) for j in range(fw.branch_rows)]


def branch_row_run(fw: ForwardRows) -> list[int]:
    """The branch's rows in the forward, in order (the alternates' rows come after the branch's)."""
    start = fw.ids.shape[1] - fw.branch_rows - fw.n_alt_groups * fw.alt_rows
    return list(range(start, start + fw.branch_rows))


def sample_branch(
    out: StepLogits, fw: ForwardRows, seqs: list[SequenceState], job: Job, f: int, ntp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The branch block of each sequence ([B, Rb] tokens, the slots' max probabilities and slot 1's runners-up):
    :func:`branch_tokens` revealed from the branch rows (the last Rb rows before the alternates') by the sampler, as
    the block is. A sequence with a branch reads its committed rows' choices from row 0 on (``first_row_read`` is 0
    when the rows after row 0 are all drafts), so row 0's choice is column 0 of ``ntp``."""
    B = len(seqs)
    branch = branch_tokens(fw, job, ntp, out.logits.device)
    x = gather_rows(out, [branch_row_run(fw)] * B)
    _, _, pmax, top = sample_rows(x, branch, job, f, branch_keys(fw, seqs, job))
    return branch, pmax, top


def sample_alternates(
    out: StepLogits, fw: ForwardRows, seqs: list[SequenceState], job: Job, f: int
) -> list[torch.Tensor]:
    """The alternates' rows (the forward's last ``n_alt_groups * alt_rows``): per group, the NTP choice of its
    first row (a base row: the next token after the alternate, exact) and its block, slot 0 that choice and the
    rest revealed by the sampler as the branch's are. Returns [B, A] choices, [B, A * k] blocks, [B, A * k] max
    probabilities and [B, A * (A + 1)] slot-1 runners-up (zeros without a slot 1); groups a sequence does not
    use read as filler."""
    B, S, A, T = len(seqs), fw.alt_rows, fw.n_alt_groups, fw.ids.shape[1]
    k, device = S - 1, out.logits.device
    x = gather_rows(out, [list(range(T - A * S, T))] * B)
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
    keys = None
    if job.temperature > 0:  # drafts drawn with the noise their checks will use
        keys = [position_key(b, p + 1 + j) for b, p in zip(owner, pos, strict=True) for j in range(k)]
    _, _, pmax, top = sample_rows(x[:, 1:], block, job, f, keys)
    top = torch.zeros(B * A, job.alternates + 1, dtype=torch.int64, device=device) if top is None else top
    return [nxt.view(B, A), block.view(B, A * k), pmax.reshape(B, A * k), top.view(B, -1)]
