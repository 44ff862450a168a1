"""Streaming: :class:`StreamingState`, a :class:`~sbd_ext.decoding.state.SequenceState` that hands each newly final
run of tokens to a callback the moment the forward that made them final has been read back.

A token is final when no later forward can change or drop it:

* NTP mode and verify mode: the output (``gen``; in verify mode it holds verified tokens only -- drafts wait for the
  forward that checks them);
* plain SBD: the output, then the current block's revealed prefix up to its first masked position (SBD reveals out
  of order: a token after a still-masked position waits). A revealed token is never rewritten, and a stop token in
  that prefix would have finished the block, so the prefix always ends up in the output.

Used only when :func:`~sbd_ext.decoding.api.generate` gets ``on_final_tokens``: the decoding loop is unchanged and
costs nothing more without it.
"""

from __future__ import annotations

from collections.abc import Callable

from .settings import Job
from .state import SequenceState

__all__ = ["StreamingState", "FinalTokensCallback"]

# on_final_tokens(batch row, token ids): the row's next final tokens, in order; called from the decoding thread.
FinalTokensCallback = Callable[[int, list[int]], None]


class StreamingState(SequenceState):
    """A sequence that reports its newly final tokens to ``on_final_tokens(index, ids)`` after every forward."""

    def __init__(self, prompt: list[int], job: Job, index: int, on_final_tokens: FinalTokensCallback):
        super().__init__(prompt, job)
        self.index, self.on_final_tokens = index, on_final_tokens
        self.streamed = 0  # generated tokens already handed out

    def final_tokens(self) -> list[int]:
        """The generated tokens that are final now (see the module docstring)."""
        if self.job.verify or not self.job.sbd or self.done or not self.block:
            return self.gen
        mask = self.job.mask_id
        k = next((j for j, t in enumerate(self.block) if t == mask), len(self.block))
        return self.gen + self.block[:k] if k else self.gen

    def _emit(self) -> None:
        final = self.final_tokens()
        if len(final) > self.streamed:
            new = final[self.streamed :]
            self.streamed = len(final)
            self.on_final_tokens(self.index, new)

    def after_sbd_forward(self, *args, **kwargs) -> int | None:
        keep = super().after_sbd_forward(*args, **kwargs)
        self._emit()
        return keep

    def after_ntp_forward(self, *args, **kwargs) -> None:
        super().after_ntp_forward(*args, **kwargs)
        self._emit()
