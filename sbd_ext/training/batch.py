"""The SBD training batch: the 2L input ``cat(x, x_hat)``, its position ids, aligned labels and mask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .common import IGNORE_INDEX
from .mask import sbd_attention_mask

__all__ = ["SBDBatch", "sbd_batch"]


@dataclass
class SBDBatch:
    """One SBD training batch over the 2L input (B sequences of L tokens).

    input_ids [B, 2L]: ``cat(x, x_hat)``. position_ids [B, 2L]: 0..L-1 twice. attention_mask: the SBD mask
    (see :func:`sbd_attention_mask`). labels [B, 2L]: the target read from the output at each position, already
    aligned (no shift left to do): x[t+1] at clean t, x[t] at noisy L+t when masked, ``IGNORE_INDEX`` elsewhere.
    masked [B, L]: which tokens of x_hat are the mask token. eta [B]: the masking rate of each sequence.
    lengths [B]: valid tokens per sequence.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: Any
    labels: torch.Tensor
    masked: torch.Tensor
    eta: torch.Tensor
    lengths: torch.Tensor
    block_size: int
    seq_len: int

    def model_inputs(self) -> dict:
        """Keyword arguments for ``model(**batch.model_inputs())``."""
        return dict(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            attention_mask=self.attention_mask,
            use_cache=False,
        )


def _lengths_from_attention_mask(attention_mask: torch.Tensor, shape) -> torch.Tensor:
    if attention_mask.shape != shape:
        raise ValueError(
            f"attention_mask must be the 2D padding mask [B, L] = {tuple(shape)} of input_ids, got "
            f"{tuple(attention_mask.shape)}"
        )
    am = attention_mask.to(torch.bool)
    if bool((am[:, 1:] & ~am[:, :-1]).any()):
        raise ValueError("attention_mask: SBD training needs right-padded sequences (1s then 0s in every row)")
    lengths = am.sum(-1)
    if bool((lengths == 0).any()):
        raise ValueError("attention_mask: every sequence needs at least one token")
    return lengths


def sbd_batch(
    input_ids: torch.Tensor,
    mask_token_id: int,
    block_size: int,
    *,
    generator: torch.Generator | None = None,
    eta: float | torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    mask_format: str = "bool",
    dtype: torch.dtype = torch.float32,
    noise: torch.Tensor | None = None,
) -> SBDBatch:
    """Build the 2L SBD input, its position ids, aligned labels and attention mask for a batch x [B, L].

    input_ids [B, L] int64. eta: None (draw U(0, 1) per sequence), a float, or a tensor [B]. Each valid token of x
    is replaced by ``mask_token_id`` in x_hat with probability eta of its sequence (the draws come from
    ``generator``, on its device, when given). attention_mask [B, L] (optional): right-padding mask. labels [B, L]
    (optional, HF convention: same positions as input_ids, ``IGNORE_INDEX`` = no loss): the tokens to learn; by
    default input_ids. A label of ``IGNORE_INDEX`` (e.g. a prompt token in SFT data) removes the token from both
    losses; it is still masked in x_hat with the same probability. mask_format / dtype: see
    :func:`sbd_attention_mask`. noise [B, L] (optional): the uniform draws in [0, 1) that decide the masks (a
    token is masked where noise < eta), instead of drawing them from ``generator``.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    B, L = input_ids.shape
    if L < 1 or B < 1:
        raise ValueError(f"input_ids must be non-empty, got shape {tuple(input_ids.shape)}")
    k = int(block_size)
    if k < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    dev = input_ids.device
    input_ids = input_ids.long()

    if attention_mask is None:
        lengths = torch.full((B,), L, dtype=torch.long, device=dev)
    else:
        lengths = _lengths_from_attention_mask(attention_mask.to(dev), input_ids.shape)
    pos = torch.arange(L, device=dev)
    valid = pos.view(1, L) < lengths.view(B, 1)  # [B, L]

    if labels is None:
        labels = input_ids
    elif labels.shape != input_ids.shape:
        raise ValueError(f"labels must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
    labels = labels.to(dev).long().masked_fill(~valid, IGNORE_INDEX)

    gdev = generator.device if generator is not None else dev
    if eta is None:
        eta_t = torch.rand(B, generator=generator, device=gdev).to(dev)
    else:
        eta_t = torch.as_tensor(eta, dtype=torch.float32, device=dev).expand(B).clone()
        if bool(((eta_t < 0) | (eta_t > 1)).any()):
            raise ValueError(f"eta must lie in [0, 1], got {eta}")
    if noise is None:
        u = torch.rand(B, L, generator=generator, device=gdev).to(dev)
    elif tuple(noise.shape) != (B, L):
        raise ValueError(f"noise must have input_ids' shape {(B, L)}, got {tuple(noise.shape)}")
    else:
        u = noise.to(dev, torch.float32)
    masked = (u < eta_t.view(B, 1)) & valid
    noisy = input_ids.masked_fill(masked, int(mask_token_id))

    ntp = torch.full_like(labels, IGNORE_INDEX)
    ntp[:, :-1] = labels[:, 1:]
    mlm = labels.masked_fill(~masked, IGNORE_INDEX)

    attn = sbd_attention_mask(
        L,
        min(k, L),  # one block holds the whole sequence either way; a k past int64 would overflow the mask's ops
        lengths if attention_mask is not None else None,
        batch_size=B,
        mask_format=mask_format,
        dtype=dtype,
        device=dev,
    )
    return SBDBatch(
        input_ids=torch.cat([input_ids, noisy], dim=1),
        position_ids=torch.cat([pos, pos]).view(1, 2 * L).expand(B, 2 * L),
        attention_mask=attn,
        labels=torch.cat([ntp, mlm], dim=1),
        masked=masked,
        eta=eta_t,
        lengths=lengths,
        block_size=k,
        seq_len=L,
    )
