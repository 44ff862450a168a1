"""row_linear's packed weight layouts (:func:`sbd_ext.ops.row_linear` takes them as its ``weight``): fp32 or bf16 in
panels of 16 weight rows, bf16 in tiles for AMX-BF16, and int8 for int8 x. The same values, moved, so that the CPU
kernel multiplies a whole panel vector per step (csrc/cpu/row_linear_kernel.cpp). ``sbd_ext.quantize(model,
"packed")`` / ``"bf16"`` / ``"w8a8"`` use them in a model (sbd_ext/quantization.py)."""

from __future__ import annotations

import torch

__all__ = [
    "PANEL",
    "constant_weight",
    "is_bf16_tiles",
    "pack_row_linear_int8",
    "pack_row_linear_weight",
    "pack_screened_head",
    "unpack_row_linear_int8",
    "unpack_row_linear_weight",
]

PANEL = 16  # weight rows per panel of a packed row_linear weight (csrc/cpu/row_linear_kernel.h kRowLinearPanel)


def constant_weight(t: torch.Tensor) -> torch.nn.Parameter:
    """``t`` (the same storage, not a copy) as an ``nn.Parameter`` that needs no gradient, for a converted weight kept
    in a module *buffer* (a packed or int8 weight, its scales, a drafter's fused copy): it stays a buffer (in
    ``model.buffers()``, not ``model.parameters()``; state_dict and ``.to()`` as before), but torch.compile treats it as
    it treats the model's parameters. dynamo keeps every non-parameter tensor of a compiled call in the guards it
    checks even when told to skip guards (its "diff" guards) and checks that no two of them alias: with ~500 such
    weights a SmolLM2 step paid ~1 ms of guards per call that parameters do not cost."""
    if isinstance(t, torch.nn.Parameter) and not t.requires_grad:
        return t
    return torch.nn.Parameter(t, requires_grad=False)


