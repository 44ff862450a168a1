"""The host-side state of decoding: :class:`SequenceState`, the per-sequence state machine shared by the cached
decoder and the no-cache reference (what both return is :mod:`sbd_ext.decoding.output`'s)."""

from __future__ import annotations

import torch

from .lookup import NgramIndex
from .settings import Job

LOOKUP_NGRAMS = (4, 2)  # a lookup matches the text's final 4, else 3, else 2 tokens
# A block slot whose own probability is at least this keeps its token against a different lookup proposal (a
# match's continuation is right ~68 % of the time on SmolLM2's chat answers; a task drafter's sure slots are ~97 %).
LOOKUP_YIELD_BELOW = 0.5
# The lookup's drafts per cycle start at this many (or ``lookup``, if smaller); after a cycle whose lookup drafts
# filled the cap and were all accepted the cap doubles (up to ``lookup``), and after a rejected lookup draft it is
# back to this. Each draft is a committed row of the next forward, and on the CPU a row costs about a tenth of a
# SmolLM2 forward at 1 thread (19 rows: 78 ms, 4 rows: 32 ms), so a long proposal pays only in a repetition
# streak. (SmolLM2 drafter, 8 held-out chat prompts x 128, 1 thread, compiled: a fixed lookup of 16 gave 35.8
# tokens/s, 8: 36.3, 4: 38.1-38.3, 2: 37.9.)
LOOKUP_START = 4

__all__ = ["SequenceState", "block_tensor"]


