"""Drafts from the context (prompt lookup) for verify mode: where the text repeats itself, the tokens that followed
the last earlier occurrence of its final n-gram are proposed for a block's later slots.

In the one-forward verify cycle a block's first slot comes from the commit row (exact), and the drafter's later
slots are 2-ahead and further predictions made without that token. A lookup runs on the host after the forward, so
it sees the first slot's token: where the context ending in it occurred before (n >= 2 tokens), what followed is a
proposal that is right far more often than a 2-ahead guess (measured on SmolLM2's own chat answers: 68 % of such
proposals, against the drafter's 37 % overall), and where the text repeats a whole phrase the proposal runs past the
block. Verification keeps the output exact whatever the proposal; training-free, as transformers' prompt-lookup
decoding (``prompt_lookup_num_tokens``), here inside SBD's single forward.

Where the context has no earlier occurrence, a drafter may carry a second source, a :class:`DraftStore`: a frozen
table from n-grams to the token that most often followed them in a corpus of the base's own answers (retrieval
drafts, as REST), built once from the drafter's training data and shipped with it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

import torch

__all__ = ["DraftStore", "NgramIndex"]


class NgramIndex:
    """The most recent earlier occurrence of each n-gram (``n_min <= n <= n_max``) of a token list that only grows.

    :meth:`propose` takes the whole context each call (the previous call's context must be a prefix of it: the
    verified output only grows) and indexes just the new tokens, so each call costs O(new tokens x n sizes).
    """

    def __init__(self, n_max: int, n_min: int = 2):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"NgramIndex: need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest indexed occurrence
        self._done = 0  # n-grams ending before this index are indexed (each needs the token after it)

    def propose(self, ctx: list[int], m: int) -> list[int]:
        """Up to ``m`` tokens that followed the latest earlier occurrence of the longest final n-gram of ``ctx``
        ([] when none occurred before)."""
        for end in range(self._done, len(ctx) - 1):  # n-grams ctx[end-n+1 : end+1] whose follower is known
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self._next[tuple(ctx[end - n + 1 : end + 1])] = end + 1
        self._done = max(self._done, len(ctx) - 1)
        if m <= 0:
            return []
        for n in range(min(self.n_max, len(ctx)), self.n_min - 1, -1):
            j = self._next.get(tuple(ctx[-n:]))
            if j is not None:
                return ctx[j : j + m]
        return []


class DraftStore:
    """A frozen table n-gram -> next token (``n_min <= n <= n_max``), the token that most often followed the n-gram
    in a corpus (see :meth:`from_sequences`). :meth:`propose` chains it: the longest final n-gram of the context in
    the table gives the next token, which is appended, and so on.

    ``keys`` [N, n_max] (integer; an n-gram of n < n_max tokens left-padded with -1) and ``next_ids`` [N] are the
    table as stored (:meth:`tensors`); every key distinct, every id in ``[0, vocab)`` where ``vocab`` is given."""

    def __init__(self, keys: torch.Tensor, next_ids: torch.Tensor, n_min: int = 2, vocab: int | None = None):
        if not isinstance(keys, torch.Tensor) or not isinstance(next_ids, torch.Tensor):
            raise TypeError("DraftStore: keys and next_ids must be tensors")
        if keys.dim() != 2 or next_ids.dim() != 1 or keys.shape[0] != next_ids.shape[0] or keys.shape[1] < 1:
            raise ValueError(
                f"DraftStore: keys [N, n_max] and next_ids [N], got {tuple(keys.shape)} / {tuple(next_ids.shape)}"
            )
        if any(t.is_floating_point() or t.is_complex() or t.dtype == torch.bool for t in (keys, next_ids)):
            raise ValueError(f"DraftStore: keys and next_ids must be integer, got {keys.dtype} / {next_ids.dtype}")
        n_max = keys.shape[1]
        if not 1 <= n_min <= n_max:
            raise ValueError(f"DraftStore: need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        keys, next_ids = keys.long(), next_ids.long()
        ids = f"token ids in [0, {'vocab' if vocab is None else vocab})"
        if next_ids.numel() and (int(next_ids.min()) < 0 or (vocab is not None and int(next_ids.max()) >= vocab)):
            raise ValueError(f"DraftStore: next_ids must be {ids}")
        pad = keys < 0
        if bool((keys < -1).any()) or (vocab is not None and keys.numel() and int(keys.max()) >= vocab):
            raise ValueError(f"DraftStore: keys must be {ids} or -1")
        n = n_max - pad.sum(1)
        if bool((pad[:, 1:] & ~pad[:, :-1]).any()) or bool((n < n_min).any()):
            raise ValueError(f"DraftStore: each key is n_min={n_min}..{n_max} ids, left-padded with -1")
        self.n_min, self.n_max = n_min, n_max
        self._table = {
            tuple(k[n_max - int(m) :]): int(t) for k, m, t in zip(keys.tolist(), n, next_ids.tolist(), strict=True)
        }
        if len(self._table) != keys.shape[0]:
            raise ValueError("DraftStore: keys must be distinct")

    def __len__(self) -> int:
        return len(self._table)

    @classmethod
    def from_sequences(
        cls,
        seqs: Iterable[Iterable[int]],
        n_max: int = 4,
        n_min: int = 2,
        min_count: int = 3,
        min_share: float = 0.6,
    ) -> DraftStore:
        """The store of token lists ``seqs``: each n-gram whose most frequent follower (the first seen among equal
        counts) followed it at least ``min_count`` times and in at least ``min_share`` of its occurrences."""
        if not 1 <= n_min <= n_max or min_count < 1 or not 0 <= min_share <= 1:
            raise ValueError(
                f"DraftStore.from_sequences: need 1 <= n_min <= n_max, min_count >= 1, 0 <= min_share <= 1; got "
                f"n_min={n_min}, n_max={n_max}, min_count={min_count}, min_share={min_share}"
            )
        counts: defaultdict[tuple[int, ...], Counter] = defaultdict(Counter)
        for seq in seqs:
            s = [int(t) for t in seq]
            for end in range(len(s) - 1):
                for n in range(n_min, min(n_max, end + 1) + 1):
                    counts[tuple(s[end - n + 1 : end + 1])][s[end + 1]] += 1
        keys, nxt = [], []
        for gram, c in counts.items():
            tok, k = c.most_common(1)[0]
            if k >= min_count and k >= min_share * sum(c.values()):
                keys.append([-1] * (n_max - len(gram)) + list(gram))
                nxt.append(tok)
        return cls(torch.tensor(keys, dtype=torch.long).view(-1, n_max), torch.tensor(nxt, dtype=torch.long), n_min)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, next_ids)`` as int32 tensors (the constructor's input; keys in insertion order)."""
        keys = [[-1] * (self.n_max - len(g)) + list(g) for g in self._table]
        return (
            torch.tensor(keys, dtype=torch.int32).view(-1, self.n_max),
            torch.tensor(list(self._table.values()), dtype=torch.int32),
        )

    def propose(self, ctx: list[int], m: int) -> list[int]:
        """Up to ``m`` tokens: the follower of the longest final n-gram of ``ctx`` (+ the tokens proposed so far)
        in the table, repeated until no final n-gram is in it."""
        out, c = [], list(ctx[-self.n_max :])
        while len(out) < m:
            for n in range(min(self.n_max, len(c)), self.n_min - 1, -1):
                t = self._table.get(tuple(c[-n:]))
                if t is not None:
                    break
            else:
                break
            out.append(t)
            c = c[1:] + [t] if len(c) == self.n_max else c + [t]
        return out
