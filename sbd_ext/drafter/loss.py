"""The drafter's training objective: the SBD layout with the clean half run by the frozen base (see
:mod:`sbd_ext.drafter`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from .. import families
from ..training.mask import sbd_attention_mask
from .gate import get_drafter

# What the drafter's distribution q is pulled towards the base's p with, on each masked position (see distill_loss).
DIVERGENCES = ("kl", "tv", "ce")


def padded_batch(rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt, answer) token lists -> ``input_ids`` [B, L] (right padded with 0), ``attention_mask`` [B, L] (1 =
    token) and ``loss_mask`` [B, L] (True on the answer's positions)."""
    B, L = len(rows), max(len(p) + len(a) for p, a in rows)
    ids = torch.zeros((B, L), dtype=torch.long)
    att, lm = torch.zeros_like(ids), torch.zeros((B, L), dtype=torch.bool)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(list(p) + list(a))
        att[i, : len(p) + len(a)] = 1
        lm[i, len(p) : len(p) + len(a)] = True
    return ids, att, lm


def clean_and_noisy_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    noisy: torch.Tensor,
    loss_mask: torch.Tensor,
    block_size: int,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The SBD layout of Alg. 1 with the clean half run by the frozen base: (1) a causal forward of ``input_ids``
    [B, L] without autograd and with the gate off, its K/V kept; (2) ``noisy`` (``input_ids`` with the mask token
    at the masked positions) with the gate on, position ids 0..L-1, attending to its own block bidirectionally and
    to strictly earlier clean blocks (the SBD mask's noisy rows). Noisy blocks that end before the first position
    with loss (the prompts) feed no loss and no later block (a noisy block sees its own block only), so the noisy
    half starts at ``s``, the first block holding a ``loss_mask`` position. Returns the clean half's final hidden
    states [B, L, H], the noisy half's [B, L - s, H] (with autograd where it is enabled) and ``s``."""
    drafter = get_drafter(model)
    B, L = input_ids.shape
    device, k = input_ids.device, int(block_size)
    lengths = (
        attention_mask.long().sum(1)
        if attention_mask is not None
        else torch.full((B,), L, dtype=torch.long, device=device)
    )
    pos = torch.arange(L, device=device).view(1, L).expand(B, L)
    decoder, holder = model.get_decoder(), drafter.holder
    holder.gate = None
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        clean = decoder(
            input_ids=input_ids, position_ids=pos, past_key_values=cache, use_cache=True, attention_mask=attention_mask
        ).last_hidden_state
    first = int(loss_mask.bool().any(0).nonzero()[0]) if loss_mask.any() else 0
    s = (first // k) * k
    full = sbd_attention_mask(L, k, lengths, mask_format="bool", device=device)  # [B, 1, 2L, 2L]
    keys = torch.cat([torch.arange(L, device=device), torch.arange(L + s, 2 * L, device=device)])
    mask = full[:, :, L + s :, :][..., keys].contiguous()  # the kept noisy rows over [clean keys, kept noisy keys]
    holder.gate = torch.ones(B, L - s, 1, device=device)
    try:
        hidden = decoder(
            input_ids=noisy[:, s:], position_ids=pos[:, s:], past_key_values=cache, use_cache=True, attention_mask=mask
        ).last_hidden_state
    finally:
        holder.gate = None
    return clean, hidden, s


def distill_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    block_size: int,
    *,
    attention_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    eta: torch.Tensor | None = None,
    full_block_prob: float = 0.0,
    first_slot_loss: bool = True,
    divergence: str = "kl",
    return_parts: bool = False,
):
    """The drafter's loss on x [B, L]: the SBD layout of Alg. 1 with the clean half run by the frozen base.

    1. clean half, no autograd, gate off: a causal forward of x, its K/V kept (the noisy half attends to them) and
       the base's next-token logits at the rows the loss needs (the teacher);
    2. noisy half, gate on: x with each token replaced by the mask token with probability eta ~ U(0, 1) per
       sequence, position ids 0..L-1, attending to its own block bidirectionally and to strictly earlier clean
       blocks (the SBD mask's noisy rows); with probability ``full_block_prob`` a sequence has every token masked
       instead (eta = 1), the block verify decoding drafts: all its positions unknown when it is drafted;
    3. loss: mean over masked positions t with ``loss_mask[b, t]`` (and t >= 1) of KL(p_base(. | x_<t) ||
       q_drafter), the mask token excluded from both. ``first_slot_loss=False`` leaves each fully masked block's
       first position out: in verify decoding the commit row before the block supplies that token, so the drafts
       that can be accepted are the 2-ahead and later ones (the loss then spends the adapter on them alone).
       ``divergence`` picks the per-position term: "kl" KL(p || q) (soft targets, the default), "tv" the total
       variation 0.5 * sum |p - q| (Uno's; 1 - TV is the acceptance rate of speculative sampling), "ce" the
       cross-entropy -log q(argmax p) on the base's greedy token (hard targets: what greedy verify accepts).
    ``attention_mask`` [B, L]: right padding (1 = token). Returns the loss, or ``(loss, parts)`` with
    ``mask_accuracy`` (drafter argmax == base argmax), ``num_masked``, ``offset_accuracy`` (the accuracy at each
    block position 0..k-1 of the fully masked blocks, NaN where there were none) and ``offset_count`` (how many
    positions each of those averages).
    """
    drafter = get_drafter(model)
    if drafter is None:
        raise ValueError("distill_loss: the model has no gated drafter (sbd_ext.drafter.attach)")
    if divergence not in DIVERGENCES:
        raise ValueError(f"distill_loss: divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if input_ids.dim() != 2 or loss_mask.shape != input_ids.shape:
        raise ValueError(
            f"distill_loss: input_ids [B, L] and loss_mask of the same shape, got "
            f"{tuple(input_ids.shape)} / {tuple(loss_mask.shape)}"
        )
    B, L = input_ids.shape
    device = input_ids.device
    k = int(block_size)
    mask_id = drafter.mask_token_id
    lengths = (
        attention_mask.long().sum(1)
        if attention_mask is not None
        else torch.full((B,), L, dtype=torch.long, device=device)
    )
    pos = torch.arange(L, device=device).view(1, L).expand(B, L)

    # the noisy half's masks
    if eta is None:
        eta = torch.rand(B, 1, generator=generator, device="cpu")
        if full_block_prob > 0:  # every block of the sequence fully masked: how verify decoding drafts
            full = torch.rand(B, 1, generator=generator, device="cpu") < full_block_prob
            eta = torch.where(full, torch.full_like(eta, 2.0), eta)
    eta = eta.to(device)
    noise = torch.rand(B, L, generator=generator, device="cpu").to(device)
    valid = pos < lengths.view(B, 1)
    masked = (noise < eta.view(B, 1)) & valid
    noisy = torch.where(masked, torch.full_like(input_ids, mask_id), input_ids)
    sel = masked & loss_mask.bool() & (pos >= 1)
    n_blocks = -(-L // k)
    padded = F.pad(masked | ~valid, (0, n_blocks * k - L), value=True).view(B, n_blocks, k)
    block_full = padded.all(-1).repeat_interleave(k, dim=1)[:, :L] & valid
    if not first_slot_loss:
        sel &= ~(block_full & (pos % k == 0))

    # 1. the base on the clean half, 2. the noisy half with the adapter
    clean_hidden, hidden, s = clean_and_noisy_forward(model, input_ids, noisy, loss_mask, k, attention_mask)

    # 3. distillation on the masked positions that carry loss
    bi, ti = sel.nonzero(as_tuple=True)
    n = bi.numel()
    if n == 0:
        zero = hidden.sum() * 0.0
        parts = dict(mask_loss=zero.detach(), mask_accuracy=torch.zeros(()), num_masked=torch.tensor(0))
        return (zero, parts) if return_parts else zero
    with torch.no_grad():
        teacher = families.lm_logits(model, clean_hidden[bi, ti - 1]).float()
        teacher[:, mask_id] = -math.inf
        logp = F.log_softmax(teacher, dim=-1)
        p = logp.exp()
    student = families.lm_logits(model, hidden[bi, ti - s]).float()
    student = student.masked_fill(torch.arange(student.shape[-1], device=device) == mask_id, -math.inf)
    logq = F.log_softmax(student, dim=-1)
    if divergence == "kl":
        per = (p * (logp - logq)).nan_to_num(0.0).sum(-1)  # 0 * -inf at the mask column -> 0
    elif divergence == "tv":
        per = 0.5 * (p - logq.exp()).abs().sum(-1)
    else:
        per = -logq.gather(1, teacher.argmax(-1, keepdim=True)).squeeze(1)
    loss = per.mean()
    if not return_parts:
        return loss
    with torch.no_grad():
        hit = (student.argmax(-1) == teacher.argmax(-1)).float()
        acc = hit.mean()
        offset, full_sel = ti % k, block_full[bi, ti]
        at = [full_sel & (offset == j) for j in range(k)]
        count = [int(a.sum()) for a in at]
        by_offset = [float(hit[a].mean()) if c else math.nan for a, c in zip(at, count, strict=True)]
    return loss, dict(
        mask_loss=loss.detach(),
        mask_accuracy=acc,
        num_masked=torch.tensor(n),
        block_size=k,
        offset_accuracy=by_offset,
        offset_count=count,
    )


def slot_accuracy(
    model: nn.Module, prompts: list[list[int]], answers: list[list[int]], block_size: int, batch_size: int = 8
) -> list[float]:
    """The drafter's teacher-forced accuracy at each slot 0..k-1 of fully masked blocks of ``block_size`` over
    ``answers`` (token lists, each after its prompt in ``prompts``; the base's own answers for a held-out measure):
    the fraction of answer positions where the drafter's argmax is the base's next-token argmax, by the position's
    slot in the block grid (``position % k``). Every position of the noisy half is masked (how verify drafts), so
    slot 1 is the 2-ahead draft that verify can accept; slot 0, which verify takes from the commit row, is the
    drafter's next-token guess. NaN for a slot no answer position falls on."""
    k = int(block_size)
    if k < 1:
        raise ValueError(f"slot_accuracy: block_size must be >= 1, got {block_size}")
    if len(prompts) != len(answers):
        raise ValueError(f"slot_accuracy: {len(prompts)} prompts but {len(answers)} answers")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    hits, counts = [0.0] * k, [0] * k
    rows = [(list(p), list(a)) for p, a in zip(prompts, answers, strict=True) if a]
    try:
        for lo in range(0, len(rows), batch_size):
            chunk = rows[lo : lo + batch_size]
            ids, att, lm = (t.to(device) for t in padded_batch(chunk))
            eta = torch.full((len(chunk), 1), 2.0)  # every position masked
            with torch.no_grad():
                _, parts = distill_loss(model, ids, lm, k, attention_mask=att, eta=eta, return_parts=True)
            for j, (acc, c) in enumerate(zip(parts["offset_accuracy"], parts["offset_count"], strict=True)):
                if c:
                    hits[j] += acc * c
                    counts[j] += c
    finally:
        model.train(was_training)
    return [h / c if c else math.nan for h, c in zip(hits, counts, strict=True)]
