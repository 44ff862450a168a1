"""The decoding cycle on the device (``generate(..., cycle="device")``): one forward, its reveal and all of the
per-sequence bookkeeping of :class:`~sbd_ext.decoding.state.SequenceState` -- verify's comparison and correction,
the entropy-bound reveal, block completion, stop tokens, the budget, the cache lengths and the next forward's
inputs -- as tensor operations over a :class:`CycleState` that lives on the model's device.

Nothing in :func:`cycle` reads a device value on the host, so with ``compile=True`` one cycle is one
``torch.compile(fullgraph=True)`` graph (a CUDA graph on CUDA) and consecutive cycles run back to back; the host
reads a small status (finished rows, generated counts, an error code) once every ``SYNC_EVERY[device type]``
cycles, for stopping, streaming and errors. The tokens are the host cycle's (:func:`~sbd_ext.decoding.step.decode`),
forward for forward; the prefill (the prompt's forward) runs on the host first, then its state is moved over.

Shapes are fixed per (batch, k): every SBD forward has 2k rows (at most k committed rows -- a finished block, its
drafts, or a correction -- then the block), NTP forwards one row. What it does not run (refused when the settings
are made): temperature sampling (its per-position noise keys are host ints), and verify's ``lookup`` and
``branch`` (host-side proposals). Traces are not recorded (``trace`` is None).
"""

from __future__ import annotations

import torch

from .. import ops
from .compiled import _static_forward
from .sampling import ban_mask, sample_block

__all__ = ["cycle", "ERRORS", "FIELDS", "SYNC_EVERY"]

# Cycles run between two reads of the status on the host: each read is a device-to-host copy (a synchronisation on
# CUDA, free on the CPU); cycles after every sequence finished are no-ops (at most SYNC_EVERY - 1 of them).
SYNC_EVERY = {"cuda": 4, "cpu": 1}

# err codes in the state -> the host decoder's messages
ERRORS = {
    1: "verify: sequence {b} got an invalid next-token distribution (NaN or +inf logits) checking its drafts",
    2: "verify: sequence {b} got an invalid next-token distribution (NaN or +inf logits in the committed row that "
    "decides the next token)",
    3: "SBD decoding: sequence {b} revealed no token although positions are masked: every proposal was invalid "
    "(NaN or +inf logits, or all logits -inf once the mask token is banned)",
    4: "NTP decoding: sequence {b} got an invalid next-token distribution (NaN or +inf logits)",
    5: "internal: verify mode drafted a block of sequence {b} whose first position is masked",
}

# The state's tensors, in the order cycle() takes and updates them. [B] int64 unless said otherwise.
FIELDS = (
    "out",  # [B, L] the prompt then the generated (in verify mode: verified) tokens
    "n_gen",  # generated tokens in ``out``
    "p_len",  # prompt length
    "pend",  # [B, W >= k] tokens committed by the next forward (the prompt, a finished block, drafts, a correction)
    "n_pend",
    "n_draft",  # verify: trailing pending tokens still to check
    "block",  # [B, k] the current block (mask ids where masked; the job's filler past its length)
    "k",  # the current block's length (0: none)
    "bver",  # verify: 1 when the block's first position came from the verified next-token choice
    "clen",  # rows in the KV cache
    "nfe",  # forwards taken
    "ncorr",  # verify: corrections
    "done",  # [B] bool
    "corr",  # [B, L] bool: output positions holding a correction
    "err",  # 0, or a key of ERRORS (the first error of the sequence)
)


# --------------------------------------------------------------------------------------------------------
# the cycle: tensor operations only
# --------------------------------------------------------------------------------------------------------
def _first(m: torch.Tensor) -> torch.Tensor:
    """The index of the first True of each row of ``m`` [B, W] (W where none)."""
    W = m.shape[1]
    return torch.where(m, torch.arange(W, device=m.device), W).amin(1)


def _is_stop(x: torch.Tensor, stop: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(-1) == stop).any(-1)


