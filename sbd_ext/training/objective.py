"""The objective a training run optimises, as the loss closure :func:`~sbd_ext.training.train_loop` calls: the SBD
loss (:func:`~sbd_ext.training.sbd_loss`) or plain next-token prediction (:func:`ntp_loss`, the control). The demo
trainer and the SmolLM2 recipe both pick their objective here."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from ..metadata import DEFAULT_BLOCK_SIZE_RANGE
from .loss import sbd_loss

__all__ = ["OBJECTIVES", "ntp_loss", "objective_loss_fn"]

OBJECTIVES = ("sbd", "ntp")


def ntp_loss(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    """The next-token cross-entropy of a causal LM on ``batch`` and its parts (``{"ntp_loss": detached loss}``).

    batch: ``input_ids`` [B, L], ``labels`` [B, L] aligned with the inputs (``IGNORE_INDEX`` = no loss; the model
    shifts them) and optionally ``attention_mask``. The loss is the model's own causal-LM loss (``labels=``: the
    logits in fp32, the mean over the labelled next tokens), so it is what ``model(..., labels=...).loss`` gives."""
    loss = model(
        input_ids=batch["input_ids"],
        attention_mask=batch.get("attention_mask"),
        labels=batch["labels"],
        use_cache=False,
    ).loss
    return loss, {"ntp_loss": loss.detach()}


def objective_loss_fn(
    objective: str,
    *,
    generator: torch.Generator,
    k_rng: random.Random,
    block_size_range: tuple[int, int] = DEFAULT_BLOCK_SIZE_RANGE,
    device: torch.device | str | None = None,
    mask_format: str | None = None,
) -> Callable[[torch.nn.Module, dict], tuple[torch.Tensor, dict]]:
    """``loss_fn(model, batch) -> (loss, parts)`` for :func:`~sbd_ext.training.train_loop` on ``objective``.

    "ntp": :func:`ntp_loss`. "sbd": :func:`~sbd_ext.training.sbd_loss` on the batch's ``input_ids``, ``labels`` and
    ``attention_mask`` (those present), with k drawn per call uniformly in ``block_size_range`` (inclusive) by
    ``k_rng.randint`` and eta and the masks drawn from ``generator``; ``mask_format`` as in sbd_loss (default: what
    the model's attention implementation needs). ``device``: every tensor of the batch is moved there first.
    Pass ``(generator, k_rng)`` as train_loop's ``rngs`` so that a resumed run draws what the uninterrupted one would.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    lo, hi = (int(v) for v in block_size_range)

    def loss_fn(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
        if device is not None:
            batch = {name: value.to(device) for name, value in batch.items()}
        if objective == "ntp":
            return ntp_loss(model, batch)
        return sbd_loss(
            model,
            batch["input_ids"],
            block_size=k_rng.randint(lo, hi),
            generator=generator,
            attention_mask=batch.get("attention_mask"),
            labels=batch.get("labels"),
            mask_format=mask_format,
            return_parts=True,
        )

    return loss_fn
