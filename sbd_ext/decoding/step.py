"""One forward of the cached decoder -- plan its rows, run it, reveal from its logits -- and the loop of Alg. 3.

:class:`DecodeStep` is the seam between the loop and how a forward runs: the loop asks the step how many rows a
forward has (:meth:`DecodeStep.rows`), builds the :class:`ForwardRows`, calls the step, and reads the logits
through the :class:`StepLogits` it returns (which rows they hold). :class:`EagerStep` runs the model as is; the
compiled step (:class:`sbd_ext.decoding.compiled.StaticStep`) runs it with static shapes under ``torch.compile``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..cache import SBDCache
from .branch import branch_keys, branch_row_run, branch_tokens, sample_alternates, sample_branch
from .rows import gather_rows, sample_rows
from .sampling import ban_mask, position_key, sample_positions
from .settings import Job
from .state import SequenceState, block_tensor

CONFIDENCE_SCALE = 1_000_000  # the block's max probabilities travel to the host as int64 millionths (one copy)

__all__ = [
    "ForwardRows",
    "StepLogits",
    "DecodeStep",
    "EagerStep",
    "TwoForwardStep",
    "plan_forward",
    "reveal",
    "decode",
]


# --------------------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForwardRows:
    """The rows of one cached forward (host side): per sequence, ``n_commit`` committed rows (the finished block,
    or the prompt, causal; their K/V are written now) followed by the current block's rows (the set block)."""

    ids: torch.Tensor  # [B, T] int64 on the CPU
    pos: torch.Tensor  # [B, T] int64 position ids
    n_commit: list[int]
    n_valid: list[int]
    first_read: int  # the first row whose logits any sequence reads (a step may skip the rows before it)
    # The branch (verify with ``branch``): the last ``branch_rows`` rows of every sequence; ``branch_valid[b]`` of
    # them are real (0: sequence b has none), behind its first committed row.
    branch_rows: int = 0
    branch_valid: tuple[int, ...] = ()
    # Where each sequence's branch sits: behind its first ``branch_at[b]`` committed rows (its anchor; () : 1).
    branch_at: tuple[int, ...] = ()
    # The alternates (verify with ``alternates``): after the branch, ``len(alts[b])`` groups of ``alt_rows`` rows
    # of sequence b (of the forward's ``n_alt_groups``), each the alternate token and a block behind it.
    alt_rows: int = 0
    n_alt_groups: int = 0
    alts: tuple[tuple[int, ...], ...] = ()

    @property
    def branch(self) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
        """``(rows, branch_at, branch_valid)`` for :meth:`SBDCache.forward_plan` (None: no branch rows)."""
        if not self.branch_rows:
            return None
        at = self.branch_at or tuple(1 for _ in self.branch_valid)
        return (
            self.branch_rows,
            tuple(a if v > 0 else 0 for a, v in zip(at, self.branch_valid, strict=True)),
            self.branch_valid,
        )

    @property
    def alternates(self) -> tuple[int, list[list[int]]] | None:
        """``(rows, valid)`` for :meth:`SBDCache.forward_plan` (None: no alternates)."""
        if not self.n_alt_groups:
            return None
        S = self.alt_rows
        return S, [[S if j < len(a) else 0 for a in self.alts] for j in range(self.n_alt_groups)]


@dataclass(frozen=True)
class StepLogits:
    """The logits a step returns: [B, R, V] holding forward rows [first_row, first_row + R) of every sequence, or,
    with ``block_rows_only``, each sequence's block rows [n_commit[b], n_commit[b] + block_size)."""

    logits: torch.Tensor
    first_row: int = 0
    block_rows_only: bool = False


def first_row_read(seq: SequenceState, n_commit: int, job: Job) -> int:
    """The first of this forward's rows whose logits ``seq`` reads (``n_commit`` committed rows)."""
    if not job.sbd:
        return n_commit - 1
    if job.first_from_ntp and n_commit > 0:
        return max(n_commit - seq.n_draft - 1, 0)
    return n_commit


