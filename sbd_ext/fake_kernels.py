"""The fake (meta) kernels of the sbd_ext ops -- shapes and dtypes only, for torch.compile / FakeTensor tracing --
with the binding's checks on what a fake tensor knows (a compiled graph refuses what the kernel refuses). Imported
by :mod:`sbd_ext.ops`, which registers the ops' Python face; registering happens at import."""

from __future__ import annotations

import torch

from .packing import PANEL, is_bf16_tiles

__all__ = ["row_linear_out_features"]


def row_linear_out_features(weight: torch.Tensor) -> int:
    """N, the output size of row_linear with this weight: [N, K], or packed (fp32 / bf16) [N / 16, K, 16]."""
    packed = weight.dim() == 3 and weight.dtype in (torch.float32, torch.bfloat16) and weight.shape[2] == PANEL
    tiles = is_bf16_tiles(weight)
    return weight.shape[0] * PANEL if packed or tiles or weight.dtype == torch.uint8 else weight.shape[0]


# ---- fake (meta) implementations: shapes and dtypes only, for torch.compile / FakeTensor tracing ----------
@torch.library.register_fake("sbd_ext::block_attention")
def _block_attention_fake(q, k, v, k_cache, v_cache, cache_lens, n_commit, n_valid, scale, softcap=0.0, window_left=-1):
    B, Hq, T, D = q.shape
    return q.new_empty((B, T, Hq, D))


@torch.library.register_fake("sbd_ext::entropy_sample")
def _entropy_sample_fake(logits, temperature, seed, offset):
    N = logits.shape[0]
    f = logits.new_empty((N,), dtype=torch.float32)
    return f, torch.empty_like(f), logits.new_empty((N,), dtype=torch.int64)


@torch.library.register_fake("sbd_ext::mask_replace")
def _mask_replace_fake(tokens, proposals, entropy, max_prob, mask_id, rule, threshold):
    B = tokens.shape[0]
    return tokens.new_empty((B,)), tokens.new_empty((B,))


@torch.library.register_fake("sbd_ext::topk_logsumexp")
def _topk_logsumexp_fake(x, k):
    # The binding's checks (csrc/cpu/topk_logsumexp_cpu.cpp) on what a fake tensor knows.
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"topk_logsumexp: x must be [N, V] float32, got {tuple(x.shape)} {x.dtype}")
    if not 0 <= k <= x.shape[1]:
        raise ValueError(f"topk_logsumexp: k must be in [0, V = {x.shape[1]}], got {k}")
    N = x.shape[0]
    return x.new_empty((N, k)), x.new_empty((N, k), dtype=torch.int64), x.new_empty((N,))


def _check_segments(op: str, weight, lora_b, segments) -> None:
    """check_gated_lora_linear's segments checks: each a positive multiple of 16, summing to N, and weight holding
    each projection's [W_i; A_i]."""
    if not segments:
        return
    n, a_panels = lora_b.shape[0] * PANEL, (lora_b.shape[1] + PANEL - 1) // PANEL
    for s in segments:
        torch._check_value(
            s >= PANEL and s % PANEL == 0 and s <= n,
            lambda: (
                f"{op}: each of segments (a projection's outputs N_i) must be a positive multiple of 16 up to {n}, "
                f"got {list(segments)}"
            ),
        )
    panels = lora_b.shape[0] + a_panels * len(segments)
    torch._check_value(
        sum(segments) == n and weight.shape[0] == panels,
        lambda: (
            f"{op}: segments {list(segments)} must sum to N = {n} and weight hold their [W_i; A_i]: {panels} "
            f"panels, got shape {tuple(weight.shape)}"
        ),
    )


# gated_lora_linear's dtypes other than fp32-only (check_gated_lora_linear), with the binding's spelling
_GATED_DTYPES = {
    "weight": ((torch.float32, torch.bfloat16, torch.uint8), "Float, BFloat16, Byte"),
    "lora_b": ((torch.float32, torch.bfloat16), "Float, BFloat16"),
}