def _append(out: torch.Tensor, at: torch.Tensor, src: torch.Tensor, cnt: torch.Tensor) -> torch.Tensor:
    """``out`` [B, L] with ``src[b, :cnt[b]]`` written at ``at[b]`` (the state's L leaves room: no clamping of a
    written position)."""
    W = src.shape[1]
    pos = (at.unsqueeze(1) + torch.arange(W, device=out.device)).clamp(max=out.shape[1] - 1)
    keep = torch.arange(W, device=out.device).unsqueeze(0) < cnt.unsqueeze(1)
    return out.scatter(1, pos, torch.where(keep, src, out.gather(1, pos)))


def _finished(out, p_len, n_gen, n_draft, max_new, stop) -> torch.Tensor:
    """SequenceState._finished: no drafts pending, and the budget is spent or the last output token stops."""
    last = out.gather(1, (p_len + n_gen - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return (n_draft == 0) & ((n_gen >= max_new) | ((n_gen > 0) & _is_stop(last, stop)))


def cycle(
    model,
    cache,
    st: tuple,
    stop: torch.Tensor,
    max_new: torch.Tensor,
    spec: tuple,
    head=None,
    emb=None,
    rows: torch.Tensor | None = None,
):
    """One forward of every sequence and its reveal and bookkeeping, updating the state ``st`` (FIELDS) in place.

    ``stop`` [S] the stop ids (-1 when none); ``max_new`` [B] the budget; ``spec`` (k, sbd, verify, first_from_ntp,
    sampler, threshold, mask_id, filler, seed) the job's constants; ``head`` / ``emb`` verify's sampler head and
    the input embeddings; ``rows`` (SBD on the CPU) ``arange(T)``: the forward's row count T >= k, else 2k (a CUDA
    graph's fixed shape). Runs under ``cache.static_forwards()``."""
    out, n_gen, p_len, pend, n_pend, n_draft, block, k, bver, clen, nfe, ncorr, done, corr, err = st
    K, sbd, verify, ffn, sampler, threshold, mask_id, filler, seed = spec
    B, dev = out.shape[0], out.device
    live = ~done
    c = torch.where(live, n_pend, 0)  # committed rows of this forward
    kk = torch.where(live, k, 0) if sbd else torch.zeros_like(k)
    jK = torch.arange(K, device=dev).unsqueeze(0)

    # The forward's rows: pending tokens (committed), then the block; padding rows are id 0 at position 0.
    if rows is None or not sbd:
        T = 2 * K if sbd else 1
        j = torch.arange(T, device=dev).unsqueeze(0)
    else:  # the CPU: the rows the longest sequence needs (>= k), a dynamic size
        T = rows.shape[0]
        torch._check(T >= K)
        j = rows.unsqueeze(0)
    if sbd:
        W = pend.shape[1]  # k, or on the CPU the longest prompt (its prefill is a cycle)
        src = torch.cat([pend, block], 1)
        ids = src.gather(1, torch.where(j < c.unsqueeze(1), j, j - c.unsqueeze(1) + W).clamp(0, W + K - 1))
    else:
        ids = pend[:, :1]
    valid = j < (c + kk).unsqueeze(1)
    ids = torch.where(valid, ids, 0)
    pos = torch.where(valid, clen.unsqueeze(1) + j, 0)
    meta = torch.stack([clen, c, c + kk]).to(torch.int32)
    logits = _static_forward(model, cache, torch.stack([ids, pos]), meta, K if sbd and not ffn else 0, sbd)
    nfe = nfe + live.long()

    if not sbd:  # NTP: the next token from the committed row
        tok = ops.entropy_sample(ban_mask(logits[:, 0], mask_id), 0.0, seed, 0)[2]
        err = torch.where(live & (tok < 0) & (err == 0), 4, err)
        out = _append(out, p_len + n_gen, tok.unsqueeze(1), live.long())
        n_gen = n_gen + live.long()
        pend = torch.where(live.unsqueeze(1), tok.unsqueeze(1).expand(B, pend.shape[1]), pend)
        done = done | (live & (_is_stop(tok, stop) | (n_gen >= max_new)))
        new = (out, n_gen, p_len, pend, n_pend, n_draft, block, k, bver, clen + c, nfe, ncorr, done, corr, err)
        for t, v in zip(st, new, strict=True):
            t.copy_(v)
        return

    blk = torch.where(live.unsqueeze(1) & (jK < kk.unsqueeze(1)), block, filler)
    if ffn:  # the next-token choice after each committed row; the last one reveals the block's first position
        V = logits.shape[-1]
        # The last k committed rows, lo .. c - 1 (all of them but in a prefill), gathered: a new [B, k, V] tensor (a
        # slice of the T rows would make the graph guard on T != k); ntp[:, r - lo] is row r's choice.
        lo = (c - K).clamp(min=0)
        nrows = (lo.unsqueeze(1) + jK).clamp(max=T - 1)
        head_rows = logits.gather(1, nrows.unsqueeze(-1).expand(B, K, V))
        ntp = ops.entropy_sample(ban_mask(head_rows, mask_id).view(B * K, V), 0.0, seed, 0)[2].view(B, K)
        first_tok = ntp.gather(1, (c - 1 - lo).clamp(min=0).unsqueeze(1)).squeeze(1)
        can = live & (c > 0) & (kk > 0) & (first_tok >= 0) & (blk[:, 0] == mask_id)
        blk[:, 0] = torch.where(can, first_tok, blk[:, 0])
        brows = (c.unsqueeze(1) + jK).clamp(max=T - 1)
        x = logits.gather(1, brows.unsqueeze(-1).expand(B, K, V))
    else:
        x = logits
    if head is not None and K >= 2:  # slot 1 rescored given slot 0's token (rows.rescore_slot1)
        ban_mask(x, mask_id)
        cond = (blk[:, 0] != mask_id) & (blk[:, 1] == mask_id)
        new1 = head.rescore_(x[:, 1].clone(), torch.where(cond, blk[:, 0], 0), emb)
        x[:, 1] = torch.where(cond.unsqueeze(1), new1, x[:, 1])
    n_rev, n_rem = sample_block(x, blk, mask_id, sampler, threshold, 0.0, seed, 0)[:2]

    # Verify: check the committed drafts against the next-token choices (SequenceState._verify).
    n_pend2, n_draft2, rej = torch.where(live, 0, n_pend), n_draft, torch.zeros_like(live)
    keep_rows = c
    if verify:
        hasd = live & (n_draft > 0)
        base = n_pend - n_draft
        row = base.unsqueeze(1) + jK - 1  # the committed row that predicts draft t
        dtok = pend.gather(1, (base.unsqueeze(1) + jK).clamp(max=pend.shape[1] - 1))
        pred = ntp.gather(1, (row - lo.unsqueeze(1)).clamp(0, K - 1))  # drafts follow no prompt: lo = 0 here
        chk = hasd.unsqueeze(1) & (jK < n_draft.unsqueeze(1)) & (row >= 0)
        bad, mism = chk & (pred < 0), chk & (dtok != pred)
        ts = _first(bad | mism)
        hit = ts < K
        tsc = ts.clamp(max=K - 1).unsqueeze(1)
        is_bad = hit & bad.gather(1, tsc).squeeze(1)
        err = torch.where(is_bad & (err == 0), 1, err)
        rej = hit & ~is_bad
        ctok = pred.gather(1, tsc).squeeze(1)
        acc = hasd & ~hit
        at = p_len + n_gen
        # a rejection: the drafts before ts and the correction; an acceptance: all drafts
        src = torch.where(rej.unsqueeze(1) & (jK == tsc), ctok.unsqueeze(1), dtok)
        cnt = torch.where(rej, ts + 1, torch.where(acc, n_draft, 0))
        out = _append(out, at, src, cnt)
        corr = corr.scatter(1, (at + ts).clamp(max=corr.shape[1] - 1).unsqueeze(1), rej.unsqueeze(1)) | corr
        n_gen = n_gen + cnt
        ncorr = ncorr + rej.long()
        col0 = torch.zeros(B, 1, dtype=torch.long, device=dev)
        pend = pend.scatter(1, col0, torch.where(rej, ctok, pend[:, 0]).unsqueeze(1))
        n_pend2 = torch.where(rej, 1, n_pend2)
        n_draft2 = torch.where(hasd, 0, n_draft)
        keep_rows = torch.where(rej, base + ts, c)

    # The block (sequences whose drafts were not rejected): stop, completion, the next block.
    cont = live & ~rej
    fin1 = cont & _finished(out, p_len, n_gen, n_draft2, max_new, stop)
    go = cont & ~fin1 & (kk > 0)
    if verify:
        bad2 = go & (c > 0) & (first_tok < 0)
        err = torch.where(bad2 & (err == 0), 2, err)
        bver = torch.where(go & (c > 0), 1, bver)
    masked = (blk == mask_id) & (jK < kk.unsqueeze(1))
    err = torch.where(go & (n_rem > 0) & (n_rev == 0) & ~(verify & ~masked[:, 0]) & (err == 0), 3, err)
    stop_at = _first((jK < kk.unsqueeze(1)) & _is_stop(blk, stop) & (blk != mask_id))
    first_mask = _first(masked).clamp(max=K)
    first_mask = torch.minimum(first_mask, kk)
    stopped = (stop_at < kk) & (first_mask > stop_at)
    credit = n_gen + bver - nfe
    prefix = verify & ((credit < 1) | (n_rev == 0)) if verify else torch.zeros_like(live)
    fb = go & (stopped | (n_rem == 0) | prefix)  # the block is finished by this forward
    keepv = torch.where(stopped, stop_at + 1, torch.where(n_rem == 0, kk, first_mask))
    if verify:
        err = torch.where(fb & ~stopped & (n_rem != 0) & (first_mask == 0) & (err == 0), 5, err)
        to_draft = fb & (keepv > bver)
    else:
        to_draft = torch.zeros_like(live)
    direct = fb & ~to_draft
    out = _append(out, p_len + n_gen, blk, torch.where(direct, keepv, 0))
    n_gen = n_gen + torch.where(direct, keepv, 0)
    cols = jK.expand(B, K)  # the finished block into pend's first k columns
    pend = pend.scatter(1, cols, torch.where(fb.unsqueeze(1), blk, pend.gather(1, cols)))
    n_pend2 = torch.where(fb, keepv, n_pend2)
    n_draft2 = torch.where(to_draft, keepv, n_draft2)
    fin2 = fb & _finished(out, p_len, n_gen, n_draft2, max_new, stop)
    restart = (live & rej & ~_finished(out, p_len, n_gen, n_draft2, max_new, stop)) | (fb & ~fin2 & ~stopped)
    done = done | fin1 | fin2 | (live & rej & ~restart)
    kn = torch.minimum(max_new - n_gen - n_draft2, torch.full_like(k, K)).clamp(min=0)
    # the block: a new one where one starts, this one (revealed in place) where it continues, none elsewhere
    cont_blk = go & ~fb
    k = torch.where(restart, kn, torch.where(cont_blk, k, torch.where(live, 0, k)))
    block = torch.where(
        restart.unsqueeze(1),
        torch.where(jK < kn.unsqueeze(1), mask_id, filler),
        torch.where(cont_blk.unsqueeze(1), blk, torch.where(live.unsqueeze(1), filler, block)),
    )
    bver = torch.where(restart, 0, bver)
    clen = clen + torch.where(live, keep_rows, 0)
    new = (out, n_gen, p_len, pend, n_pend2, n_draft2, block, k, bver, clen, nfe, ncorr, done, corr, err)
    for t, v in zip(st, new, strict=True):
        t.copy_(v)
