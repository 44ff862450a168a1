"""Typed Python wrappers of the sbd_ext ops, and their fake (meta) implementations for torch.compile.

The ops are defined once in csrc/ops.cpp (``torch.ops.sbd_ext.<name>``), implemented per device in
csrc/cpu/<name>_cpu.cpp and csrc/cuda/<name>_cuda.cpp, and have pure-PyTorch references of the same name in
:mod:`sbd_ext.reference`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from . import _C
from .fake_kernels import row_linear_out_features  # noqa: F401  (re-exported; the import registers the fake kernels)
from .samplers import check_threshold, get_sampler

__all__ = [
    "block_attention",
    "check_cuda_errors",
    "entropy_sample",
    "gated_lora_linear",
    "mask_replace",
    "row_linear",
    "row_linear_out_features",
    "screened_head",
    "topk_logsumexp",
]

_U64 = 1 << 64
_I64_MIN, _I64_END = -(1 << 63), 1 << 63


def _as_int(x, op: str, name: str) -> int:
    """x as a Python int: ints, integer NumPy scalars and 0-d integer tensors; not floats, bools or strings."""
    if isinstance(x, bool):
        raise TypeError(f"{op}: {name} must be an integer, got a bool ({x})")
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{op}: {name} must be an integer, got {type(x).__name__} {x!r}") from None


def _as_float(x, op: str, name: str) -> float:
    """x as a Python float: ints, floats, NumPy scalars and 0-d tensors; not bools or strings (float("0.5") is 0.5)."""
    if isinstance(x, (bool, str, bytes)):
        raise TypeError(f"{op}: {name} must be a number, got {type(x).__name__} {x!r}")
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: {name} must be a number, got {type(x).__name__} {x!r}") from None


def _as_int64(x: int, name: str) -> int:
    """Map a seed/offset in [-2^63, 2^64) onto the int64 the schema carries (same 64 bits)."""
    x = _as_int(x, "entropy_sample", name)
    if not _I64_MIN <= x < _U64:
        raise ValueError(f"entropy_sample: {name} must fit in 64 bits ([-2**63, 2**64)), got {x}")
    return x - _U64 if x >= _I64_END else x


def _check_tensors(op: str, named: dict, differentiable: tuple[str, ...] = ()) -> None:
    """Every argument a tensor on the first one's device (mixed devices would let the dispatcher pick the Meta
    kernel -- the shapes-only fake -- for a mix of meta and CPU tensors, returning uninitialised memory), and no
    ``differentiable`` input requiring grad while grad mode is on (the ops have no backward: a silent None grad)."""
    ref_name, ref = next(iter(named.items()))
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != ref.device:
            raise RuntimeError(
                f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; all tensors must be on the same "
                f"device"
            )
    if torch.is_grad_enabled():
        grads = [name for name in differentiable if named[name].requires_grad]
        if grads:
            raise RuntimeError(
                f"{op} has no backward, but {', '.join(grads)} require(s) grad: call it under torch.no_grad() / "
                f"torch.inference_mode(), or detach the inputs (for training use an attention with a backward, e.g. "
                f"SDPA)"
            )


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    n_commit: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    window_left: int = -1,
) -> torch.Tensor:
    """Attention of T new rows over a KV cache plus themselves, appending the committed rows' K/V in place.

    Args:
        q: [B, Hq, T, D] queries (fp32, bf16 or fp16; any strides with a unit last stride).
        k, v: [B, Hkv, T, D] keys / values of the same T new rows, Hq = g * Hkv (GQA).
        k_cache, v_cache: [B, Hkv, S, D] caches, same dtype as q; rows [0, cache_lens[b]) are valid.
            Mutated: rows [cache_lens[b], cache_lens[b] + n_commit[b]) receive the committed rows' K/V.
        cache_lens: [B] int32/int64, valid cache rows per sequence.
        n_commit: [B] committed (causal) new rows per sequence, at the front; default T (plain causal).
        n_valid: [B] valid new rows per sequence; rows [n_commit, n_valid) are a set block that attends
            bidirectionally to every valid new row; rows >= n_valid are padding (output 0). Default T.
        scale: softmax scale, default D ** -0.5.
        softcap: logit soft-capping (Gemma-2's ``attn_logit_softcapping``): the scaled scores s become
            ``softcap * tanh(s / softcap)`` before the mask and softmax. None or 0: off. A finite number >= 0.
        window_left: sliding window (FlashInfer's ``window_left``): new row i of sequence b sits at position
            ``cache_lens[b] + i`` (cache row j at j) and sees only keys at positions ``>= position - window_left``,
            on top of the causal / set-block rule (a set-block row still sees the block rows after it).
            transformers' ``sliding_window = W`` (``kv > q - W``) is ``window_left = W - 1``. -1: no window.

    Returns:
        [B, T, Hq, D] in q's dtype (the layout the o_proj consumes). Accumulation is fp32. On the CPU a row's
        output does not depend on the other rows of the call (batch invariance, docs/ops.md), and the V of a set-block
        row is read with its non-finite values as 0 (a row that does not see it gets an exact zero from it; the
        reference has the same rule; the CUDA kernels do not have it yet).
    The lengths are not updated: after the last layer the caller adds n_commit to cache_lens.

    Invalid lengths (negative, ``n_commit > n_valid``, ``n_valid > T``, ``cache_lens + n_commit > S``) raise a
    ValueError naming the argument and the sequence. On the CPU it is raised by this call. On CUDA the lengths stay
    on the device (reading them would synchronise and break CUDA-graph capture), so the kernel checks them: an
    invalid sequence gets zero output rows and no cache write -- no lengths can make the kernel touch memory
    outside its tensors -- and the same error is raised by the next CUDA ``block_attention`` call, or at once by
    :func:`check_cuda_errors`. Every mutated tensor (k_cache, v_cache) must not share memory with itself or with
    any other argument (ValueError). On CUDA the head dim must be 32, 64 or 128 and the caches' rows 16-byte aligned.
    """
    lengths = {"cache_lens": cache_lens, "n_commit": n_commit, "n_valid": n_valid}
    named = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, **{n: t for n, t in lengths.items() if t is not None})
    _check_tensors("block_attention", named, ("q", "k", "v", "k_cache", "v_cache"))
    B, T = q.shape[0], q.shape[2] if q.dim() == 4 else 0
    if n_commit is None:
        n_commit = torch.full((B,), T, dtype=torch.int32, device=q.device)
    if n_valid is None:
        n_valid = torch.full((B,), T, dtype=torch.int32, device=q.device)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    softcap = 0.0 if softcap is None else _as_float(softcap, "block_attention", "softcap")
    window_left = _as_int(window_left, "block_attention", "window_left")
    if not _I64_MIN <= window_left < _I64_END:
        raise ValueError(f"block_attention: window_left must be >= 0 or -1 (no window), got {window_left}")
    return torch.ops.sbd_ext.block_attention(
        q, k, v, k_cache, v_cache, cache_lens, n_commit, n_valid, float(scale), softcap, window_left
    )


def check_cuda_errors() -> None:
    """Raise the invalid-lengths error a CUDA ``block_attention`` kernel found since the last check, if any.

    Synchronises the current CUDA device first, so every call made before this one has been checked. The error is
    the ValueError the CPU raises for the same lengths. Without CUDA kernels (or a GPU) this does nothing.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    msg = _C.take_cuda_error()
    if msg:
        raise ValueError(msg)


def entropy_sample(
    logits: torch.Tensor, temperature: float = 0.0, seed: int = 0, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropy, max-probability and chosen token of each row of logits, in one pass over the vocabulary.

    Args:
        logits: [N, V] fp32, bf16 or fp16, unit stride along V. -inf entries are banned tokens.
        temperature: 0 picks the argmax (first maximum); T > 0 draws from softmax(logits / T) by Gumbel-max.
            Temperatures below ``sbd_ext.reference.GREEDY_TEMPERATURE`` (1e-6) are greedy too: below it logits / T
            overflows fp32 for large logits, and a sample differs from the argmax only between logits within ~20 T.
            A finite number >= 0 that fits in fp32.
        seed, offset: the Philox stream, integers in [-2**63, 2**64) (values >= 2**63 are their two's complement
            int64, the same 64 bits); the draw of row r is a pure function of (seed, offset, r), and the token is
            identical on CPU and CUDA (every score is computed with the same correctly rounded operations).
            Advance ``offset`` between calls that must draw independently.

    Returns:
        (entropy fp32 [N] in nats, max_prob fp32 [N], token int64 [N]), the first two of softmax(logits) at
        temperature 1. A row with a NaN or +inf logit, or with all logits -inf, is invalid: NaN, NaN, -1.
    """
    _check_tensors("entropy_sample", dict(logits=logits), ("logits",))
    return torch.ops.sbd_ext.entropy_sample(
        logits,
        _as_float(temperature, "entropy_sample", "temperature"),
        _as_int64(seed, "seed"),
        _as_int64(offset, "offset"),
    )


def mask_replace(
    tokens: torch.Tensor,
    proposals: torch.Tensor,
    entropy: torch.Tensor,
    max_prob: torch.Tensor,
    mask_id: int,
    rule: str = "eb",
    threshold: float = 0.35,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reveal masked positions of each block in place, by an acceptance rule.

    Args:
        tokens: [B, K] int64 block tokens, ``mask_id`` where still masked. Mutated in place.
        proposals: [B, K] int64 proposed token per position (from :func:`entropy_sample`; -1 = invalid row).
        entropy, max_prob: [B, K] fp32 statistics of each position's distribution.
        mask_id: the mask token id.
        rule: a sampler of the registry (:mod:`sbd_ext.samplers`): ``"eb"`` entropy-bounded (paper Eq. 8,
            threshold = gamma); ``"entropy"`` reveal H < gamma; ``"confidence"`` reveal max_prob > tau
            (threshold = tau). At least one candidate is revealed.
        threshold: gamma (>= 0) or tau, a number (not NaN).

    Returns:
        (n_revealed [B], n_remaining [B]) int64, on tokens' device. No host synchronisation happens inside.
        A sequence with masked positions left but none revealed has only invalid (NaN-logit) proposals.
    ``tokens`` must not share memory with itself (an expanded view) or with the other inputs (ValueError).
    """
    _check_tensors("mask_replace", dict(tokens=tokens, proposals=proposals, entropy=entropy, max_prob=max_prob))
    mask_id = _as_int(mask_id, "mask_replace", "mask_id")
    if not _I64_MIN <= mask_id < _I64_END:
        raise ValueError(f"mask_replace: mask_id must be a token id that fits in int64, got {mask_id}")
    rule = get_sampler(rule, "mask_replace: rule").name
    threshold = check_threshold(rule, threshold, "mask_replace")
    return torch.ops.sbd_ext.mask_replace(tokens, proposals, entropy, max_prob, mask_id, rule, threshold)


def row_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, quantize_x: bool = False
) -> torch.Tensor:
    """``x @ weight.T`` for the few rows of a decoding forward: what ``torch.nn.functional.linear(x, weight)``
    computes, with a CPU kernel that reads the weight once for all rows (see csrc/cpu/row_linear_kernel.cpp).

    Args:
        x: [M, K] fp32 (or bf16, with a bf16 weight), contiguous along K (rows may be strided).
        weight: [N, K] (``nn.Linear.weight``'s layout), contiguous along K, on x's device: fp32, bf16 (a bf16 layer:
            widened exactly, summed in fp32), or int8 for weight-only quantisation (:func:`sbd_ext.quantize`); or fp32
            packed in panels of 16 weight rows,
            [N / 16, K, 16] contiguous (:func:`sbd_ext.packing.pack_row_linear_weight`;
            ``sbd_ext.quantize(model, "packed")``), which
            the CPU kernel multiplies at the FMA rate (one weight vector times a broadcast x value per step, no
            lane sums).
        scale: None for an fp32 weight; [N] fp32 for an int8 one (one scale per weight row): the result is then
            ``(x @ weight.float().T) * scale``.
        quantize_x: int8 weight only: quantise x too, per row in blocks of 32 values along K (llama.cpp's Q8_0
            activations: ``d = max|x_block| / 127``, ``q = round(x_block * 127 / max|x_block|)``, half to even), and
            multiply int8 x int8 (:func:`sbd_ext.quantize` ``"w8a8"``). A block holding NaN or inf makes its row's
            outputs NaN. :func:`sbd_ext.reference.row_linear` is the exact definition.

    Returns:
        [M, N] in x's dtype (bf16 x: the fp32 sums rounded once). Each output is summed in one fixed order, the same
        whatever the row count, the tile a row falls in or the thread count (batch invariance: a row's result is the
        one it gets alone); the result equals F.linear's to fp32 rounding. Any M: past 32 rows (a prefill) a plain
        fp32 weight runs the framework's GEMM (F.linear's, whose sums may depend on the row and thread counts) and
        every other weight runs the kernel on slices of 32 rows. No backward
        (an input requiring grad while grad mode is on is refused). On CUDA it is cuBLAS (an int8 weight is widened
        to fp32 first).
    """
    named = dict(x=x, weight=weight) if scale is None else dict(x=x, weight=weight, scale=scale)
    _check_tensors("row_linear", named, tuple(named))
    if not isinstance(quantize_x, bool):
        raise TypeError(f"row_linear: quantize_x must be a bool, got {type(quantize_x).__name__}")
    return torch.ops.sbd_ext.row_linear(x, weight, scale, quantize_x)


def screened_head(
    x: torch.Tensor, weight: torch.Tensor, screen: torch.Tensor, screen_norm: torch.Tensor, exclude: int = -1
) -> torch.Tensor:
    """A greedy decoder's output head at about the bytes of a bf16 one, with the fp32 head's choice: the head runs over
    its bf16 copy (``screen``) and the few columns whose exact value may be a row's largest run again over the fp32
    panels (csrc/cpu/screened_head_cpu.cpp; the bound it screens with is derived there). Two rows or more (one on
    an AMD Zen 4: ``build_info()["cpu_screen_pairs_rows"]``) screen with bf16 products (x rounded to bf16 too, a
    wider bound) where the CPU has them (AVX512-BF16); ``sbd_ext._C.set_screen_pairs(False)`` keeps the widened
    fp32 products. Neither changes a row's choice.

    Args:
        x: [M, K] fp32, contiguous along K.
        weight: the fp32 head packed in panels, [P, K, 16] contiguous (:func:`sbd_ext.packing.pack_row_linear_weight`).
        screen, screen_norm: :func:`sbd_ext.packing.pack_screened_head` of the same head: its rows in bf16, [P, K, 16],
            and their L2 norms [V] (V: the head's real rows, P * 16 - 16 < V <= P * 16).
        exclude: -1, or a row id that a caller bans (a mask token): the largest entry over the other columns is
            exact too.

    Returns:
        [M, P * 16] fp32 logits for argmax: each row's largest entry, over all columns and over all columns but
        ``exclude``, is where ``row_linear(x, weight)``'s is (equal values: the lower index) -- the columns that may
        hold it (and ``exclude``'s) carry row_linear's values bit for bit, every other column the screen's value,
        below the row's largest and within the bound of the exact one. Not a distribution to sample from or to
        take the entropy of. A row with a NaN or infinite value, or a call whose candidates fill more than an eighth
        of the panels, gets the fp32 head whole. On CUDA the fp32 head whole. No backward.
        :func:`sbd_ext.reference.screened_head` is the definition.
    """
    named = dict(x=x, weight=weight, screen=screen, screen_norm=screen_norm)
    _check_tensors("screened_head", named, ("x",))
    return torch.ops.sbd_ext.screened_head(x, weight, screen, screen_norm, _as_int(exclude, "screened_head", "exclude"))


def gated_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_b: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor | None = None,
    segments: Sequence[int] = (),
) -> torch.Tensor:
    """A projection with a gated LoRA adapter in one call: ``x W^T + gate[:, None] * ((x A^T) B'^T)``, the CPU kernel
    of a compiled drafter step over a packed base (:meth:`sbd_ext.drafter.GatedLoRALinear.fused_weight`); with
    ``segments``, S sibling projections of one input at once (:mod:`sbd_ext.merged_linears`).

    Args:
        x: [M, K] fp32, contiguous along K (rows may be strided).
        weight: fp32 or bf16 packed in panels of 16 rows ([P, K, 16], contiguous;
            :func:`sbd_ext.packing.pack_row_linear_weight`): the base's N rows W (N = 16 * lora_b.size(0)), then the
            adapter's r rows A (r = lora_b.size(1)), zero rows to whole panels (``pad=True``):
            P >= N / 16 + ceil(r / 16). Or (w8a8) int8 [W; A] in row_linear's packed int8 layout (uint8
            [P, ceil(K / 32) * 8, 16, 4]: :func:`sbd_ext.packing.pack_row_linear_int8`) with ``scale``: then x is
            quantised per block of 32 once for W and A, as ``row_linear(..., quantize_x=True)`` does.
        lora_b: B' = scale * B [N, r], packed: [N / 16, r, 16] contiguous, fp32 or bf16 (widened: the same sums
            as the fp32 panels of its values, half the bytes).
        gate: [M] fp32, one factor per row (the drafter's 0/1 block-row gate).
        scale: with an int8 weight only: [P * 16] fp32, one per row of [W; A] (any value on the padding rows).
        segments: empty (one projection), or the outputs N_1 .. N_S (multiples of 16, summing to N) of S projections
            with adapters of one rank r: ``weight`` is their [W_1; A_1; ...; W_S; A_S] (each A_i padded to whole
            panels, exactly that many panels), ``lora_b`` their B'_i one after another, ``scale`` their scales alike.

    Returns:
        [M, N] fp32 (with ``segments``: projection i's outputs in columns N_1 + .. + N_(i-1) onward, each bit for bit
        what a call on its own [W_i; A_i] and B'_i gives). A row with gate 0 is ``row_linear(x, W)`` bit for bit
        (``row_linear(x, W, scale[:N], True)`` for
        an int8 weight: the base's own call over the same panels; its adapter is not computed); the other rows add
        ``gate * (x A^T) B'^T`` (the B product of those rows only). Sums run in a fixed order, independent of the
        thread count. CPU only (a CUDA drafter step merges the adapter into the weight instead); no backward.
        :func:`sbd_ext.reference.gated_lora_linear` is the definition.
    """
    named = dict(x=x, weight=weight, lora_b=lora_b, gate=gate) | ({} if scale is None else dict(scale=scale))
    _check_tensors("gated_lora_linear", named, tuple(named))
    if isinstance(segments, (str, bytes, torch.Tensor)) or not isinstance(segments, Sequence):
        raise TypeError(f"gated_lora_linear: segments must be a sequence of ints, got {type(segments).__name__}")
    segments = [_as_int(s, "gated_lora_linear", "segments[i]") for s in segments]
    if x.device.type not in ("cpu", "meta"):
        raise NotImplementedError(
            f"gated_lora_linear: the op has a CPU kernel only, got tensors on {x.device} (a compiled CUDA drafter step "
            "merges the adapter into the weight: GatedLoRALinear.merged_weight)"
        )
    return torch.ops.sbd_ext.gated_lora_linear(x, weight, lora_b, gate, scale, segments)


def topk_logsumexp(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``k`` largest entries and the log of its softmax's denominator, what a sampler head's rescoring
    reads of a vocabulary row (:meth:`sbd_ext.drafter.SamplerHead.rescore_`).

    Args:
        x: [N, V] fp32, contiguous along V.
        k: 0 <= k <= V.

    Returns:
        (values [N, k] fp32, indices [N, k] int64, lse [N] fp32): the top ``k`` of each row ordered by value
        descending, equal values by index ascending (NaN above every number, as :func:`torch.topk` ranks it), and
        :func:`torch.logsumexp` of the row (NaN for a row with a NaN, its max where that is infinite). On the CPU one
        kernel call (two sweeps of each row); on other devices :func:`torch.topk` (its order among equal values)
        and :func:`torch.logsumexp`. :func:`sbd_ext.reference.topk_logsumexp` is the definition.
    """
    _check_tensors("topk_logsumexp", dict(x=x), ("x",))
    if not isinstance(k, int) or isinstance(k, bool):
        raise TypeError(f"topk_logsumexp: k must be an int, got {type(k).__name__}")
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"topk_logsumexp: x must be [N, V] float32, got {tuple(x.shape)} {x.dtype}")
    if not 0 <= k <= x.shape[1]:
        raise ValueError(f"topk_logsumexp: k must be in [0, V = {x.shape[1]}], got {k}")
    if x.device.type in ("cpu", "meta"):
        return torch.ops.sbd_ext.topk_logsumexp(x, k)
    values, indices = x.topk(k, dim=-1)
    return values, indices, x.logsumexp(-1)
