"""The result of a generation: :class:`SBDGenerateOutput` and :func:`finish`, which builds it from the finished
sequences' states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.utils import ModelOutput

from ..cache import SBDCache
from .settings import Job

if TYPE_CHECKING:
    from .state import SequenceState

__all__ = ["SBDGenerateOutput", "finish"]


@dataclass
class SBDGenerateOutput(ModelOutput):
    """Result of :func:`generate` / :func:`generate_reference`.

    sequences: [B, L] int64, row b = its prompt (padding removed) + its generated tokens, right-padded with
        ``pad_token_id``.
    prompt_lengths, num_generated, nfe: [B] int64; nfe = model forwards the sequence took part in (the fused
        prefill included). tokens_per_forward: [B] float, num_generated / nfe.
    trace: per sequence, one ``(forward index, positions revealed, tokens)`` tuple per forward (positions index
        into the row of ``sequences``); only positions kept in the output are listed. None unless return_trace.
    past_key_values: the :class:`SBDCache` (only with ``return_cache=True``; :func:`generate` only).
    num_accepted, num_corrected: [B] int64 (verify mode; zeros otherwise): generated tokens that SBD revealed and
        verification kept, and corrections (each the NTP choice that replaced the first disagreeing token of a
        block, the rest of the block dropped); num_accepted + num_corrected = num_generated.
    corrections: per sequence, the positions (in the row of ``sequences``) of corrected tokens (verify mode).
    """

    sequences: torch.Tensor | None = None
    prompt_lengths: torch.Tensor | None = None
    num_generated: torch.Tensor | None = None
    nfe: torch.Tensor | None = None
    tokens_per_forward: torch.Tensor | None = None
    trace: list | None = None
    past_key_values: SBDCache | None = None
    num_accepted: torch.Tensor | None = None
    num_corrected: torch.Tensor | None = None
    corrections: list | None = None


def finish(seqs: list[SequenceState], job: Job, device, return_trace: bool, cache=None) -> SBDGenerateOutput:
    """The output of a finished generation: the sequences (prompt + generated tokens, right-padded) and counts."""
    B = len(seqs)
    L = max(len(seq.prompt) + len(seq.gen) for seq in seqs)
    out = torch.full((B, L), job.pad_id, dtype=torch.int64)
    for b, seq in enumerate(seqs):
        row = seq.prompt + seq.gen
        out[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
    n_gen = torch.tensor([len(seq.gen) for seq in seqs], dtype=torch.int64)
    nfe = torch.tensor([seq.nfe for seq in seqs], dtype=torch.int64)
    return SBDGenerateOutput(
        sequences=out.to(device),
        prompt_lengths=torch.tensor([len(seq.prompt) for seq in seqs], dtype=torch.int64),
        num_generated=n_gen,
        nfe=nfe,
        tokens_per_forward=n_gen.double() / nfe.clamp_min(1).double(),
        trace=[seq.trace for seq in seqs] if return_trace else None,
        past_key_values=cache,
        num_accepted=torch.tensor(
            [len(seq.gen) - seq.corrected if job.verify else 0 for seq in seqs], dtype=torch.int64
        ),
        num_corrected=torch.tensor([seq.corrected for seq in seqs], dtype=torch.int64),
        corrections=[list(seq.corrections) for seq in seqs],
    )