class SequenceState:
    """Host-side state of one sequence: its output, the current block and the pending (uncached) tokens.

    ``pending`` are the tokens after the cached prefix; they are committed (causal rows, K/V written) in the next
    forward. In verify mode the last ``n_draft`` of them are a finished block's unverified tokens (drafts): that
    forward's committed rows also give the next-token (NTP) choice at every draft position, which accepts the
    agreeing prefix and corrects the first disagreement (:meth:`_verify`). Without verify, ``n_draft`` stays 0 and a
    finished block goes straight to the output.
    """

    def __init__(self, prompt: list[int], job: Job):
        self.job = job
        self.prompt = prompt
        self.gen: list[int] = []  # the output (in verify mode: verified tokens only)
        self.pending: list[int] = list(prompt)  # tokens after the cached prefix, committed in the next forward
        self.n_draft = 0  # trailing pending tokens still to verify (verify mode)
        self.block: list[int] = []  # the current block (mask ids where masked); SBD only
        self.block_verified = 0  # leading block positions revealed by the verified NTP choice (verify mode)
        self.done = False
        self.nfe = 0
        self.corrected = 0  # corrections (one per rejected draft suffix)
        self.corrections: list[int] = []  # positions (in the output row) of the corrected tokens
        self.trace: list[tuple[int, list[int], list[int]]] = []
        self.lookup = NgramIndex(*LOOKUP_NGRAMS) if job.verify and job.lookup else None
        self.lookup_cap = min(job.lookup, LOOKUP_START)  # the lookup's drafts this cycle (see LOOKUP_START)
        self.n_looked = 0  # of the pending drafts, how many (after slot 0) the lookup proposed
        self.draft_cap: int | None = None  # most tokens one cycle may draft (a static step's rows); None: any
        self.runners_up: list[int] = []  # the drafter's next choices for the first pending draft (alternates)
        if job.sbd:
            self._start_block()

    @property
    def n_cached(self) -> int:
        return len(self.prompt) + len(self.gen) + self.n_draft - len(self.pending)

    @property
    def block_start(self) -> int:
        return len(self.prompt) + len(self.gen) + self.n_draft

    def anchor(self) -> int:
        """The pending rows up to the last verified token (its row checks the first draft ``pending[anchor]``): 1
        after a finished block (its slot 0, verified, counts among the drafts) or a branch, 2 after an alternate
        (the correction and its row's verified next token)."""
        return max(len(self.pending) - self.n_draft, 1)

    def branch_size(self) -> int:
        """Rows of this sequence's branch in the next forward (verify with ``branch``): the job's branch rows when
        the pending rows are verified tokens followed by drafts (the first draft, ``pending[anchor]``, is checked by
        row ``anchor - 1``, behind which the branch sits), else 0."""
        return self.job.branch_rows if self.n_draft > 0 and len(self.pending) > self.anchor() else 0

    def alternates(self) -> list[int]:
        """The first draft's runners-up the next forward checks beside it (verify with ``alternates``, where it
        has a branch): the drafter's next choices for that position, not the draft, a stop or the mask id."""
        A = self.job.alternates
        if not A or not self.branch_size():
            return []
        first, skip = self.pending[self.anchor()], self.job.stop_ids
        out = []
        for t in self.runners_up:
            if t != first and t not in skip and t != self.job.mask_id and t not in out:
                out.append(t)
        return out[:A]

    def _start_block(self) -> None:
        k = min(self.job.block_size, self.job.max_new_tokens - len(self.gen) - self.n_draft)
        self.block = [self.job.mask_id] * k  # k = 0: the drafts fill the budget, only their verification is left
        self.block_verified = 0

    def _finished(self) -> bool:
        return self.n_draft == 0 and (
            len(self.gen) >= self.job.max_new_tokens or (bool(self.gen) and self.gen[-1] in self.job.stop_ids)
        )

    def _credit(self) -> int:
        """Verify mode: verified tokens so far (the output, plus the block's first position when it came from the
        verified NTP choice) minus forwards taken. A forward that commits drafts yields at least one new verified
        token (the correction, or the next block's first position, or an accepted draft); a forward inside a block
        yields none, so one is taken only with credit >= 1. Then forwards <= verified tokens at every step: verify
        never takes more forwards than NTP decoding of the same output, whatever the model."""
        return len(self.gen) + self.block_verified - self.nfe

    def _revealed_prefix(self, block: list[int]) -> int:
        """The number of leading revealed positions of ``block`` (>= 1 in verify mode: position 0 is revealed by the
        first forward of every block, from the last committed row's NTP choice)."""
        n = next((j for j, t in enumerate(block) if t == self.job.mask_id), len(block))
        if n == 0:
            raise RuntimeError("internal: verify mode drafted a block whose first position is masked")
        return n

    def _cut_trace(self, end: int) -> None:
        """Drop trace entries at positions >= end (tokens that will not be in the output)."""
        self.trace = [
            (g, [p for p in pos if p < end], [t for p, t in zip(pos, tok, strict=True) if p < end])
            for g, pos, tok in self.trace
        ]

    def _verify(self, f: int, ntp: list[int]) -> int | None:
        """Check the drafts against the NTP choices of this forward's committed rows (``ntp[i]`` = the choice for
        the position after pending row i). Returns None when all are accepted, else the number of committed rows
        whose K/V stay valid (the cache length is rolled back to n_cached + that)."""
        base = len(self.pending) - self.n_draft  # row of the first draft
        drafts = self.pending[base:]
        looked, self.n_looked = self.n_looked, 0
        for t, d in enumerate(drafts):
            row = base + t - 1  # the committed row that predicts draft t (t = 0: checked when it was revealed)
            if row >= 0 and (ntp[row] is None or ntp[row] < 0):
                raise RuntimeError(
                    f"verify: sequence got an invalid next-token distribution at forward {f} (NaN or +inf logits)"
                )
            if row >= 0 and d != ntp[row]:
                c = ntp[row]
                if 1 - base <= t <= looked - base:  # a lookup draft was wrong: short proposals again
                    self.lookup_cap = min(self.job.lookup, LOOKUP_START)
                pos = self.block_start - self.n_draft + t
                self._cut_trace(pos)
                self.trace.append((f, [pos], [c]))
                self.corrections.append(pos)
                self.gen.extend(drafts[:t] + [c])
                self.corrected += 1
                self.pending, self.n_draft = [c], 0
                return base + t
        if looked and looked >= self.lookup_cap:  # the cap bound the lookup, and it was right throughout
            self.lookup_cap = min(self.job.lookup, 2 * self.lookup_cap)
        self.gen.extend(drafts)
        self.pending, self.n_draft = [], 0
        return None

    def after_sbd_forward(
        self,
        f: int,
        block: list[int],
        n_rev: int,
        n_rem: int,
        b: int,
        ntp: list[int | None] | None = None,
        confidence: list[float] | None = None,
        branch: list[int] | None = None,
        branch_confidence: list[float] | None = None,
        top: list[int] | None = None,
        branch_top: list[int] | None = None,
        alts: list[tuple] | None = None,
    ) -> int | None:
        """Update after an SBD forward (``block``: the block as revealed in place; ``ntp``, verify mode: the NTP
        choice after each of this sequence's committed rows, None where not computed; ``confidence``, verify with
        lookup: each block slot's probability of its token, None: the lookup always wins; ``branch`` /
        ``branch_confidence``: the same for the branch block behind the anchor, its slot 0 that row's NTP choice,
        when the forward had one; ``top`` / ``branch_top``, verify with alternates: slot 1's most likely tokens in
        the block / the branch; ``alts``: per alternate checked, ``(token, block, confidence, top)``, its block's
        slot 0 the NTP choice of its row). Returns, after a correction, how many of this forward's committed rows
        keep their K/V (the caller rolls the cache back to the length before the forward + that); else None."""
        job = self.job
        self.nfe += 1
        n_commit = len(self.pending)
        if self.n_draft:  # verify mode: this forward committed a finished block's drafts
            anchor = self.anchor()
            keep_rows = self._verify(f, ntp)
            self.runners_up = []
            if keep_rows is not None:
                # The block's predictions of this forward were conditioned on rejected drafts: drop them. The next
                # cycle drafts from the alternate that the correction is, if the first draft was the rejected one
                # and it had one; else from the branch (which sat behind the anchor); else from a new block after
                # the correction.
                self.block = []
                first_rejected = keep_rows == anchor
                alt = next((a for a in alts or () if a[0] == self.pending[0]), None) if first_rejected else None
                if self._finished():
                    self.done = True
                elif alt is not None:  # (``alts``: the ones this forward checked, from :meth:`alternates`)
                    self._take_alternate(f, *alt[1:])
                elif first_rejected and branch and branch[0] == self.pending[0]:
                    self._take_branch(f, branch, branch_confidence, branch_top)
                else:
                    self._start_block()
                return keep_rows
        else:
            self.pending = []  # committed (their K/V cached) by this forward
        if self._finished():  # verify mode: the accepted drafts completed the output
            self.done, self.block = True, []
            return None
        k = len(self.block)
        if k == 0:
            return None
        if job.verify and n_commit > 0:
            last = ntp[n_commit - 1] if ntp is not None and len(ntp) >= n_commit else None
            if last is None or last < 0:  # the row that reveals position 0: the base's own computation decides it
                raise RuntimeError(
                    f"verify: sequence {b} got an invalid next-token distribution at forward {f} (NaN or +inf logits "
                    "in the committed row that decides the next token)"
                )
            self.block_verified = 1  # position 0 was revealed from the last committed row's NTP choice
        block = block[:k]
        # Verify mode: block rows whose logits are invalid (a drafter's NaN / +inf) propose nothing; the block is
        # drafted as far as it is revealed (position 0 at least: the committed row's choice), never an error.
        if n_rem > 0 and n_rev == 0 and not (job.verify and block[0] != job.mask_id):
            raise RuntimeError(
                f"SBD decoding: sequence {b} revealed no token at forward {f} although {n_rem} positions are masked: "
                f"every proposal was invalid (NaN or +inf logits, or all logits -inf once the mask token is banned)"
            )
        revealed = [j for j in range(k) if self.block[j] == job.mask_id and block[j] != job.mask_id]
        self.block = block
        stop = next((j for j in range(k) if block[j] in job.stop_ids and block[j] != job.mask_id), None)
        stopped = stop is not None and all(t != job.mask_id for t in block[:stop])
        if stopped:
            keep = stop + 1
        elif n_rem == 0:
            keep = k
        elif job.verify and (self._credit() < 1 or n_rev == 0):
            # no credit for a forward that commits nothing, or nothing revealed (invalid drafts): draft what we have
            keep = self._revealed_prefix(block)
        else:
            keep = None
        start = self.block_start
        self.trace.append((f, [start + j for j in revealed], [block[j] for j in revealed]))
        if keep is None:
            return None
        if keep < k:
            self._cut_trace(start + keep)  # stopped at a stop token, or a verify draft cut short: the rest is dropped
        extra = []
        if not stopped and self.lookup is not None and self.block_verified:
            old = block[1:keep]
            extra = self._draft_from_context(block, keep, confidence)
            if extra or block[1:keep] != old:  # the drafts after slot 0 are this forward's lookup (and drafter) now
                self._cut_trace(start + 1)
                self.trace.append((f, list(range(start + 1, start + keep + len(extra))), block[1:keep] + extra))
        finished = block[:keep] + extra
        self.block = []
        if job.verify and len(finished) > self.block_verified:
            self.pending, self.n_draft = finished, len(finished)  # checked by the next forward's committed rows
            self.runners_up = list(top or ())
        else:
            self.gen.extend(finished)
            self.pending = finished
        if self._finished():
            self.done = True
        elif not stopped:
            self._start_block()  # (after a stop token only the drafts' verification is left)
        return None

    def _take_alternate(self, f: int, block: list[int], confidence: list[float] | None, top: list[int] | None) -> None:
        """After a correction of the first draft that is one of the alternates checked: that alternate's row was a
        base row at the correction's position, so its NTP choice (its block's slot 0) is verified too and joins the
        output; the block's revealed slots after it are drafts, as the branch's are (:meth:`_take_branch`)."""
        c, nxt = self.pending[0], block[0]
        if nxt < 0:
            raise RuntimeError(f"verify: an alternate's row got an invalid next-token distribution at forward {f}")
        self.trace.append((f, [len(self.prompt) + len(self.gen)], [nxt]))
        self.gen.append(nxt)
        self.pending = [c, nxt]
        if self._finished():  # the budget, or a stop token, ends the output here
            self.done, self.block = True, []
            return
        self._take_branch(f, block, confidence, top, verified=2)

    def _take_branch(
        self,
        f: int,
        branch: list[int],
        confidence: list[float] | None,
        top: list[int] | None = None,
        verified: int = 1,
    ) -> None:
        """After a correction of the first draft: the branch's slot 0 is the correction (the NTP choice of row 0,
        now the output's last token) and its revealed slots after it are drafts for the next forward to check,
        as a finished block's are (with the lookup's proposals from the context ending in the correction).
        ``verified``: the pending tokens that stay (the correction, and an alternate's verified next token)."""
        job = self.job
        room = job.max_new_tokens - len(self.gen)  # drafts that still fit the budget
        if self.draft_cap is not None:
            room = min(room, self.draft_cap - 1)
        keep, stopped = 1, False
        while keep < len(branch) and keep - 1 < room and branch[keep] != job.mask_id:
            keep += 1
            if branch[keep - 1] in job.stop_ids:
                stopped = True
                break
        block = branch[:keep]
        extra = []
        if not stopped and self.lookup is not None:
            extra = self._draft_from_context(block, keep, confidence, context=self.prompt + self.gen, room=room)
        drafts = block[1:] + extra
        if drafts:
            start = len(self.prompt) + len(self.gen)
            self.trace.append((f, list(range(start, start + len(drafts))), list(drafts)))
        self.pending, self.n_draft = self.pending[:verified] + drafts, len(drafts)
        self.runners_up = list(top or ())
        if not stopped:
            self._start_block()

    def _draft_from_context(
        self,
        block: list[int],
        keep: int,
        confidence: list[float] | None,
        context: list[int] | None = None,
        room: int | None = None,
    ) -> list[int]:
        """Verify with ``lookup``: up to ``job.lookup`` drafts from the tokens that followed the latest earlier
        occurrence of the context's final n-gram, the context ending in slot 0 (the verified NTP choice), or, where
        the context has none, the drafter's draft store's chain (``job.draft_store``). Walking
        slots 1..keep-1 of the finished ``block`` (in place), a proposal replaces the slot's token unless the slot
        is sure of a different one (probability >= LOOKUP_YIELD_BELOW): there the block's tokens stay, from that
        slot on. A proposal that covers the block continues past it: returned (drafts past the block). Capped by
        the token budget and ``draft_cap``; a proposal stops before a stop or mask id (no unverified stop in the
        middle of a draft). ``context`` / ``room``: the text the proposal continues and the drafts that fit (default:
        the output + slot 0, and what the budget and ``draft_cap`` leave after slot 0)."""
        if room is None:
            room = self.job.max_new_tokens - len(self.gen) - 1
            if self.draft_cap is not None:
                room = min(room, self.draft_cap - 1)
        m = min(self.lookup_cap, room)
        cont, context = [], self.prompt + self.gen + block[:1] if context is None else context
        proposal = self.lookup.propose(context, m)
        if not proposal and m > 0 and self.job.draft_store is not None:  # nothing in the context: the store's
            proposal = self.job.draft_store.propose(context, m)
        for t in proposal:
            if t in self.job.stop_ids or t == self.job.mask_id:
                break
            cont.append(t)
        for j, t in enumerate(cont[: keep - 1], start=1):
            if t != block[j] and confidence is not None and confidence[j] >= LOOKUP_YIELD_BELOW:
                self.n_looked = j - 1
                return []  # the block is sure of another token: its own from here on
            block[j] = t
        self.n_looked = len(cont)
        return cont[keep - 1 :]

    def after_ntp_forward(self, f: int, token: int, b: int) -> None:
        self.nfe += 1
        if token < 0:
            raise RuntimeError(
                f"NTP decoding: sequence {b} got an invalid next-token distribution at forward {f} (NaN or +inf logits)"
            )
        self.trace.append((f, [self.block_start], [token]))
        self.gen.append(token)
        self.pending = [token]
        if token in self.job.stop_ids or len(self.gen) >= self.job.max_new_tokens:
            self.done = True


def block_tensor(seqs: list[SequenceState], active: list[bool], job: Job) -> torch.Tensor:
    """[B, block_size] int64 on the CPU: each active sequence's block, then a filler that is not the mask id."""
    K, fill = job.block_size, job.filler
    rows = [list(seq.block) if a else [] for seq, a in zip(seqs, active, strict=True)]
    if any(len(r) > K for r in rows):
        raise RuntimeError(f"internal: a block longer than block_size {K}")
    return torch.tensor([r + [fill] * (K - len(r)) for r in rows], dtype=torch.int64).view(len(seqs), K)  # one op
