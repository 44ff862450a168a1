"""``train_sbd``: :func:`~sbd_ext.training.train_loop` on the SBD objective."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..metadata import (
    DEFAULT_BLOCK_SIZE_RANGE,
    check_block_size_range,
    get_sbd_metadata,
    require_mask_token_id,
    set_sbd_metadata,
)
from ..quantization import check_trainable_weights
from .common import draw_block_size
from .loop import train_loop
from .loss import sbd_loss

__all__ = ["train_sbd"]


def _as_batch(item, device) -> dict:
    if isinstance(item, torch.Tensor):
        return {"input_ids": item.to(device)}
    if isinstance(item, dict):
        return {n: item[n].to(device) for n in ("input_ids", "attention_mask", "labels") if item.get(n) is not None}
    raise TypeError(f"train_sbd: batches must be [B, L] tensors or dicts with 'input_ids', got {type(item)}")


def train_sbd(
    model: torch.nn.Module,
    data: Iterable,
    steps: int,
    lr: float = 3e-4,
    *,
    block_size_range=None,
    mask_token_id: int | None = None,
    generator: torch.Generator | None = None,
    **loop_kwargs,
) -> list[dict]:
    """Train ``model`` on the SBD objective for ``steps`` optimizer steps with :func:`train_loop`.

    data: an iterable of batches, each an input_ids tensor [B, L] or a dict with ``input_ids`` and optionally
    ``attention_mask`` / ``labels``. k is drawn per step in ``block_size_range`` (default: the model's
    ``sbd_block_size_range``, else (2, 16)) from ``generator``, which also draws the masks; the mask token is
    ``mask_token_id`` (default: the model's). Both are recorded in the model's SBD metadata
    (:mod:`sbd_ext.metadata`). Other keywords (``warmup_steps``, ``weight_decay``, ``betas``, ``max_grad_norm``,
    ``log_every``, ``progress``, ``callback``, ``checkpoint``, ...) go to :func:`train_loop`; the history records
    loss, ntp_loss, mask_loss and mask_accuracy.
    """
    check_trainable_weights(model, "train_sbd")
    mask_token_id = require_mask_token_id(model, mask_token_id, "train_sbd")
    if block_size_range is None:
        block_size_range = get_sbd_metadata(model)[1] or DEFAULT_BLOCK_SIZE_RANGE
    lo, hi = check_block_size_range(block_size_range)
    set_sbd_metadata(model, mask_token_id, (lo, hi))
    device = next(model.parameters()).device

    def loss_fn(model, item):
        b = _as_batch(item, device)
        k = draw_block_size((lo, hi), generator)
        return sbd_loss(
            model,
            b["input_ids"],
            mask_token_id=mask_token_id,
            block_size=k,
            generator=generator,
            attention_mask=b.get("attention_mask"),
            labels=b.get("labels"),
            return_parts=True,
        )

    loop_kwargs.setdefault("name", "sbd")
    if generator is not None:
        loop_kwargs.setdefault("rngs", (generator,))
    return train_loop(model, data, loss_fn, steps, lr=lr, **loop_kwargs)
