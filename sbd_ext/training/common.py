"""What every room of :mod:`sbd_ext.training` shares: the ignored-label value and the block-size draw."""

from __future__ import annotations

import torch

from ..metadata import check_block_size_range

__all__ = ["IGNORE_INDEX", "draw_block_size"]

IGNORE_INDEX = -100  # a label that is in no loss (the convention of HF and torch's cross_entropy)


def draw_block_size(block_size_range, generator: torch.Generator | None) -> int:
    """k uniform in ``block_size_range`` (inclusive), drawn from ``generator`` (torch's global RNG when None)."""
    lo, hi = check_block_size_range(block_size_range)
    dev = generator.device if generator is not None else "cpu"
    return int(torch.randint(lo, hi + 1, (1,), generator=generator, device=dev).item())
