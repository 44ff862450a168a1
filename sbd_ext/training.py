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
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    HAS_FLEX_ATTENTION = True
except ImportError:  # pragma: no cover - torch < 2.5
    BlockMask = None
    create_block_mask = None
    HAS_FLEX_ATTENTION = False

from transformers import Trainer

from .metadata import (
    DEFAULT_BLOCK_SIZE_RANGE,
    check_block_size_range,
    get_sbd_metadata,
    require_mask_token_id,
    set_sbd_metadata,
)

IGNORE_INDEX = -100
MASK_FORMATS = ("bool", "additive", "block")

__all__ = [
    "DEFAULT_BLOCK_SIZE_RANGE",
    "IGNORE_INDEX",
    "SBDBatch",
    "SBDTrainer",
    "add_mask_token",
    "mask_format_for",
    "sbd_attention_mask",
    "sbd_batch",
    "sbd_loss",
    "sbd_mask_mod",
    "train_sbd",
    "train_loop",
    "lr_factor",
]


# --------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------
def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model under DDP / FSDP / torch.compile wrappers (they keep it as ``.module`` / ``._orig_mod``)."""
    seen = 0
    while not hasattr(model, "config") and seen < 8:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            break
        model, seen = inner, seen + 1
    return model


def _draw_block_size(block_size_range, generator: torch.Generator | None) -> int:
    lo, hi = check_block_size_range(block_size_range)
    dev = generator.device if generator is not None else "cpu"
    return int(torch.randint(lo, hi + 1, (1,), generator=generator, device=dev).item())


# --------------------------------------------------------------------------------------------------------
# mask token
# --------------------------------------------------------------------------------------------------------
@torch.no_grad()
def add_mask_token(model, tokenizer=None, token: str = "<|mask|>", block_size_range=DEFAULT_BLOCK_SIZE_RANGE) -> int:
    """Give ``model`` (and ``tokenizer``) a mask token and record the SBD metadata in ``model.config``.

    - tokenizer with a mask token already: that token is reused;
    - tokenizer without one: ``token`` is added as its ``mask_token`` special token;
    - no tokenizer: ``config.mask_token_id`` is reused when it is already set, else the new id is the current
      number of embedding rows.
    The input (and, when untied, output) embeddings grow when the id does not fit; a newly created token's rows are
    set to the mean of the existing tokens' rows, so the mask token starts as an "average" token and its output logit as
    the average logit. Sets ``config.mask_token_id`` and ``config.sbd_block_size_range``. Returns the id.
    """
    lo, hi = check_block_size_range(block_size_range)
    emb = model.get_input_embeddings()
    n_rows = emb.weight.shape[0]
    fresh = False  # a token that did not exist before this call: its embedding rows need initialising
    n_real = n_rows  # rows of real tokens, averaged for the new one (excludes a padded vocabulary's unused rows)
    if tokenizer is not None:
        n_real = min(n_rows, len(tokenizer))
        if tokenizer.mask_token is None or tokenizer.mask_token_id is None:
            before = len(tokenizer)
            tokenizer.add_special_tokens({"mask_token": token})
            fresh = len(tokenizer) > before
        mask_id = int(tokenizer.mask_token_id)
    else:
        existing = getattr(model.config, "mask_token_id", None)
        if existing is not None and 0 <= int(existing) < n_rows:
            mask_id = int(existing)
        else:
            mask_id, fresh = n_rows, True

    if mask_id >= n_rows:
        new_rows = max(mask_id + 1, len(tokenizer) if tokenizer is not None else 0)
        model.resize_token_embeddings(new_rows, mean_resizing=False)
        init_rows = list(range(n_rows, new_rows))
    else:
        init_rows = [mask_id] if fresh else []
    if init_rows:
        emb_w = model.get_input_embeddings().weight
        out = model.get_output_embeddings()
        tables = [emb_w]
        if out is not None and out.weight.data_ptr() != emb_w.data_ptr():  # untied output head
            tables.append(out.weight)
        for w in tables:
            w[init_rows] = w[:n_real].float().mean(0).to(w.dtype)
        out_bias = getattr(out, "bias", None)
        if out_bias is not None:
            out_bias[init_rows] = out_bias[:n_real].float().mean().to(out_bias.dtype)

    set_sbd_metadata(model, mask_id, (lo, hi))
    return mask_id


# --------------------------------------------------------------------------------------------------------
# the mask
# --------------------------------------------------------------------------------------------------------
def sbd_mask_mod(seq_len: int, block_size: int, lengths: torch.Tensor | None = None, device=None) -> Callable:
    """The SBD mask as a FlexAttention ``mask_mod(b, h, q, kv) -> bool`` over the 2L input.

    ``lengths`` [B] (optional): valid tokens per right-padded sequence; key positions at or past it, in either half,
    are masked out. Works on broadcast index tensors too, which is how the dense masks are built from the same
    predicate. With ``device``, L and k are captured as 0-dim tensors instead of Python ints: torch.compile (which
    transformers wraps flex_attention in) then sees them as graph inputs rather than constants, so a new k each
    step does not recompile the attention kernel.
    """
    L, k = int(seq_len), int(block_size)
    if device is not None:
        L, k = torch.tensor(L, device=device), torch.tensor(k, device=device)

    def mask_mod(b, h, q, kv):
        q_clean, kv_clean = q < L, kv < L
        qn, kvn = q - L, kv - L
        clean_clean = q_clean & kv_clean & (kv <= q)
        noisy_noisy = ~q_clean & ~kv_clean & (qn // k == kvn // k)
        noisy_clean = ~q_clean & kv_clean & (qn // k > kv // k)
        allowed = clean_clean | noisy_noisy | noisy_clean
        if lengths is not None:
            allowed = allowed & (torch.where(kv_clean, kv, kvn) < lengths[b])
        return allowed

    return mask_mod


def sbd_attention_mask(
    seq_len: int,
    block_size: int,
    lengths: torch.Tensor | None = None,
    *,
    batch_size: int | None = None,
    mask_format: str = "bool",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
):
    """The SBD attention mask over the 2L input, in one of three forms.

    - ``"bool"``: [B, 1, 2L, 2L] bool, True = may attend (SDPA);
    - ``"additive"``: [B, 1, 2L, 2L] ``dtype``, 0 where allowed and ``finfo(dtype).min`` elsewhere (eager);
    - ``"block"``: a FlexAttention ``BlockMask`` of shape (B, 1, 2L, 2L), B = 1 without ``lengths``.
    B is ``len(lengths)`` when given, else ``batch_size`` (default 1); without ``lengths`` the dense masks are one
    [1, 1, 2L, 2L] mask expanded over the batch. Every query row keeps at least one key as
    long as each sequence has at least one token (its first clean token / the first noisy token of block 0), so no
    softmax row is empty.
    """
    if mask_format not in MASK_FORMATS:
        raise ValueError(f"mask_format must be one of {MASK_FORMATS}, got {mask_format!r}")
    if int(block_size) < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if int(seq_len) < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if lengths is not None:
        device = lengths.device if device is None else torch.device(device)
        lengths = lengths.to(device=device, dtype=torch.long)
        B = lengths.shape[0]
    else:
        B = 1 if batch_size is None else int(batch_size)
    device = torch.device("cpu") if device is None else torch.device(device)
    T = 2 * int(seq_len)

    if mask_format == "block":
        if not HAS_FLEX_ATTENTION:
            raise RuntimeError("mask_format='block' needs torch.nn.attention.flex_attention (torch >= 2.5)")
        mask_mod = sbd_mask_mod(seq_len, block_size, lengths, device=device)
        # Without padding one (1, 1, T, T) mask serves the whole batch (flex_attention broadcasts B=1).
        return create_block_mask(mask_mod, B if lengths is not None else 1, None, T, T, device=device)

    # Without padding the mask is built once and expanded over the batch (stride 0): T^2, not B * T^2, elements.
    idx = torch.arange(T, device=device)
    nb = B if lengths is not None else 1
    b = torch.arange(nb, device=device).view(nb, 1, 1, 1)
    allowed = sbd_mask_mod(seq_len, block_size, lengths)(b, None, idx.view(1, 1, T, 1), idx.view(1, 1, 1, T))
    if mask_format == "additive":
        allowed = torch.where(allowed, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)
    return allowed.expand(B, 1, T, T)


def mask_format_for(attn_implementation: str | None) -> str:
    """Which mask form a transformers attention implementation needs for a custom 4D mask (see module doc)."""
    impl = attn_implementation or "sdpa"
    if impl == "eager":
        return "additive"
    if impl == "flex_attention":
        return "block"
    if "flash" in impl:
        raise ValueError(
            f"attn_implementation={impl!r} cannot take the SBD attention mask (FlashAttention has no arbitrary mask); "
            "load the model with attn_implementation='sdpa', 'eager', 'flex_attention' or 'sbd' for SBD training"
        )
    return "bool"


# --------------------------------------------------------------------------------------------------------
# the 2L batch
# --------------------------------------------------------------------------------------------------------
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
) -> SBDBatch:
    """Build the 2L SBD input, its position ids, aligned labels and attention mask for a batch x [B, L].

    input_ids [B, L] int64. eta: None (draw U(0, 1) per sequence), a float, or a tensor [B]. Each valid token of x
    is replaced by ``mask_token_id`` in x_hat with probability eta of its sequence (the draws come from
    ``generator``, on its device, when given). attention_mask [B, L] (optional): right-padding mask. labels [B, L]
    (optional, HF convention: same positions as input_ids, ``IGNORE_INDEX`` = no loss): the tokens to learn; by
    default input_ids. A label of ``IGNORE_INDEX`` (e.g. a prompt token in SFT data) removes the token from both
    losses; it is still masked in x_hat with the same probability. mask_format / dtype: see
    :func:`sbd_attention_mask`.
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
    u = torch.rand(B, L, generator=generator, device=gdev).to(dev)
    masked = (u < eta_t.view(B, 1)) & valid
    noisy = input_ids.masked_fill(masked, int(mask_token_id))

    ntp = torch.full_like(labels, IGNORE_INDEX)
    ntp[:, :-1] = labels[:, 1:]
    mlm = labels.masked_fill(~masked, IGNORE_INDEX)

    attn = sbd_attention_mask(
        L,
        k,
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


# --------------------------------------------------------------------------------------------------------
# the loss
# --------------------------------------------------------------------------------------------------------
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
    mask_format: str | None = None,
    return_parts: bool = False,
):
    """The SBD loss of ``model`` on a batch x [B, L]: one forward over the 2L input.

    loss = mean NTP cross-entropy over the clean half + mean cross-entropy over the masked noisy positions (each a
    token-level mean over the batch; 0 for a part with no token). ``mask_token_id`` defaults to
    ``model.config.mask_token_id``. ``block_size`` k, when None, is drawn uniformly in ``block_size_range``
    (inclusive; default ``model.config.sbd_block_size_range``, else (2, 16)) from ``generator``, which also draws
    eta and the masks (see :func:`sbd_batch` for ``attention_mask``, ``labels``, ``eta``). ``mask_format`` defaults
    to what ``config._attn_implementation`` needs (:func:`mask_format_for`). With ``return_parts`` returns
    ``(loss, parts)``, parts a dict of detached ``ntp_loss``, ``mask_loss``, ``mask_accuracy`` (fraction of masked
    positions whose argmax is right), ``num_masked`` tensors and the int ``block_size``.
    """
    hf = _unwrap(model)
    config = getattr(hf, "config", None)
    mask_token_id = require_mask_token_id(hf, mask_token_id, "sbd_loss")
    if block_size is None:
        if block_size_range is None:
            block_size_range = get_sbd_metadata(hf)[1] or DEFAULT_BLOCK_SIZE_RANGE
        k = _draw_block_size(block_size_range, generator)
    else:
        k = int(block_size)
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
        attention_mask=attention_mask,
        labels=labels,
        mask_format=mask_format,
        dtype=dtype,
    )
    logits = model(**batch.model_inputs()).logits  # [B, 2L, V]
    loss, parts = sbd_loss_from_logits(logits, batch)
    return (loss, parts) if return_parts else loss


