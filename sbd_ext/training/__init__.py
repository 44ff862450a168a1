"""The Set Block Decoding training objective (Gat et al. 2025, Alg. 1) for HuggingFace causal LMs.

One forward over the 2L-token input ``cat(x, x_hat)`` (x_hat: each token masked with probability eta ~ U(0, 1) per
sequence) with a three-part attention mask; the loss is the next-token cross-entropy on the clean half plus the
cross-entropy on the masked positions of the noisy half. The mask's definition, and which mask format each
attention implementation gets, are in :mod:`sbd_ext.training.mask`.

SBD metadata (:mod:`sbd_ext.metadata`, on the model's text config): :func:`add_mask_token` records
``mask_token_id`` and the intended ``sbd_block_size_range``; :class:`SBDTrainer` and :func:`train_sbd` overwrite
the range with the one they actually train on.

Entry points: :func:`add_mask_token`, :func:`sbd_batch` (the 2L input, labels and mask), :func:`sbd_loss`
(one forward + the loss), :class:`SBDTrainer` (HF ``Trainer``; multi-GPU through accelerate/FSDP),
:func:`train_loop` (the package's one plain loop: AdamW, warm-up + cosine, clipping, progress, resume),
:func:`train_sbd` (:func:`train_loop` on the SBD objective) and :func:`objective_loss_fn` (the loss closure for the
SBD objective or its NTP control, :func:`ntp_loss`, as the demo trainer and the recipes pick it).

Rooms: ``mask`` (the three-part mask), ``batch`` (the 2L batch), ``loss`` (the SBD loss), ``objective`` (the loss
closure of an objective, SBD or NTP), ``mask_token`` (:func:`add_mask_token`), ``trainer`` (:class:`SBDTrainer`),
``loop`` (the generic :func:`train_loop`, nothing SBD-specific), ``sbd`` (:func:`train_sbd`), ``common``
(``IGNORE_INDEX``, the block-size draw).
"""

from __future__ import annotations

from ..metadata import DEFAULT_BLOCK_SIZE_RANGE, unwrap_model
from .batch import SBDBatch, sbd_batch
from .common import IGNORE_INDEX, draw_block_size
from .loop import lr_factor, train_loop
from .loss import sbd_loss, sbd_loss_from_logits
from .mask import HAS_FLEX_ATTENTION, MASK_FORMATS, mask_format_for, sbd_attention_mask, sbd_mask_mod
from .mask_token import add_mask_token
from .objective import OBJECTIVES, ntp_loss, objective_loss_fn
from .sbd import train_sbd
from .trainer import SBDTrainer

__all__ = [
    "DEFAULT_BLOCK_SIZE_RANGE",
    "HAS_FLEX_ATTENTION",
    "IGNORE_INDEX",
    "MASK_FORMATS",
    "OBJECTIVES",
    "SBDBatch",
    "SBDTrainer",
    "add_mask_token",
    "draw_block_size",
    "mask_format_for",
    "ntp_loss",
    "objective_loss_fn",
    "sbd_attention_mask",
    "sbd_batch",
    "sbd_loss",
    "sbd_loss_from_logits",
    "sbd_mask_mod",
    "train_sbd",
    "train_loop",
    "lr_factor",
    "unwrap_model",
]

# Internal names of the single-file training.py and where they live now.
_MOVED = {
    "_unwrap": "sbd_ext.metadata.unwrap_model",
    "_draw_block_size": "sbd_ext.training.common.draw_block_size",
    "_lengths_from_attention_mask": "sbd_ext.training.batch._lengths_from_attention_mask",
    "_PART_NAMES": "sbd_ext.training.trainer._PART_NAMES",
    "_Batches": "sbd_ext.training.loop._Batches",
    "_as_batch": "sbd_ext.training.sbd._as_batch",
}


def __getattr__(name: str):
    if name in _MOVED:
        raise ImportError(f"sbd_ext.training.{name} is gone: training.py became a package; use {_MOVED[name]}")
    raise AttributeError(f"module 'sbd_ext.training' has no attribute {name!r}")