@torch.library.register_fake("sbd_ext::gated_lora_linear")
def _gated_lora_linear_fake(x, weight, lora_b, gate, scale=None, segments=()):
    # The binding's checks (csrc/row_linear_checks.h, check_gated_lora_linear) on what a fake tensor knows.
    op = "gated_lora_linear"
    q8 = weight.dtype == torch.uint8
    for name, t in (("x", x), ("weight", weight), ("lora_b", lora_b), ("gate", gate)):
        allowed, want = _GATED_DTYPES.get(name, ((torch.float32,), "Float"))
        if t.dtype not in allowed:
            raise TypeError(f"{op}: {name} must have dtype {want}, got {t.dtype}")
        if t.device != x.device:
            raise RuntimeError(
                f"{op}: {name} is on {t.device} but x is on {x.device}; all tensors must be on the same device"
            )
    if q8 != (scale is not None):
        raise ValueError(
            f"{op}: a packed int8 [W; A] (uint8) needs its scale [P * 16]"
            if q8
            else f"{op}: scale is for a packed int8 [W; A] (uint8); weight has dtype {weight.dtype}"
        )
    tiles = is_bf16_tiles(weight)
    if q8:
        wdim, wshape = 4, "(packed int8 [W; A]: uint8 [P, ceil(K / 32) * 8, 16, 4])"
    elif tiles:
        wdim, wshape = 4, "(bf16 [W; A] in tiles: [P, ceil(K / 32), 16, 32])"
    else:
        wdim, wshape = 3, "(packed [W; A]: [P, K, 16])"
    dims = {"x": (x, 2, "[M, K]"), "weight": (weight, wdim, wshape)}
    dims.update(lora_b=(lora_b, 3, "(packed scale * B: [N / 16, r, 16])"), gate=(gate, 1, "[M]"))
    if q8:
        dims["scale"] = (scale, 1, "[P * 16]")
    for name, (t, nd, shape) in dims.items():
        if t.dim() != nd:
            raise ValueError(f"{op}: {name} must be {nd}-D {shape}, got shape {tuple(t.shape)}")
    k_w = (x.shape[1] + 31) // 32 * 8 if q8 else (x.shape[1] + 31) // 32 if tiles else x.shape[1]
    k_what = "ceil(x.size(1) / 32) * 8 (K in blocks of 32)" if q8 else "x.size(1) (K)"
    sizes = [
        (weight, "weight", 1, k_w, "ceil(x.size(1) / 32) (K in blocks of 32)" if tiles else k_what),
        (weight, "weight", 2, PANEL, "16 (a packed weight's panels hold 16 rows)"),
        (lora_b, "lora_b", 2, PANEL, "16 (a packed lora_b is [N / 16, r, 16])"),
        (gate, "gate", 0, x.shape[0], "x.size(0) (M)"),
    ]
    if q8:
        sizes += [
            (weight, "weight", 3, 4, "4 (a packed int8 weight is [P, ceil(K / 32) * 8, 16, 4])"),
            (scale, "scale", 0, weight.shape[0] * PANEL, "16 * weight.size(0) (P * 16)"),
        ]
        if scale.dtype != torch.float32:
            raise TypeError(f"{op}: scale must have dtype Float, got {scale.dtype}")
        if scale.device != x.device:
            raise RuntimeError(f"{op}: scale is on {scale.device} but x is on {x.device}")
    if tiles:
        sizes.append((weight, "weight", 3, 32, "32 (a bf16 weight in tiles is [P, ceil(K / 32), 16, 32])"))
    for t, name, d, want, what in sizes:
        msg = f"{op}: {name}.size({d}) must equal {what} = {want}, got shape {tuple(t.shape)}"
        torch._check_value(t.shape[d] == want, lambda msg=msg: msg)
    torch._check_value(
        lora_b.shape[0] >= 1 and lora_b.shape[1] >= 1,
        lambda: f"{op}: lora_b must hold at least one panel and rank r >= 1, got shape {tuple(lora_b.shape)}",
    )
    torch._check_value(
        weight.shape[0] - lora_b.shape[0] >= (lora_b.shape[1] + PANEL - 1) // PANEL,
        lambda: f"{op}: weight must hold the base's {lora_b.shape[0]} panels and A's, got shape {tuple(weight.shape)}",
    )
    _check_segments(op, weight, lora_b, segments)
    for name, t in (("weight", weight), ("lora_b", lora_b), ("gate", gate)) + ((("scale", scale),) if q8 else ()):
        if not t.is_contiguous():
            raise ValueError(
                f"{op}: {name} must be contiguous, got shape {tuple(t.shape)} and strides {t.stride()} "
                "(call .contiguous())"
            )
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{op}: x must be contiguous in its last dimension (stride 1), got strides {x.stride()}")
    return x.new_empty((x.shape[0], lora_b.shape[0] * PANEL))