def sbd_loss_from_logits(logits: torch.Tensor, batch: SBDBatch) -> tuple[torch.Tensor, dict]:
    """The SBD loss and its parts from the logits [B, 2L, V] of a forward over ``batch`` (see :func:`sbd_loss`)."""
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


# --------------------------------------------------------------------------------------------------------
# HF Trainer
# --------------------------------------------------------------------------------------------------------
_PART_NAMES = ("ntp_loss", "mask_loss", "mask_accuracy")


class SBDTrainer(Trainer):
    """``transformers.Trainer`` with the SBD objective; distributed training comes from accelerate (DDP, FSDP).

    Extra arguments: ``block_size_range`` (inclusive; default ``model.config.sbd_block_size_range`` or (2, 16)),
    ``mask_token_id`` (default ``model.config.mask_token_id``). Batches are dicts with ``input_ids`` [B, L] and
    optionally ``attention_mask`` (right padding) and ``labels`` (``IGNORE_INDEX`` = no loss). k is drawn per
    forward from a ``random.Random(args.seed)``, so every rank uses the same k at the same step (equal work per
    rank); the masks use torch's global RNG, which the Trainer seeds. The mean NTP loss, mask loss and masked
    accuracy since the last log are logged next to ``loss`` (``ntp_loss``, ``mask_loss``, ``mask_accuracy``; with
    the ``eval_`` prefix on evaluation). Evaluation reports the SBD loss as ``eval_loss``.
    """

    # compute_loss returns a per-batch mean: let the Trainer divide it by the gradient-accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(self, *args, block_size_range=None, mask_token_id: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        # Same statement for transformers versions without ``loss_is_scaled_for_ga`` (5.17, the GPU image's): they
        # divide by the accumulation steps only when the model is not marked as taking loss kwargs.
        self.model_accepts_loss_kwargs = False
        hf = _unwrap(self.model)
        if block_size_range is None:
            block_size_range = get_sbd_metadata(hf)[1] or DEFAULT_BLOCK_SIZE_RANGE
        self.block_size_range = check_block_size_range(block_size_range)
        self.mask_token_id = require_mask_token_id(hf, mask_token_id, "SBDTrainer")
        set_sbd_metadata(hf, self.mask_token_id, self.block_size_range)
        self._k_rng = random.Random(self.args.seed)
        self._sbd_sums: dict[str, dict] = {}

    def _accumulate(self, prefix: str, parts: dict) -> None:
        acc = self._sbd_sums.setdefault(prefix, {"n": 0})
        for name in _PART_NAMES:
            acc[name] = acc.get(name, 0.0) + parts[name]
        acc["n"] += 1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        k = self._k_rng.randint(*self.block_size_range)
        loss, parts = sbd_loss(
            model,
            inputs["input_ids"],
            mask_token_id=self.mask_token_id,
            block_size=k,
            attention_mask=inputs.get("attention_mask"),
            labels=inputs.get("labels"),
            return_parts=True,
        )
        self._accumulate("" if model.training else "eval_", parts)
        return (loss, parts) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation = the SBD loss (a plain forward of the 2L batch has no other meaning here)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        for prefix, key in (("", "loss"), ("eval_", "eval_loss")):
            acc = self._sbd_sums.get(prefix)
            if key in logs and acc and acc["n"] > 0:
                vals = torch.stack([torch.as_tensor(acc[n], dtype=torch.float32) for n in _PART_NAMES]) / acc["n"]
                vals = self.accelerator.reduce(vals.to(self.args.device), reduction="mean")
                for n, v in zip(_PART_NAMES, vals.tolist(), strict=True):
                    logs[prefix + n] = round(v, 4)
                self._sbd_sums.pop(prefix)
        super().log(logs, start_time)


