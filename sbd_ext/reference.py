"""Pure-PyTorch references of the three sbd_ext ops.

These are the definitions the kernels are tested against: plain tensor code, fp32 math (fp64 where a
comparison with a user threshold decides a discrete outcome), no cleverness. They take and return the same
tensors as the ops in :mod:`sbd_ext.ops` and are shared by the tests and the benchmarks.
"""

from __future__ import annotations

import torch

from .packing import is_bf16_tiles, unpack_row_linear_int8, unpack_row_linear_weight
from .samplers import NAMES as RULES
from .samplers import check_threshold

# (atol, rtol) of an op's output against these references, per input dtype: the one table the op tests, the CUDA
# emulator (tools/cuda_emu) and the model-level tests use. fp32: a 1e-5 relative bar. bf16 / fp16: about the
# error of PyTorch's own low-precision run; tests that need that bar exactly measure PyTorch's error and assert
# against 2x of it (python_tests/test_block_attention.py).
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}
# A whole fp32 model forward through the "sbd" attention against the same model through SDPA: the 1e-5 rounding of
# each attention call compounds over layers, norms and the LM head.
MODEL_TOLERANCE_FP32 = (2e-5, 1e-4)


# --------------------------------------------------------------------------------------------------------
# block_attention
# --------------------------------------------------------------------------------------------------------
def block_attention_mask(
    cache_lens: torch.Tensor, n_commit: torch.Tensor, n_valid: torch.Tensor, T: int, S: int, window_left: int = -1
) -> torch.Tensor:
    """Boolean mask [B, T, S + T]: may new row i of sequence b attend to key column c?

    Columns 0..S-1 are cache slots, S..S+T-1 the new rows of this forward. Row i < n_commit[b] is committed
    (causal over the new rows), n_commit[b] <= i < n_valid[b] is a set-block row (sees every valid new row),
    rows >= n_valid[b] are padding (see nothing). Sliding window (``window_left >= 0``; -1 = none): positions are
    cache slot j -> j, new row i -> cache_lens[b] + i (committed and set-block rows alike), and a row at position
    p also needs the key's position >= p - window_left -- transformers' ``kv > q - sliding_window`` with
    ``window_left = sliding_window - 1``. A set-block row keeps seeing the block rows after it.
    """
    dev = cache_lens.device
    lens = cache_lens.long().view(-1, 1, 1)
    c = n_commit.long().view(-1, 1, 1)
    nv = n_valid.long().view(-1, 1, 1)
    i = torch.arange(T, device=dev).view(1, T, 1)
    col_cache = torch.arange(S, device=dev).view(1, 1, S)
    col_new = torch.arange(T, device=dev).view(1, 1, T)
    row_valid = i < nv
    cache_ok = (col_cache < lens) & row_valid
    new_ok = (col_new < nv) & row_valid & ((i >= c) | (col_new <= i))
    if window_left >= 0:
        first = lens + i - window_left  # [B, T, 1]: the first key position each row sees
        cache_ok = cache_ok & (col_cache >= first)
        new_ok = new_ok & (lens + col_new >= first)
    return torch.cat([cache_ok, new_ok], dim=-1)


