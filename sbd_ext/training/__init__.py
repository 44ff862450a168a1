"""The Set Block Decoding training objective (Gat et al. 2025, Alg. 1) for HuggingFace causal LMs.

For a batch of sequences x [B, L] and a block size k, SBD trains ONE forward over the 2L-token input
``cat(x, x_hat)``, where x_hat replaces each token of x by the mask token with probability eta,
eta ~ U(0, 1) drawn once per sequence. Both halves use position ids 0..L-1. Indices q, kv below run over
the 2L input; blocks have size k; three parts of the attention mask are OR-ed:

- clean -> clean, causal:                      q < L, kv < L, kv <= q
- noisy -> noisy, same block, bidirectional:   q >= L, kv >= L, (q-L)//k == (kv-L)//k
- noisy -> clean, strictly earlier blocks:     q >= L, kv < L, (q-L)//k > kv//k

so a noisy block never sees the clean copy of its own block, and the clean half never sees the noisy half
(its outputs are exactly those of a plain causal forward of x). The loss is the next-token cross-entropy on the
clean half (the output at t predicts x[t+1]) plus the cross-entropy on the masked positions of the noisy half
(the output at L+t predicts x[t]; unmasked noisy positions are ignored): a plain sum of the two token-level means.

Right-padded batches are supported through a 2D ``attention_mask`` [B, L] (1 = token, 0 = padding): padding
positions of either half are never attended to, never masked and never in the loss.

How the custom mask reaches the attention function (transformers 5.x): ``create_causal_mask`` in
``transformers.masking_utils`` returns any 4D ``attention_mask`` (a tensor or a FlexAttention ``BlockMask``) as
is, whatever ``config._attn_implementation`` is, and the model hands it unchanged to every layer's attention
function. Each implementation wants a different kind of mask, which :func:`mask_format_for` picks:

- ``"sdpa"``: boolean [B, 1, 2L, 2L], True = may attend (``F.scaled_dot_product_attention(attn_mask=...)``);
- ``"eager"``: additive float [B, 1, 2L, 2L] in the model dtype, 0 or dtype-min (added to the scores; a boolean
  mask would be added as 0/1, silently wrong);
- ``"flex_attention"``: a ``BlockMask`` from ``create_block_mask`` with :func:`sbd_mask_mod` (its ``shape`` is 4D,
  so it passes the same early exit); on the CPU torch 2.13 has no FlexAttention backward (forward only);
- ``"sbd"`` (sbd_ext's backend) and any other registered implementation: boolean, as for SDPA (the sbd backend
  falls back to SDPA for a custom 4D mask);
- ``flash_attention_*``: refused, FlashAttention takes no arbitrary mask.

SBD metadata (:mod:`sbd_ext.metadata`, on the model's text config): :func:`add_mask_token` records
``mask_token_id`` and the intended ``sbd_block_size_range``; :class:`SBDTrainer` and :func:`train_sbd` overwrite
the range with the one they actually train on.

Entry points: :func:`add_mask_token`, :func:`sbd_batch` (the 2L input, labels and mask), :func:`sbd_loss`
(one forward + the loss), :class:`SBDTrainer` (HF ``Trainer``; multi-GPU through accelerate/FSDP),
:func:`train_loop` (the package's one plain loop: AdamW, warm-up + cosine, clipping, progress, resume) and
:func:`train_sbd` (:func:`train_loop` on the SBD objective).

Rooms: ``mask`` (the three-part mask), ``batch`` (the 2L batch), ``loss`` (the objective), ``mask_token``
(:func:`add_mask_token`), ``trainer`` (:class:`SBDTrainer`), ``loop`` (the generic :func:`train_loop`, nothing
SBD-specific), ``sbd`` (:func:`train_sbd`), ``common`` (``IGNORE_INDEX``, the block-size draw).
"""

from __future__ import annotations

from ..metadata import DEFAULT_BLOCK_SIZE_RANGE, unwrap_model
from .batch import SBDBatch, sbd_batch
from .common import IGNORE_INDEX, draw_block_size
from .loop import lr_factor, train_loop
from .loss import sbd_loss, sbd_loss_from_logits
from .mask import HAS_FLEX_ATTENTION, MASK_FORMATS, mask_format_for, sbd_attention_mask, sbd_mask_mod
from .mask_token import add_mask_token
from .sbd import train_sbd
from .trainer import SBDTrainer

__all__ = [
    "DEFAULT_BLOCK_SIZE_RANGE",
    "HAS_FLEX_ATTENTION",
    "IGNORE_INDEX",
    "MASK_FORMATS",
    "SBDBatch",
    "SBDTrainer",
    "add_mask_token",
    "draw_block_size",
    "mask_format_for",
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