# --------------------------------------------------------------------------------------------------------
# the training loop (one, used by train_sbd, the demo trainer and the SmolLM2 recipe)
# --------------------------------------------------------------------------------------------------------
def lr_factor(step: int, steps: int, warmup_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Linear warm-up over ``warmup_steps`` (step 0 gets 1/warmup of the lr, not 0), then cosine decay from 1 to
    ``min_lr_ratio`` at ``steps``. ``step`` counts optimizer steps taken so far (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    t = (step - warmup_steps) / max(1, steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))


def _rng_state(r):
    return r.get_state() if isinstance(r, torch.Generator) else r.getstate()


def _set_rng_state(r, state) -> None:
    if isinstance(r, torch.Generator):
        r.set_state(state)
    else:
        r.setstate(state)


class _Batches:
    """Endless batches: a re-iterable (list, DataLoader) starts over when exhausted; a one-shot iterator ends."""

    def __init__(self, data: Iterable):
        self.data, self.it = data, iter(data)

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.data)
            if self.it is self.data:  # a one-shot iterator: nothing left
                return None
            return next(self.it, None)


def train_loop(
    model: torch.nn.Module,
    data: Iterable,
    loss_fn: Callable[[torch.nn.Module, Any], Any],
    steps: int,
    *,
    lr: float = 3e-4,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.0,
    warmup_steps: int | None = None,
    min_lr_ratio: float = 0.0,
    max_grad_norm: float | None = 1.0,
    params: Iterable[torch.nn.Parameter] | None = None,
    autocast_dtype: torch.dtype | None = None,
    log_every: int = 10,
    progress: bool | str = True,
    name: str = "train",
    callback: Callable[[dict], None] | None = None,
    eval_fn: Callable[[torch.nn.Module, int], dict] | None = None,
    eval_every: int = 0,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    rngs: Sequence[torch.Generator | random.Random] = (),
) -> list[dict]:
    """Train ``model`` for ``steps`` optimizer steps of ``loss_fn``: the package's one training loop.

    loss_fn(model, batch) returns the loss or ``(loss, parts)``, parts a dict of scalars (tensors or numbers) that
    are averaged over each logging interval next to ``loss`` (an int ``block_size`` part is skipped). ``data`` is
    an iterable of batches, re-iterated when exhausted if it can be (a list, a DataLoader); a one-shot iterator
    that runs out ends training early.

    AdamW over ``params`` (default: the parameters that require grad) with ``lr``, ``betas``, ``weight_decay``;
    the lr follows :func:`lr_factor` (linear warm-up over ``warmup_steps``, default min(200, steps // 10), then
    cosine decay to ``min_lr_ratio`` × lr); gradients are clipped at ``max_grad_norm`` (None: no clipping); the
    forward runs under autocast to ``autocast_dtype`` when given (bf16 on a GPU). Every ``log_every`` steps (and at
    the last) a record {step, loss, <parts>, lr, elapsed_s} is appended to the returned history, shown on a tqdm bar
    (``progress="lines"``, or tqdm missing: a printed line per record, for logs; False: nothing) and passed to
    ``callback``.
    ``eval_fn(model, step)``, every ``eval_every`` steps before the last, returns a dict recorded as
    {step, **dict}; the model is put back in train mode afterwards.

    Resume: with ``checkpoint`` (a file path), the model, optimizer and schedule state, the history, the states of
    ``rngs`` (the generators ``loss_fn`` draws from) and the step are saved there every ``checkpoint_every`` steps
    and at the end (atomically); a later call with the same path continues from the saved step, skipping the
    batches already consumed, so an interrupted run finishes with the same weights as an uninterrupted one.
    The model is left in eval mode.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"train_loop: steps must be an int >= 0, got {steps!r}")
    if log_every < 1:
        raise ValueError(f"train_loop: log_every must be >= 1, got {log_every!r}")
    params = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
    if not params:
        raise ValueError("train_loop: no trainable parameters (none requires grad)")
    warmup_steps = min(200, steps // 10) if warmup_steps is None else int(warmup_steps)
    warmup_steps = max(1, warmup_steps)
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, warmup_steps, min_lr_ratio))
    device = params[0].device

    history: list[dict] = []
    start = 0
    ckpt_path = Path(checkpoint) if checkpoint is not None else None
    if ckpt_path is not None and ckpt_path.exists():
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        history = list(state["history"])
        for r, st in zip(rngs, state["rngs"], strict=True):
            _set_rng_state(r, st)
        start = int(state["step"])

    def save_checkpoint(step: int) -> None:
        state = dict(
            step=step,
            model=model.state_dict(),
            optimizer=opt.state_dict(),
            scheduler=sched.state_dict(),
            history=history,
            rngs=[_rng_state(r) for r in rngs],
        )
        ckpt_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = ckpt_path.with_name(ckpt_path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, ckpt_path)

    batches = _Batches(data)
    for _ in range(start):  # the batches the saved steps consumed
        batches.next()

    bar = None
    if progress is True and steps > start:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, initial=start, desc=name, dynamic_ncols=True)
        except ImportError:
            bar = None
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    )
    sums: dict[str, torch.Tensor] = {}
    n_acc, t0 = 0, time.perf_counter()
    model.train()
    for step in range(start + 1, steps + 1):
        batch = batches.next()
        if batch is None:
            break
        with autocast:
            out = loss_fn(model, batch)
        loss, parts = out if isinstance(out, tuple) else (out, {})
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        sched.step()
        # Sums stay on the device: no host sync per step, one per logging interval.
        for key, v in {"loss": loss, **parts}.items():
            if key == "block_size" or key == "num_masked":
                continue
            v = torch.as_tensor(v).detach().float().to(device)
            sums[key] = sums[key] + v if key in sums else v
        n_acc += 1
        if bar is not None:
            bar.update(1)
        if step % log_every == 0 or step == steps:
            rec = {"step": step, **{k: round(float(v) / n_acc, 4) for k, v in sums.items()}}
            rec["lr"] = sched.get_last_lr()[0]
            rec["elapsed_s"] = round(time.perf_counter() - t0, 1)
            history.append(rec)
            sums, n_acc = {}, 0
            msg = " ".join(f"{k} {rec[k]:.4f}" for k in rec if k not in ("step", "lr", "elapsed_s"))
            if bar is not None:
                bar.set_postfix_str(msg)
            elif progress:
                rate = (step - start) / max(time.perf_counter() - t0, 1e-9)
                print(f"[{name}] step {step}/{steps} {msg} lr {rec['lr']:.2e} ({rate:.2f} steps/s)", flush=True)
            if callback is not None:
                callback(rec)
        if eval_fn is not None and eval_every and step % eval_every == 0 and step < steps:
            rec = {"step": step, **eval_fn(model, step)}
            model.train()
            history.append(rec)
            if progress:
                print(f"[{name}] step {step}: " + " ".join(f"{k} {v}" for k, v in rec.items() if k != "step"))
        if ckpt_path is not None and checkpoint_every and step % checkpoint_every == 0 and step < steps:
            save_checkpoint(step)
    if bar is not None:
        bar.close()
    if ckpt_path is not None and steps > start:
        save_checkpoint(steps)
    model.eval()
    return history


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
    mask_token_id = require_mask_token_id(model, mask_token_id, "train_sbd")
    if block_size_range is None:
        block_size_range = get_sbd_metadata(model)[1] or DEFAULT_BLOCK_SIZE_RANGE
    lo, hi = check_block_size_range(block_size_range)
    set_sbd_metadata(model, mask_token_id, (lo, hi))
    device = next(model.parameters()).device

    def loss_fn(model, item):
        b = _as_batch(item, device)
        k = _draw_block_size((lo, hi), generator)
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
