"""Reading a forward's rows on the host's behalf: the logits of given rows (a view where it can be), slot 1
rescored by a drafter's sampler head, and slot 1's runners-up (verify's alternates). Used by
:mod:`sbd_ext.decoding.step` and :mod:`sbd_ext.decoding.branch`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..ops import topk_logsumexp
from .sampling import ban_mask, sample_block
from .settings import Job

if TYPE_CHECKING:
    from .step import StepLogits

__all__ = ["gather_rows", "rescore_slot1", "runners_up", "sample_rows"]


def gather_rows(out: StepLogits, rows: list[list[int]]) -> torch.Tensor:
    """Logits of absolute forward rows ``rows`` (B lists of R ints, on the host) -> [B, R, V]; rows outside ``out``
    are clamped (their values are never used). Where every sequence reads the same run of consecutive rows (always
    at batch 1) it is a view of ``out.logits`` (a verify forward's two copies of 2-4 rows x 49k logits cost ~0.4 ms
    on one CPU thread), else a copy. The check runs on host ints: right after a forward every torch call is slow
    (its code and data come back from L3 or memory: ~80 us for this check as tensor ops on a Zen 4). Callers write
    it in place (the mask ban) and never read those rows again."""
    logits = out.logits
    top = logits.shape[1] - 1
    rel = [[min(max(r - out.first_row, 0), top) for r in row] for row in rows]
    first, R = rel[0][0], len(rel[0])
    run = list(range(first, first + R))
    if all(row == run for row in rel):
        return logits[:, first : first + R]
    idx = torch.tensor(rel, dtype=torch.int64).to(logits.device)
    return torch.gather(logits, 1, idx.unsqueeze(-1).expand(*idx.shape, logits.shape[2]))


def rescore_slot1(job: Job, x: torch.Tensor, block: torch.Tensor) -> None:
    """Verify with a drafter's sampler head: slot 1's logits (``x`` [B, K, V], in place) rescored given the token in
    slot 0 (``block`` [B, K]), where slot 0 holds a token and slot 1 is still masked; off the CPU no host sync."""
    head, emb = job.sampler_head
    ban_mask(x, job.mask_id)
    t0 = block[:, 0]
    if x.device.type == "cpu":  # the rows read on the host (free there; fewer of the slow calls after a forward)
        m = job.mask_id
        if all(r[0] != m and r[1] == m for r in block[:, :2].tolist()):  # every row rescored: in place
            head.rescore_(x[:, 1], t0, emb)
            return
    cond = (t0 != job.mask_id) & (block[:, 1] == job.mask_id)
    new = head.rescore_(x[:, 1].clone(), torch.where(cond, t0, 0), emb)
    x[:, 1] = torch.where(cond.view(-1, 1), new, x[:, 1])


def runners_up(job: Job, x: torch.Tensor) -> torch.Tensor | None:
    """Verify with alternates: slot 1's ``alternates + 1`` most likely tokens per row of ``x`` [N, K, V] (after the
    sampler head's rescoring; the mask id banned), [N, A + 1]; None without alternates or a slot 1."""
    if not job.alternates or x.shape[1] < 2:
        return None
    slot1 = ban_mask(x[:, 1], job.mask_id)
    if slot1.dtype != torch.float32:
        return slot1.topk(job.alternates + 1, dim=-1).indices
    return topk_logsumexp(slot1, job.alternates + 1)[1]  # on the CPU one kernel call per row (torch.topk elsewhere)


def sample_rows(x: torch.Tensor, block: torch.Tensor, job: Job, f: int, keys: list[int] | None):
    """Blocks ``block`` [N, K] revealed in place from their rows' logits ``x`` [N, K, V] (slot 1 rescored by the
    sampler head first, where the job has one): (n_revealed [N], n_remaining [N], max_prob [N, K], slot 1's
    runners-up [N, A + 1] or None). The block's, the branch's and the alternates' reveal."""
    if job.sampler_head is not None and x.shape[1] >= 2:  # verify: slot 1's draft given slot 0's token
        rescore_slot1(job, x, block)
    top = runners_up(job, x)
    n_rev, n_rem, _, pmax, _ = sample_block(
        x, block, job.mask_id, job.sampler, job.threshold, job.temperature, job.seed, f, keys=keys
    )
    return n_rev, n_rem, pmax, top