def block_attention_length_error(cache_len: int, n_commit: int, n_valid: int, T: int, S: int) -> str | None:
    """Why one sequence's lengths are invalid for a call with T new rows and a cache of S rows, or None.

    The contract of ``sbd_ext.block_attention`` (the kernels check it with sbd::block_attention_length_error, in
    this order): ``cache_len >= 0``, ``0 <= n_commit <= n_valid <= T``, ``cache_len + n_commit <= S``.
    """
    if cache_len < 0:
        return "cache_lens"
    if n_commit < 0:
        return "n_commit"
    if n_valid < 0:
        return "n_valid"
    if n_valid > T:
        return "n_valid > T"
    if n_commit > n_valid:
        return "n_commit > n_valid"
    if cache_len + n_commit > S:
        return "cache overflow"
    return None


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    n_commit: torch.Tensor,
    n_valid: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    window_left: int = -1,
) -> torch.Tensor:
    """Dense masked softmax in fp32; appends committed K/V to the caches in place.

    q [B, Hq, T, D]; k, v [B, Hkv, T, D]; k_cache, v_cache [B, Hkv, S, D]; cache_lens, n_commit, n_valid [B].
    softcap > 0: the scaled scores s become softcap * tanh(s / softcap) before the mask (transformers' eager
    Gemma-2 attention); window_left: the sliding window of :func:`block_attention_mask`.
    Returns [B, T, Hq, D] in q's dtype; padding rows are zero. Invalid lengths raise the ValueError of
    :func:`block_attention_length_error`'s reason (the kernels' contract; a test cannot compare against a reference
    that accepted them). The lengths may live on another device than q (they are read on the host).
    """
    B, Hq, T, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    for b in range(B):
        why = block_attention_length_error(int(cache_lens[b]), int(n_commit[b]), int(n_valid[b]), T, S)
        if why is not None:
            raise ValueError(
                f"reference.block_attention: sequence {b}: {why} (cache_lens {int(cache_lens[b])}, n_commit "
                f"{int(n_commit[b])}, n_valid {int(n_valid[b])}, T {T}, S {S})"
            )
    cache_lens, n_commit, n_valid = (t.to(q.device) for t in (cache_lens, n_commit, n_valid))
    g = Hq // Hkv
    keys = torch.cat([k_cache.float(), k.float()], dim=2).repeat_interleave(g, dim=1)  # [B, Hq, S+T, D]
    # A set-block row's V (never stored: the drafter's rows) with its non-finite values as 0, so that a row that
    # does not see it gets an exact zero from it (probability 0 times NaN would be NaN): the kernels' rule.
    block_row = torch.arange(T, device=q.device).view(1, 1, T, 1) >= n_commit.long().view(B, 1, 1, 1)
    vnew = torch.where(block_row & ~torch.isfinite(v.float()), torch.zeros((), device=q.device), v.float())
    vals = torch.cat([v_cache.float(), vnew], dim=2).repeat_interleave(g, dim=1)
    mask = block_attention_mask(cache_lens, n_commit, n_valid, T, S, window_left)  # [B, T, S+T]
    scores = torch.einsum("bhtd,bhsd->bhts", q.float(), keys) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked (padding) rows -> 0
    out = torch.einsum("bhts,bhsd->bthd", probs, vals)
    for b in range(B):
        L, c = int(cache_lens[b]), int(n_commit[b])
        k_cache[b, :, L : L + c] = k[b, :, :c].to(k_cache.dtype)
        v_cache[b, :, L : L + c] = v[b, :, :c].to(v_cache.dtype)
    return out.to(q.dtype)


# --------------------------------------------------------------------------------------------------------
# entropy_sample
# --------------------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b for a constant a < 2^32 and int64 tensor b < 2^32, without overflow."""
    a1, a0 = a >> 16, a & 0xFFFF
    p0 = a0 * b  # < 2^48
    p1 = a1 * b  # < 2^48
    lo = (((p1 & 0xFFFF) << 16) + p0) & _M32
    hi = (p1 + (p0 >> 16)) >> 16
    return hi & _M32, lo