@torch.library.register_fake("sbd_ext::screened_head")
def _screened_head_fake(x, weight, screen, screen_norm, exclude=-1):
    # The binding's checks (csrc/screened_head_checks.h) on what a fake tensor knows.
    op = "screened_head"
    want = {"x": (x, torch.float32, 2), "weight": (weight, torch.float32, 3), "screen": (screen, torch.bfloat16, 3)}
    want["screen_norm"] = (screen_norm, torch.float32, 1)
    for name, (t, dtype, dim) in want.items():
        if t.dtype != dtype:
            raise TypeError(f"{op}: {name} must have dtype {dtype}, got {t.dtype}")
        if t.dim() != dim:
            raise ValueError(f"{op}: {name} must be {dim}-D, got shape {tuple(t.shape)}")
        if t.device != x.device:
            raise RuntimeError(
                f"{op}: {name} is on {t.device} but x is on {x.device}; all tensors must be on the same device"
            )
    if weight.shape[1] != x.shape[1] or weight.shape[2] != PANEL or tuple(screen.shape) != tuple(weight.shape):
        raise ValueError(
            f"{op}: weight and screen must be [P, K, 16] with K = x.size(1) = {x.shape[1]}, got {tuple(weight.shape)} "
            f"and {tuple(screen.shape)}"
        )
    n, v = weight.shape[0] * PANEL, screen_norm.shape[0]
    if not (n - PANEL < v <= n and v >= 1) or not -1 <= exclude < v:
        raise ValueError(f"{op}: screen_norm has one entry per real row of the head and exclude is -1 or one of them")
    return x.new_empty((x.shape[0], n))


