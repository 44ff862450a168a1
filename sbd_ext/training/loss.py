"""The SBD loss: NTP cross-entropy on the clean half plus cross-entropy on the masked positions of the noisy half,
from one forward over the 2L batch."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..metadata import DEFAULT_BLOCK_SIZE_RANGE, get_sbd_metadata, require_mask_token_id, unwrap_model
from .batch import SBDBatch, sbd_batch
from .common import IGNORE_INDEX, draw_block_size
from .mask import mask_format_for

__all__ = ["sbd_loss", "sbd_loss_from_logits"]


def sbd_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    mask_token_id: int | None = None,
    block_size: int | None = None,
    block_size_range=None,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    eta: float | torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    mask_format: str | None = None,
    reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    return_parts: bool = False,
):
    """The SBD loss of ``model`` on a batch x [B, L]: one forward over the 2L input.

    loss = mean NTP cross-entropy over the clean half + mean cross-entropy over the masked noisy positions (each a
    token-level mean over the batch; 0 for a part with no token). ``mask_token_id`` defaults to
    ``model.config.mask_token_id``. ``block_size`` k, when None, is drawn uniformly in ``block_size_range``
    (inclusive; default ``model.config.sbd_block_size_range``, else (2, 16)) from ``generator``, which also draws
    eta and the masks (see :func:`sbd_batch` for ``attention_mask``, ``labels``, ``eta``, ``noise``).
    ``mask_format`` defaults to what ``config._attn_implementation`` needs (:func:`mask_format_for`);
    ``reduce_counts``: see :func:`sbd_loss_from_logits`. With ``return_parts`` returns
    ``(loss, parts)``, parts a dict of detached ``ntp_loss``, ``mask_loss``, ``mask_accuracy`` (fraction of masked
    positions whose argmax is right), ``num_masked`` tensors and the int ``block_size``.
    """
    hf = unwrap_model(model)
    config = getattr(hf, "config", None)
    mask_token_id = require_mask_token_id(hf, mask_token_id, "sbd_loss")
    if block_size is None:
        if block_size_range is None:
            block_size_range = get_sbd_metadata(hf)[1] or DEFAULT_BLOCK_SIZE_RANGE
        k = draw_block_size(block_size_range, generator)
    else:
        k = int(block_size)
    _check_token_ids(hf, input_ids, labels, mask_token_id)
    if mask_format is None:
        mask_format = mask_format_for(getattr(config, "_attn_implementation", None))
    dtype = hf.get_input_embeddings().weight.dtype if hasattr(hf, "get_input_embeddings") else torch.float32
    if not dtype.is_floating_point:
        dtype = torch.float32

    batch = sbd_batch(
        input_ids,
        mask_token_id,
        k,
        generator=generator,
        eta=eta,
        noise=noise,
        attention_mask=attention_mask,
        labels=labels,
        mask_format=mask_format,
        dtype=dtype,
    )
    logits = model(**batch.model_inputs()).logits  # [B, 2L, V]
    loss, parts = sbd_loss_from_logits(logits, batch, reduce_counts)
    return (loss, parts) if return_parts else loss


def _check_token_ids(hf, input_ids, labels, mask_token_id: int) -> None:
    """input_ids, labels (ignore_index aside) and the mask id must be ids of the model's vocabulary: an id beyond it
    would otherwise surface as an embedding IndexError or a device-side assert inside the forward or the CE."""
    emb = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None) or getattr(getattr(hf, "config", None), "vocab_size", None)
    if vocab is None:
        return
    if not 0 <= mask_token_id < vocab:
        raise ValueError(f"sbd_loss: mask_token_id = {mask_token_id} is not a token id in [0, vocab_size={vocab})")
    for name, ids in (("input_ids", input_ids), ("labels", labels)):
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.numel() == 0:
            continue  # sbd_batch reports a wrong type or shape
        real = ids[ids != IGNORE_INDEX] if name == "labels" else ids
        if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab):
            raise ValueError(
                f"sbd_loss: {name} holds ids outside [0, vocab_size={vocab}) (min {int(real.min())}, max "
                f"{int(real.max())})"
            )


def sbd_loss_from_logits(
    logits: torch.Tensor, batch: SBDBatch, reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[torch.Tensor, dict]:
    """The SBD loss and its parts from the logits [B, 2L, V] of a forward over ``batch`` (see :func:`sbd_loss`).

    ``reduce_counts`` (optional): maps this batch's token counts [n_ntp, n_mask] (float) to the counts the two sums
    are divided by; data parallelism passes the global counts over the world size, so that the ranks' averaged
    gradients are the gradient of one mean over the world's tokens."""
    L = batch.seq_len
    V = logits.shape[-1]
    logits = logits.float()  # CE in fp32, as HF's ForCausalLMLoss
    clean_t, noisy_t = batch.labels[:, :L], batch.labels[:, L:]
    n_ntp = (clean_t != IGNORE_INDEX).sum()
    n_mask = (noisy_t != IGNORE_INDEX).sum()
    ntp_sum = F.cross_entropy(
        logits[:, :L].reshape(-1, V), clean_t.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    mask_sum = F.cross_entropy(
        logits[:, L:].reshape(-1, V), noisy_t.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    if reduce_counts is not None:
        n_ntp, n_mask = reduce_counts(torch.stack([n_ntp, n_mask]).float()).to(logits.device).unbind()
    ntp_loss = ntp_sum / n_ntp.clamp_min(1)
    mask_loss = mask_sum / n_mask.clamp_min(1)
    with torch.no_grad():
        hit = (logits[:, L:].argmax(-1) == noisy_t) & (noisy_t != IGNORE_INDEX)
        acc = hit.sum() / n_mask.clamp_min(1)
    parts = dict(
        ntp_loss=ntp_loss.detach(),
        mask_loss=mask_loss.detach(),
        mask_accuracy=acc.float(),
        num_masked=n_mask,
        block_size=batch.block_size,
    )
    return ntp_loss + mask_loss, parts