def _philox4x32_10(c0, c1, c2, c3, k0: int, k1: int):
    """Philox4x32-10 on int64 tensors holding uint32 values; the twin of csrc/include/sbd/philox.h."""
    for _ in range(10):
        hi0, lo0 = _mulhilo32(0xD2511F53, c0)
        hi1, lo1 = _mulhilo32(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def philox_uniform(n_rows: int, vocab: int, seed: int, offset: int, device=None) -> torch.Tensor:
    """Uniforms in (0, 1), [n_rows, vocab] fp32: the draws entropy_sample uses for (seed, offset)."""
    seed &= (1 << 64) - 1
    offset &= (1 << 64) - 1
    n_quads = (vocab + 3) // 4
    quad = torch.arange(n_quads, dtype=torch.int64, device=device).view(1, -1).expand(n_rows, -1)
    row = torch.arange(n_rows, dtype=torch.int64, device=device).view(-1, 1).expand(-1, n_quads)
    c2 = torch.full_like(quad, offset & _M32)
    c3 = torch.full_like(quad, offset >> 32)
    words = torch.stack(_philox4x32_10(quad, row, c2, c3, seed & _M32, seed >> 32), dim=-1)
    words = words.reshape(n_rows, n_quads * 4)[:, :vocab]
    return uniform_from_words(words)


def uniform_from_words(words: torch.Tensor) -> torch.Tensor:
    """Philox words (int64 holding uint32) to uniforms in [2^-24, 1 - 2^-24]: (w >> 9 + 1/2) / 2^23, exact in fp32.

    Never 0 or 1, so the Gumbel noise -log(-log(u)) is finite (the twin of csrc/include/sbd/philox.h).
    """
    return ((words >> 9).float() + 0.5) * (1.0 / 8388608.0)


# Temperatures below this are greedy, as in the kernels (csrc/entropy_sample_checks.h, kGreedyTemperature): logits / T
# would overflow fp32 for large logits, and such a sample differs from the argmax only between logits within ~20 T.
GREEDY_TEMPERATURE = 1e-6


def entropy_sample(
    logits: torch.Tensor, temperature: float = 0.0, seed: int = 0, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropy (nats) and max probability of softmax(logits) and the chosen token, per row.

    logits [N, V] (fp32/bf16/fp16). Token: argmax (first maximum) when temperature < GREEDY_TEMPERATURE, else the
    Gumbel-max sample argmax(logits / T - log(-log(u))) with u from Philox(seed, offset). A row with a NaN or +inf
    logit, or with every logit -inf, is invalid: entropy and max_prob NaN, token -1.
    Returns (entropy fp32 [N], max_prob fp32 [N], token int64 [N]).
    """
    x = logits.float()
    N, V = x.shape
    invalid = torch.isnan(x).any(-1) | torch.isposinf(x).any(-1) | torch.isneginf(x).all(-1)
    xs = x.masked_fill(invalid[:, None], 0.0)
    p = torch.softmax(xs, dim=-1)
    ent = torch.special.entr(p).sum(-1)
    pmax = p.max(-1).values
    if temperature < GREEDY_TEMPERATURE:
        token = xs.argmax(-1)
    else:
        u = philox_uniform(N, V, seed, offset, device=x.device)
        token = (xs / temperature - torch.log(-torch.log(u))).argmax(-1)
    nan = torch.full_like(ent, float("nan"))
    return (
        torch.where(invalid, nan, ent),
        torch.where(invalid, nan, pmax),
        torch.where(invalid, torch.full_like(token, -1), token),
    )


# --------------------------------------------------------------------------------------------------------
# mask_replace
# --------------------------------------------------------------------------------------------------------
def mask_replace(
    tokens: torch.Tensor,
    proposals: torch.Tensor,
    entropy: torch.Tensor,
    max_prob: torch.Tensor,
    mask_id: int,
    rule: str,
    threshold: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reveal masked positions of each block in place by an acceptance rule; see csrc/include/sbd/accept.h.

    tokens [B, K] int64 (modified in place), proposals [B, K] int64, entropy / max_prob [B, K] fp32.
    rule: "eb" (threshold = gamma), "entropy" (gamma) or "confidence" (tau).
    Returns (n_revealed [B], n_remaining [B]) int64.
    """
    if rule not in RULES:
        raise ValueError(f"mask_replace: rule must be one of {RULES}, got {rule!r}")
    threshold = check_threshold(rule, threshold, "mask_replace")  # a string threshold is refused, as by the op
    B, K = tokens.shape
    n_rev = torch.zeros(B, dtype=torch.int64)
    n_rem = torch.zeros(B, dtype=torch.int64)
    reveal_all = torch.zeros(B, K, dtype=torch.bool)
    for b in range(B):
        masked = tokens[b] == mask_id
        score = max_prob[b] if rule == "confidence" else entropy[b]
        cand = masked & (proposals[b] >= 0) & (proposals[b] != mask_id) & ~torch.isnan(score)
        idx = torch.nonzero(cand).flatten()
        reveal = torch.zeros(K, dtype=torch.bool)
        if idx.numel() > 0:
            key = -max_prob[b, idx] if rule == "confidence" else entropy[b, idx]
            order = idx[torch.sort(key, stable=True).indices]  # candidates, best first; ties by position
            h = entropy[b, order].double().clamp_min(0.0)
            if rule == "eb":
                before = torch.cat([h.new_zeros(1), torch.cumsum(h, 0)[:-1]])  # sum of those ranked before
                chosen = order[before <= threshold]
            elif rule == "entropy":
                chosen = order[entropy[b, order].double() < threshold]
            else:
                chosen = order[max_prob[b, order].double() > threshold]
            reveal[order[0]] = True
            reveal[chosen] = True
        reveal_all[b] = reveal
        n_rev[b] = int(reveal.sum())
        n_rem[b] = int(masked.sum()) - n_rev[b]
    tokens[reveal_all.to(tokens.device)] = proposals[reveal_all.to(proposals.device)]
    return n_rev.to(tokens.device), n_rem.to(tokens.device)


# --------------------------------------------------------------------------------------------------------
# row_linear
# --------------------------------------------------------------------------------------------------------
def quantize_x_blocks(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 as row_linear's ``quantize_x`` quantises it: per row, blocks of ``block`` values along K (the
    last may be shorter), ``d = max|x_b| / 127`` and ``q = round(x_b * (127 / max|x_b|))`` (fp32, half to even; 0
    for an all-zero block). A block with a NaN or infinite value gets ``q = 0`` and ``d = NaN``. Returns q [M, K]
    (integers, fp32) and d [M, ceil(K / block)] fp32."""
    M, K = x.shape
    nb = -(-K // block)
    xp = torch.nn.functional.pad(x.float(), (0, nb * block - K)).view(M, nb, block)
    amax = xp.abs().amax(-1)
    finite = torch.isfinite(xp).all(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.where(finite[..., None], torch.round(xp * inv[..., None]), torch.zeros_like(xp))
    d = torch.where(finite, amax / 127.0, torch.full_like(amax, float("nan")))
    return q.view(M, nb * block)[:, :K], d


def quantized_x(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [..., K] as row_linear's ``quantize_x`` sees it: :func:`quantize_x_blocks`'s q times its block's d, fp32,
    x's shape (NaN across a block that held NaN or inf)."""
    K = x.shape[-1]
    q, d = quantize_x_blocks(x.reshape(-1, K), block)
    return (q * d.repeat_interleave(block, dim=1)[:, :K]).view(x.shape)


def row_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, quantize_x: bool = False
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (an int8 weight: times scale [N] per output column; a packed fp32 weight
    [N / 16, K, 16]: the weight it holds, ``weight[n // 16, k, n % 16]``; a packed int8 weight, uint8
    [N / 16, K / 4, 16, 4]: ``weight[n // 16, k // 4, n % 16, k % 4] - 128``), accumulated in float64 and
    returned as fp32 [M, N]. ``quantize_x`` (int8 weight only): x quantised by :func:`quantize_x_blocks`, each
    block's integer dot product times its scale. A bf16 weight in tiles (bf16 [N / 16, K / 32, 16, 32],
    ``weight[n // 16, k // 32, n % 16, k % 32]``): x rounded to bf16 first, as the kernel does."""
    if is_bf16_tiles(weight):
        weight = unpack_row_linear_weight(weight, k=x.shape[1])
        x = x.to(torch.bfloat16)
    if weight.dim() == 3 and weight.dtype in (torch.float32, torch.bfloat16) and weight.shape[2] == 16:  # packed
        weight = unpack_row_linear_weight(weight)  # [N / 16, K, 16] -> [N, K]
    if weight.dim() == 4 and weight.dtype == torch.uint8:  # packed int8: q + 128 in [N / 16, K / 4, 16, 4]
        weight = unpack_row_linear_int8(weight, k=x.shape[1])
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"row_linear: x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if (weight.dtype == torch.int8) != (scale is not None):
        raise ValueError("row_linear: an int8 weight takes scale [N]; an fp32 weight takes none")
    if quantize_x:
        if weight.dtype != torch.int8:
            raise ValueError("row_linear: quantize_x is for an int8 weight")
        q, d = quantize_x_blocks(x)
        M, K = x.shape
        nb = d.shape[1]
        qp = torch.nn.functional.pad(q.double(), (0, nb * 32 - K)).view(M, nb, 32)
        wp = torch.nn.functional.pad(weight.double(), (0, nb * 32 - K)).view(-1, nb, 32)
        dots = torch.einsum("mbk,nbk->mnb", qp, wp)  # exact integers
        return ((dots * d.double()[:, None, :]).sum(-1) * scale.double()).float()
    out = x.double() @ weight.double().t()
    if scale is not None:
        out = out * scale.double()
    return out.float()


def gated_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_b: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor | None = None,
    segments=(),
) -> torch.Tensor:
    """``x W^T + gate[:, None] * ((x A^T) B'^T)`` in float64, returned as fp32 [M, N]: ``weight`` packed [P, K, 16]
    (fp32 or bf16)
    holds W (its first N = 16 * lora_b.size(0) rows) and A (the next r = lora_b.size(1) rows), ``lora_b`` packed
    [N / 16, r, 16] holds B' [N, r]. Rows with gate 0 are ``x W^T`` (their adapter term is not added). An int8
    ``weight`` (packed uint8 [P, K / 4, 16, 4]) with ``scale`` [P * 16]: ``x W^T`` and ``x A^T`` are
    :func:`row_linear` with ``quantize_x`` over those rows. A bf16 ``weight`` in tiles: x rounded to bf16 for both.
    ``segments`` N_1 .. N_S: S projections, ``weight`` their [W_i; A_i] one after another, ``lora_b`` their B'_i:
    each one's definition above, side by side."""
    if len(segments) > 1:
        a_panels, outs, p, bp = -(-lora_b.shape[1] // 16), [], 0, 0
        for n in segments:
            rows = n // 16 + a_panels
            s = None if scale is None else scale[p * 16 : (p + rows) * 16]
            outs.append(gated_lora_linear(x, weight[p : p + rows], lora_b[bp : bp + n // 16], gate, s))
            p, bp = p + rows, bp + n // 16
        return torch.cat(outs, dim=1)
    b = unpack_row_linear_weight(lora_b).double()
    if is_bf16_tiles(weight):
        x = x.to(torch.bfloat16)
    n, r = b.shape
    if scale is not None:
        if x.dim() != 2 or gate.shape != (x.shape[0],) or weight.dim() != 4 or weight.shape[0] * 16 < n + r:
            raise ValueError(
                f"gated_lora_linear: x [M, K], an int8 weight [W; A] packed, lora_b [N / 16, r, 16], gate [M], got "
                f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(lora_b.shape)}, {tuple(gate.shape)}"
            )
        full = row_linear(x, weight, scale, quantize_x=True).double()
        out, h = full[:, :n], full[:, n : n + r]
    else:
        w = unpack_row_linear_weight(weight, k=x.shape[-1]).double()
        if x.dim() != 2 or w.shape[1] != x.shape[1] or w.shape[0] < n + r or gate.shape != (x.shape[0],):
            raise ValueError(
                f"gated_lora_linear: x [M, K], weight [W; A] packed, lora_b [N / 16, r, 16], gate [M], got "
                f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(lora_b.shape)}, {tuple(gate.shape)}"
            )
        xd = x.double()
        out, h = xd @ w[:n].t(), xd @ w[n : n + r].t()
    on = gate != 0
    out[on] += gate.double()[on, None] * (h[on] @ b.t())
    return out.float()


def topk_logsumexp(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_logsumexp's definition: each row of ``x`` [N, V] by a stable descending sort (NaN first, equal values
    lower index first), its first ``k``; and the row's logsumexp in float64, rounded to fp32."""
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    return x.gather(1, order), order, torch.logsumexp(x.double(), dim=-1).float()


def screened_head(
    x: torch.Tensor, weight: torch.Tensor, screen: torch.Tensor, screen_norm: torch.Tensor, exclude: int = -1
) -> torch.Tensor:
    """screened_head's definition as far as its contract goes: the exact head, :func:`row_linear` of ``weight`` (the
    op's largest entry per row, over all columns and over all but ``exclude``, is where this one's is; its other
    values are only bounded: see :func:`sbd_ext.ops.screened_head`)."""
    del screen, screen_norm, exclude
    return row_linear(x, weight)