def _checked(fn: str, weight: torch.Tensor, dtypes: tuple, wrong_dtype: str, pad: bool) -> tuple[int, int]:
    """(N, K) of a 2-D ``weight`` of one of ``dtypes`` to pack; N a multiple of 16 unless ``pad``."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{fn}: weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype not in dtypes:
        raise TypeError(f"{fn}: {wrong_dtype}, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{fn}: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if n % PANEL != 0 and not pad:
        raise ValueError(
            f"{fn}: N = {n} weight rows is not a multiple of {PANEL} (panels of {PANEL}; pad=True pads it with "
            "zero rows)"
        )
    return n, k


def is_bf16_tiles(packed: torch.Tensor) -> bool:
    """Whether ``packed`` is a bf16 weight in tiles (:func:`pack_row_linear_weight` with ``tiles=True``)."""
    return packed.dim() == 4 and packed.dtype == torch.bfloat16


def layout(packed: torch.Tensor) -> str:
    """A packed fp32 / bf16 weight's dtype and layout, in words (a layer's repr)."""
    where = "tiles of 16 x 32 (AMX-BF16)" if is_bf16_tiles(packed) else f"panels of {PANEL}"
    return f"{str(packed.dtype)[6:]} packed in {where}"


def pack_row_linear_weight(weight: torch.Tensor, pad: bool = False, tiles: bool = False) -> torch.Tensor:
    """An fp32 or bf16 weight [N, K] in row_linear's panel layout: [N / 16, K, 16] of its dtype, contiguous, where
    weight row ``n``, column ``k`` is ``packed[n // 16, k, n % 16]`` (the same values, moved). N must be a multiple
    of 16, or, with ``pad=True``, is padded with zero rows up to one (row_linear then returns the zero rows'
    outputs, 0, too: slice them off). A new tensor (the weight is not changed); :func:`unpack_row_linear_weight` is
    its inverse.

    ``tiles`` (bf16 only; ``sbd_ext.quantize(model, "bf16")`` asks for it where
    :func:`sbd_ext.linear.bf16_tiles_in_use`): the layout of AMX-BF16's tiles instead, bf16 [N / 16, ceil(K / 32),
    16, 32] with K padded with zeros, where weight row ``n``, column ``k`` is
    ``packed[n // 16, k // 32, n % 16, k % 32]``. row_linear then rounds x to bf16 (to nearest even) and sums the
    exact products in fp32 on the tiles: 16 x rows cost what one costs. The panel layout keeps x in fp32."""
    n, k = _checked(
        "pack_row_linear_weight",
        weight,
        (torch.float32, torch.bfloat16),
        "the packed layout is for fp32 or bf16 weights",
        pad,
    )
    if tiles and weight.dtype != torch.bfloat16:
        raise TypeError(f"pack_row_linear_weight: tiles=True is for bf16 weights, got {weight.dtype}")
    if n % PANEL != 0:
        weight = torch.nn.functional.pad(weight.detach(), (0, 0, 0, -n % PANEL))
        n = weight.shape[0]
    if tiles:
        w = torch.nn.functional.pad(weight.detach(), (0, -k % 32))
        return w.reshape(n // PANEL, PANEL, -1, 32).transpose(1, 2).contiguous()
    return weight.detach().reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def unpack_row_linear_weight(packed: torch.Tensor, n: int | None = None, k: int | None = None) -> torch.Tensor:
    """[N / 16, K, 16] (:func:`pack_row_linear_weight`), or bf16 in tiles [N / 16, K / 32, 16, 32], back to [N, K],
    contiguous; ``n``: keep the first n rows (a padded pack's true N); ``k``: the first k columns (tiles pad K)."""
    if is_bf16_tiles(packed):
        if packed.shape[2] != PANEL or packed.shape[3] != 32:
            raise ValueError(
                f"unpack_row_linear_weight: a bf16 weight in tiles is [N / {PANEL}, K / 32, {PANEL}, 32], got "
                f"{tuple(packed.shape)}"
            )
        p, kb = packed.shape[:2]
        w = packed.transpose(1, 2).reshape(p * PANEL, kb * 32)
        return w[: p * PANEL if n is None else n, : kb * 32 if k is None else k].contiguous()
    if packed.dim() != 3 or packed.shape[2] != PANEL:
        raise ValueError(
            f"unpack_row_linear_weight: a packed weight is [N / {PANEL}, K, {PANEL}], got {tuple(packed.shape)}"
        )
    p, k, _ = packed.shape
    w = packed.transpose(1, 2).reshape(p * PANEL, k)
    return w if n is None or n == p * PANEL else w[:n].contiguous()


def pack_row_linear_int8(weight_int8: torch.Tensor, pad: bool = False) -> torch.Tensor:
    """An int8 weight [N, K] (:func:`sbd_ext.quantization.quantize_weight`) in row_linear's packed int8 layout, for
    int8 x (``quantize_x=True``): uint8 [N / 16, ceil(K / 32) * 8, 16, 4], contiguous, where weight row ``n``'s
    values ``4j .. 4j + 3`` are ``packed[n // 16, j, n % 16, :] - 128`` (stored as q + 128; K is padded with zeros to
    whole blocks of 32). With AVX512-VNNI the CPU kernel multiplies it with one ``vpdpbusd`` per 64 products. N must
    be a multiple of 16, or, with ``pad=True``, is padded with zero rows (their outputs are 0: slice them off).
    :func:`unpack_row_linear_int8` is the inverse."""
    n, k = _checked("pack_row_linear_int8", weight_int8, (torch.int8,), "the weight must be int8", pad)
    n_pad, k_pad = -n % PANEL, -k % 32
    w = torch.nn.functional.pad(weight_int8.detach().to(torch.int16), (0, k_pad, 0, n_pad)) + 128
    rows, kp = w.shape
    return w.to(torch.uint8).view(rows // PANEL, PANEL, kp // 4, 4).transpose(1, 2).contiguous()


def unpack_row_linear_int8(packed: torch.Tensor, n: int | None = None, k: int | None = None) -> torch.Tensor:
    """uint8 [N / 16, K / 4, 16, 4] (:func:`pack_row_linear_int8`) back to int8 [N, K]; ``n``, ``k``: the weight's
    true sizes (a padded pack's)."""
    if packed.dim() != 4 or packed.dtype != torch.uint8 or packed.shape[2] != PANEL or packed.shape[3] != 4:
        raise ValueError(
            f"unpack_row_linear_int8: a packed int8 weight is uint8 [N / {PANEL}, K / 4, {PANEL}, 4], got "
            f"{packed.dtype} {tuple(packed.shape)}"
        )
    p, k4 = packed.shape[:2]
    w = (packed.transpose(1, 2).reshape(p * PANEL, k4 * 4).to(torch.int16) - 128).to(torch.int8)
    return w[: p * PANEL if n is None else n, : k4 * 4 if k is None else k].contiguous()


@torch.no_grad()
def pack_screened_head(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The screen of an fp32 output head [N, K] for :func:`sbd_ext.ops.screened_head`: ``(screen, screen_norm)``,
    the head rounded to bf16 (to nearest even) in row_linear's panel layout ([ceil(N / 16), K, 16], zero rows to
    whole panels) and each row's L2 norm [N] fp32, computed in float64 and rounded up. New tensors."""
    n, _ = _checked("pack_screened_head", weight, (torch.float32,), "the screen is made from the fp32 head", True)
    norm64 = weight.detach().double().norm(dim=1)
    norm = norm64.float()
    norm = torch.where(norm.double() < norm64, torch.nextafter(norm, torch.tensor(float("inf"))), norm)
    return pack_row_linear_weight(weight.detach().to(torch.bfloat16), pad=True), norm.contiguous()