def plan_forward(seqs: list[SequenceState], job: Job, step: DecodeStep) -> ForwardRows:
    """Alg. 3, lines "commit + fill": each active sequence contributes its pending tokens (the block it finished
    last forward, or its prompt) as committed rows, then its current block (SBD). T = ``step.rows`` of the longest
    sequence's rows."""
    active = [not seq.done for seq in seqs]
    n_commit = [len(seq.pending) if a else 0 for seq, a in zip(seqs, active, strict=True)]
    n_block = [len(seq.block) if (a and job.sbd) else 0 for seq, a in zip(seqs, active, strict=True)]
    n_valid = [c + k for c, k in zip(n_commit, n_block, strict=True)]
    # The branch, behind each sequence's first committed row (its last verified token) where the rows after it
    # are drafts: the block the next cycle drafts from if the first draft is rejected (SequenceState._take_branch).
    branch = tuple(seq.branch_size() if a else 0 for seq, a in zip(seqs, active, strict=True))
    R = job.branch_rows if any(branch) or step.static_branch else 0
    anchors = tuple(seq.anchor() if n else 0 for seq, n in zip(seqs, branch, strict=True))
    alts = tuple(tuple(seq.alternates()) if n else () for seq, n in zip(seqs, branch, strict=True))
    A, S = (step.static_alternates if R else 0) or max(map(len, alts), default=0), job.alt_rows
    T = step.rows(max(n_valid))
    if T < max(n_valid):
        raise RuntimeError(f"internal: a forward of {T} rows cannot hold {max(n_valid)} rows")
    # Padding rows at position 0: never widens a dynamic RoPE. Built as lists, one tensor: cheap at small B.
    ids, pos = [], []
    for b, seq in enumerate(seqs):
        row = (seq.pending + (seq.block if job.sbd else [])) if active[b] else []
        pad = [0] * (T - len(row))
        ids.append(row + pad)
        pos.append(list(range(seq.n_cached, seq.n_cached + len(row))) + pad)
        if R:  # the branch's rows: mask slots at the positions after the branch point (the anchor)
            n, at = branch[b], seq.n_cached + anchors[b]
            ids[b] += [job.mask_id] * n + [0] * (R - n)
            pos[b] += list(range(at, at + n)) + [0] * (R - n)
        for j in range(A):  # the alternates: each token at the first draft's position, a block behind it
            if j < len(alts[b]):
                ids[b] += [alts[b][j]] + [job.mask_id] * (S - 1)
                pos[b] += list(range(seq.n_cached + anchors[b], seq.n_cached + anchors[b] + S))
            else:
                ids[b] += [0] * S
                pos[b] += [0] * S
    both = torch.tensor([ids, pos], dtype=torch.int64)
    # Rows read: SBD, block rows [c, c+k) of each sequence; NTP, row c-1; verify, also the committed rows that
    # check the drafts and reveal the block's first position, [c - n_draft - 1, c).
    first = min(first_row_read(seq, c, job) for seq, c, a in zip(seqs, n_commit, active, strict=True) if a)
    return ForwardRows(
        both[0], both[1], n_commit, n_valid, first, R, branch if R else (), anchors if R else (), S if A else 0, A,
        alts if A else (),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------------------
class DecodeStep:
    """One forward over ``cache``: the interface the decoding loop calls (eager or compiled)."""

    cache: SBDCache
    max_drafts: int | None = None  # most drafts a cycle may commit (verify's lookup past the block); None: any
    static_branch: bool = False  # every forward carries the branch's rows (static shapes), used or not
    static_alternates: int = 0  # and this many alternates' groups

    def rows(self, needed: int) -> int:
        """The row count T of a forward whose longest sequence has ``needed`` rows (a static step pads)."""
        return needed

    def __call__(self, fw: ForwardRows) -> StepLogits:
        """Run the forward: the committed rows' K/V are appended to the cache and its lengths advanced."""
        raise NotImplementedError


class EagerStep(DecodeStep):
    """The model's own forward; the output head runs only on the rows from ``fw.first_read`` on."""

    def __init__(self, model, cache: SBDCache, device: torch.device):
        self.model, self.cache, self.device = model, cache, device

    def __call__(self, fw: ForwardRows) -> StepLogits:
        T = fw.ids.shape[1]
        with self.cache.forward_plan(fw.n_commit, fw.n_valid, fw.branch, fw.alternates) as plan:
            logits = self.model(
                input_ids=fw.ids.to(self.device, non_blocking=True),
                position_ids=fw.pos.to(self.device, non_blocking=True),
                past_key_values=self.cache,
                use_cache=True,
                sbd_plan=plan,
                logits_to_keep=T - fw.first_read,
            ).logits
        return StepLogits(logits, first_row=fw.first_read)


class TwoForwardStep(EagerStep):
    """The ablation of Algorithm 3's fused forward: each planned forward runs as TWO forwards, the committed rows
    first (their K/V written to the cache; in verify mode they check the drafts) and then the set-block rows alone
    over the updated cache (the draft), as two-forward speculative schemes do (e.g. Uno: a draft forward, then a
    verify forward). The block rows see the same keys either way, so the tokens equal :class:`EagerStep`'s; only
    the number and size of the forwards differ (``forwards`` counts them)."""

    def __init__(self, model, cache: SBDCache, device: torch.device):
        super().__init__(model, cache, device)
        self.forwards = 0

    def _run(self, ids, pos, n_commit, n_valid, keep: int) -> torch.Tensor:
        self.forwards += 1
        with self.cache.forward_plan(n_commit, n_valid) as plan:
            return self.model(
                input_ids=ids.to(self.device),
                position_ids=pos.to(self.device),
                past_key_values=self.cache,
                use_cache=True,
                sbd_plan=plan,
                logits_to_keep=keep,
            ).logits

    def __call__(self, fw: ForwardRows) -> StepLogits:
        c, v = fw.n_commit, fw.n_valid
        n_block = [vb - cb for cb, vb in zip(c, v, strict=True)]
        if max(c) == 0 or max(n_block) == 0:  # nothing to split
            self.forwards += 1
            return super().__call__(fw)
        B, T = fw.ids.shape
        C, K = max(c), max(n_block)
        first = self._run(fw.ids[:, :C], fw.pos[:, :C], c, c, C)  # the commit rows (verify)
        ids = torch.zeros(B, K, dtype=fw.ids.dtype)
        pos = torch.zeros(B, K, dtype=fw.pos.dtype)
        for b in range(B):
            ids[b, : n_block[b]] = fw.ids[b, c[b] : v[b]]
            pos[b, : n_block[b]] = fw.pos[b, c[b] : v[b]]
        second = self._run(ids, pos, [0] * B, n_block, K)  # the block rows alone (draft)
        logits = first.new_zeros(B, T, first.shape[-1])
        for b in range(B):
            logits[b, : c[b]] = first[b, : c[b]]
            logits[b, c[b] : v[b]] = second[b, : n_block[b]]
        return StepLogits(logits, first_row=0)


# --------------------------------------------------------------------------------------------------------
# reveal
# --------------------------------------------------------------------------------------------------------
def _reveal_ntp(out: StepLogits, fw: ForwardRows, seqs: list[SequenceState], job: Job, f: int) -> None:
    """NTP mode: the next token of every sequence from its last committed row; one device-to-host read."""
    B, V = len(seqs), out.logits.shape[2]
    x = ban_mask(gather_rows(out, [[c - 1] for c in fw.n_commit]).reshape(B, V), job.mask_id)
    keys = [position_key(b, seq.block_start) for b, seq in enumerate(seqs)] if job.temperature > 0 else None
    tok = sample_positions(x, job.temperature, job.seed, keys)[2].tolist()  # the one sync
    for b, seq in enumerate(seqs):
        if not seq.done:
            seq.after_ntp_forward(f, tok[b], b)


def _commit_row_choices(
    out: StepLogits, fw: ForwardRows, seqs: list[SequenceState], job: Job, block: torch.Tensor
) -> tuple[torch.Tensor, list[int]]:
    """The NTP choice after each committed row that the drafts' check needs, rows [lo[b], c[b]) -> ([B, R], lo);
    the last committed row's choice is the token at the block's first position: written into ``block`` now."""
    B, V, device = len(seqs), out.logits.shape[2], out.logits.device
    live = [not seq.done and c > 0 for seq, c in zip(seqs, fw.n_commit, strict=True)]
    lo = [first_row_read(seq, c, job) if ok else 0 for seq, c, ok in zip(seqs, fw.n_commit, live, strict=True)]
    R = max(1, max(c - lb for c, lb in zip(fw.n_commit, lo, strict=True)))
    rows = [list(range(lb, lb + R)) for lb in lo]
    keys = None  # (greedy choices draw no noise)
    if job.temperature > 0:
        keys = [position_key(b, seqs[b].n_cached + r + 1) for b in range(B) for r in rows[b]]
    x = ban_mask(gather_rows(out, rows).reshape(B * R, V), job.mask_id)
    ntp = sample_positions(x, job.temperature, job.seed, keys)[2]
    ntp = ntp.view(B, R)
    last = [max(c - 1 - lb, 0) for c, lb in zip(fw.n_commit, lo, strict=True)]
    if all(v == last[0] for v in last):
        first_tok = ntp[:, last[0]]
    else:
        first_tok = ntp.gather(1, torch.tensor(last, device=device).view(B, 1)).view(B)
    # where the block's first position takes it: a live sequence whose block starts masked (the host's blocks are
    # ``block``'s rows) and a valid choice
    can = [ok and len(seq.block) > 0 and seq.block[0] == job.mask_id for seq, ok in zip(seqs, live, strict=True)]
    if any(can):
        take = first_tok >= 0
        if not all(can):
            take &= torch.tensor(can, device=device)
        block[:, 0] = torch.where(take, first_tok, block[:, 0])
    return ntp, lo


def _reveal_blocks(
    out: StepLogits,
    fw: ForwardRows,
    seqs: list[SequenceState],
    job: Job,
    f: int,
    block: torch.Tensor,
    ntp,
    merge: bool = True,
) -> tuple:
    """The block's reveal, and the branch's where the forward has one: (block, n_revealed, n_remaining, max_prob,
    runners-up, (branch, its max_prob, its runners-up) or None). A branch of the block's size is revealed with the
    block in one pass over their 2B rows (each row's result is its own: the same as two passes, in half the calls;
    at batch 1 the rows are one view when the block's rows end where the branch's begin); ``merge=False``: two."""
    B, K, Rb = len(seqs), job.block_size, fw.branch_rows
    keys = None
    if job.verify and job.temperature > 0:  # drafts drawn with the noise their checks will use
        keys = [position_key(b, seqs[b].block_start + j) for b in range(B) for j in range(K)]
    rows = [list(range(c, c + K)) for c in fw.n_commit]
    if merge and Rb == K and not out.block_rows_only:
        branch = branch_tokens(fw, job, ntp, block.device)
        tail = branch_row_run(fw)
        rows = [r + tail for r in rows]
        x = gather_rows(out, rows).reshape(2 * B, K, -1)  # rows (b, block) and (b, branch) in turn
        both = torch.stack([block, branch], dim=1).view(2 * B, K)
        if keys is not None:
            bk = branch_keys(fw, seqs, job)
            keys = [k for b in range(B) for k in keys[b * K : (b + 1) * K] + bk[b * K : (b + 1) * K]]
        n_rev, n_rem, pmax, top = sample_rows(x, both, job, f, keys)
        both, pmax = both.view(B, 2, K), pmax.view(B, 2, K)
        top = None if top is None else top.view(B, 2, -1)
        first, second = (None, None) if top is None else (top[:, 0], top[:, 1])
        n_rev, n_rem = n_rev.view(B, 2)[:, 0], n_rem.view(B, 2)[:, 0]
        return both[:, 0], n_rev, n_rem, pmax[:, 0], first, (both[:, 1], pmax[:, 1], second)
    x = out.logits if out.block_rows_only else gather_rows(out, rows)  # [B, K, V]
    n_rev, n_rem, pmax, top = sample_rows(x, block, job, f, keys)
    return block, n_rev, n_rem, pmax, top, sample_branch(out, fw, seqs, job, f, ntp) if Rb else None


def reveal(out: StepLogits, fw: ForwardRows, seqs: list[SequenceState], job: Job, f: int) -> dict[int, int]:
    """Alg. 3, "reveal": sample every block position and reveal by the sampler rule in place (SBD; NTP mode: the
    next token); one device-to-host read; each sequence then advances (finished blocks move to the output, or in
    verify mode are checked first). Returns {batch row: committed rows to keep} for sequences whose drafts were
    corrected (the caller rolls their cache length back)."""
    if not job.sbd:
        _reveal_ntp(out, fw, seqs, job, f)
        return {}
    B, K = len(seqs), job.block_size
    block = block_tensor(seqs, [not seq.done for seq in seqs], job).to(out.logits.device)
    ntp, lo = _commit_row_choices(out, fw, seqs, job, block) if job.first_from_ntp else (None, None)
    block, n_rev, n_rem, pmax, top, branched = _reveal_blocks(out, fw, seqs, job, f, block, ntp)
    parts = [n_rev.view(B, 1), n_rem.view(B, 1), block] + ([ntp] if job.verify else [])
    lookup = job.verify and job.lookup > 0
    if lookup:  # the block rows' confidence, which decides between their tokens and the lookup's (in millionths)
        parts.append((pmax * CONFIDENCE_SCALE).round().long())
    Rb, A, n_top = fw.branch_rows, fw.n_alt_groups, job.alternates + 1
    if Rb:  # the branch behind the anchor: its slot 0 is that row's NTP choice, the rest revealed by the sampler
        branch, bpmax, btop = branched
        parts += [branch] + ([(bpmax * CONFIDENCE_SCALE).round().long()] if lookup else [])
    if top is not None:  # verify with alternates: the runners-up of the block's and the branch's slot 1
        parts += [top] + ([btop] if Rb else [])
    if A:  # the alternates' NTP choices, blocks, confidence and runners-up
        alt = sample_alternates(out, fw, seqs, job, f)
        parts += alt[:2] + [(alt[2] * CONFIDENCE_SCALE).round().long(), alt[3]]
    back = torch.cat(parts, dim=1).tolist()  # the one sync, then host lists (each torch call is slow here)
    R = ntp.shape[1] if job.verify else 0  # the columns: n_rev, n_rem, block [K], ntp [R], confidence [K]
    cb = 2 + K + R + (K if lookup else 0)  # then the branch [Rb] and its confidence [Rb]
    ct = cb + (Rb + (Rb if lookup else 0) if Rb else 0)  # then the runners-up [n_top], the branch's [n_top]
    ca = ct + (n_top * (2 if Rb else 1) if top is not None else 0)  # then the alternates' [A], [A k] x 2, [A n_top]
    rollback = {}
    for b, seq in enumerate(seqs):
        if seq.done:
            continue
        ntp_b = conf = br = br_conf = top_b = br_top = alts = None
        if job.verify:
            ntp_b = [None] * lo[b] + back[b][2 + K : 2 + K + R][: fw.n_commit[b] - lo[b]]
        if lookup:
            conf = [c / CONFIDENCE_SCALE for c in back[b][2 + K + R : 2 + 2 * K + R]]
        if Rb and fw.branch_valid[b]:
            br = back[b][cb : cb + fw.branch_valid[b]]
            if lookup:
                br_conf = [c / CONFIDENCE_SCALE for c in back[b][cb + Rb : cb + Rb + fw.branch_valid[b]]]
        if top is not None:
            top_b = back[b][ct : ct + n_top]
            br_top = back[b][ct + n_top : ct + 2 * n_top] if Rb else None
        if A and fw.alts[b]:
            row, k = back[b][ca:], Rb
            alts = []
            for j, token in enumerate(fw.alts[b]):
                blk = row[A + j * k : A + (j + 1) * k]
                a_conf = [c / CONFIDENCE_SCALE for c in row[A + A * k + j * k : A + A * k + (j + 1) * k]]
                a_top = row[A + 2 * A * k + j * n_top : A + 2 * A * k + (j + 1) * n_top]
                alts.append((token, blk, a_conf if lookup else None, a_top))
        keep = seq.after_sbd_forward(
            f,
            back[b][2 : 2 + K],
            back[b][0],
            back[b][1],
            b,
            ntp_b,
            confidence=conf,
            branch=br,
            branch_confidence=br_conf,
            top=top_b,
            branch_top=br_top,
            alts=alts,
        )
        if keep is not None:
            rollback[b] = keep
    return rollback


# --------------------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------------------
def decode(seqs: list[SequenceState], job: Job, step: DecodeStep, f: int = 0, max_forwards: int | None = None) -> int:
    """Alg. 3's loop from forward ``f`` until every sequence is done (or ``max_forwards`` forwards), each forward
    run by ``step`` over ``step.cache``. Returns the next forward index."""
    end = math.inf if max_forwards is None else f + max_forwards
    if step.max_drafts is not None:
        for seq in seqs:
            seq.draft_cap = step.max_drafts
    while f < end and not all(seq.done for seq in seqs):
        fw = plan_forward(seqs, job, step)  # commit the finished block + fill the current one
        lengths = list(step.cache.seq_lens)
        out = step(fw)
        rollback = reveal(out, fw, seqs, job, f)  # reveal; finished blocks move to the output (or are checked)
        for b, keep in rollback.items():  # verify: rows after a correction are overwritten later
            step.cache.rollback(b, lengths[b] + keep)
        f += 1
    return f