@torch.library.register_fake("sbd_ext::row_linear")
def _row_linear_fake(x, weight, scale=None, quantize_x=False):
    # The binding's checks (csrc/row_linear_checks.h) on what a fake tensor knows: dtype, rank, K, N, device. This
    # is also the Meta kernel, which the dispatcher picks for a meta x with a weight on another device.
    allowed = {"x": (torch.float32, torch.bfloat16), "weight": (torch.float32, torch.int8, torch.uint8, torch.bfloat16)}
    names = {torch.float32: "Float", torch.int8: "Char", torch.uint8: "Byte", torch.bfloat16: "BFloat16"}
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in allowed[name]:
            want = ", ".join(names[d] for d in allowed[name])
            raise TypeError(f"row_linear: {name} must have dtype {want}, got {t.dtype}")
        packed = (
            name == "weight" and t.dim() == 3 and t.dtype in (torch.float32, torch.bfloat16) and t.shape[2] == PANEL
        )
        tiles = name == "weight" and is_bf16_tiles(t)
        if tiles and (t.shape[2] != PANEL or t.shape[3] != 32):
            raise ValueError(
                "row_linear: weight.size(2) and .size(3) must be 16 and 32 (a bf16 weight in tiles is "
                f"[N / 16, ceil(K / 32), 16, 32]), got shape {tuple(t.shape)}"
            )
        if name == "weight" and t.dtype == torch.uint8:
            if t.dim() != 4 or t.shape[2] != PANEL or t.shape[3] != 4:
                raise ValueError(
                    f"row_linear: weight must be 4-D (a packed int8 weight: uint8 [N / 16, ceil(K / 32) * 8, 16, 4]), "
                    f"got shape {tuple(t.shape)}"
                )
        elif t.dim() != 2 and not packed and not tiles:
            raise ValueError(f"row_linear: {name} must be 2-D [{'M' if name == 'x' else 'N'}, K], got {tuple(t.shape)}")
    if x.dtype == torch.bfloat16 and weight.dtype != torch.bfloat16:
        raise TypeError(
            f"row_linear: bf16 x goes with a bf16 weight (a bf16 layer); weight has dtype {weight.dtype} "
            "(pass x in fp32)"
        )
    for name, t in (("weight", weight),) + ((("scale", scale),) if scale is not None else ()):
        if t.device != x.device:
            raise RuntimeError(
                f"row_linear: {name} is on {t.device} but x is on {x.device}; all tensors must be on the same device"
            )
    q8_packed = weight.dtype == torch.uint8
    if q8_packed:
        torch._check_value(
            weight.shape[1] == (x.shape[1] + 31) // 32 * 8,
            lambda: (
                f"row_linear: weight.size(1) must equal ceil(x.size(1) / 32) * 8 (K in blocks of 32) = "
                f"{(x.shape[1] + 31) // 32 * 8}, got shape {tuple(weight.shape)}"
            ),
        )
        if not quantize_x:
            raise ValueError(
                "row_linear: a packed int8 weight (uint8 [N / 16, K / 4, 16, 4]) multiplies int8 x: "
                "pass quantize_x=True"
            )
    elif is_bf16_tiles(weight):
        torch._check_value(
            weight.shape[1] == (x.shape[1] + 31) // 32,
            lambda: (
                f"row_linear: weight.size(1) must equal ceil(x.size(1) / 32) (K in blocks of 32) = "
                f"{(x.shape[1] + 31) // 32}, got shape {tuple(weight.shape)}"
            ),
        )
    else:
        torch._check_value(
            weight.shape[1] == x.shape[1],
            lambda: (
                f"row_linear: weight.size(1) must equal x.size(1) (K) = {x.shape[1]}, got shape {tuple(weight.shape)}"
            ),
        )
    n = row_linear_out_features(weight)
    if weight.dtype in (torch.int8, torch.uint8):
        if scale is None:
            raise ValueError("row_linear: an int8 weight needs scale [N] fp32 (one scale per weight row), got None")
        if scale.dtype != torch.float32:
            raise TypeError(f"row_linear: scale must have dtype Float, got {scale.dtype}")
        if scale.dim() != 1:
            raise ValueError(f"row_linear: scale must be 1-D [N], got shape {tuple(scale.shape)}")
        what = "16 * weight.size(0) (N)" if q8_packed else "weight.size(0) (N)"
        torch._check_value(
            scale.shape[0] == n,
            lambda: f"row_linear: scale.size(0) must equal {what} = {n}, got shape {tuple(scale.shape)}",
        )
    elif scale is not None:
        raise ValueError(f"row_linear: scale is for an int8 weight; weight has dtype {weight.dtype} (pass scale=None)")
    if quantize_x and weight.dtype not in (torch.int8, torch.uint8):
        raise ValueError(
            f"row_linear: quantize_x=True multiplies int8 x with an int8 weight; weight has dtype {weight.dtype} "
            "(quantise the weight, or pass quantize_x=False)"
        )
    return x.new_empty((x.shape[0], row_linear_out_features(weight)))  # x's dtype: fp32, or bf16 with a bf16 weight
