"""Drafts from the context (prompt lookup) for verify mode: where the text repeats itself, the tokens that followed
the last earlier occurrence of its final n-gram are proposed for a block's later slots.

In the one-forward verify cycle a block's first slot comes from the commit row (exact), and the drafter's later
slots are 2-ahead and further predictions made without that token. A lookup runs on the host after the forward, so
it sees the first slot's token: where the context ending in it occurred before (n >= 2 tokens), what followed is a
proposal that is right far more often than a 2-ahead guess (measured on SmolLM2's own chat answers: 68 % of such
proposals, against the drafter's 37 % overall), and where the text repeats a whole phrase the proposal runs past the
block. Verification keeps the output exact whatever the proposal; training-free, as transformers' prompt-lookup
decoding (``prompt_lookup_num_tokens``), here inside SBD's single forward.
"""

from __future__ import annotations

__all__ = ["NgramIndex"]


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
