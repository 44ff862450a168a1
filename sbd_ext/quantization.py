"""Weight formats for the CPU decoding forward: ``sbd_ext.quantize(model, "packed")`` (fp32 in row_linear's panel
layout), ``"bf16"`` (the same panels in bf16), ``"int8"`` (weight-only) or ``"w8a8"``.

Why: on a CPU a decoding forward of a few rows is a pass over the weights. With int8 weights and one fp32 scale per
output row (``scale = max|w_row| / 127``, ``q = round(w / scale)``) it reads a quarter of fp32's bytes, and
:func:`sbd_ext.ops.row_linear` widens them in registers: activations, sums, norms, attention and logits stay fp32.

:func:`quantize` turns every plain ``nn.Linear`` of an fp32 model (and :class:`~sbd_ext.linear.RowLinear`; the frozen
base projection inside a gated drafter's adapter too) into :class:`Int8Linear` (:class:`PackedLinear`) **in place**, by
class, as :func:`sbd_ext.linear.use_row_linear` does: the module objects, their hooks and every reference to them stay,
so a drafter attached before or after keeps working and NTP, SBD and verify decoding all run on int8 weights. A weight
tied to the input embedding (SmolLM2's output head) keeps the shared fp32 tensor for the embedding lookup and gets an
int8 copy for the head; every other fp32 weight is freed. The embedding itself stays fp32 (a lookup reads one row).

``"w8a8"`` keeps the same int8 weights and also quantises each linear layer's input at run time, per row in blocks of 32
values (one fp32 scale per block, as llama.cpp's Q8_0 does), so the kernel multiplies int8 by int8 (``row_linear(...,
quantize_x=True)``), at a further small accuracy cost (measured: docs/notes/benchmarks-log.md).

``"packed"`` keeps fp32 weights, the same values, in row_linear's panel layout (:class:`PackedLinear`, ``weight_packed``
[N / 16, K, 16]), where the CPU kernel runs a few rows at the FMA rate. Outputs equal the plain layers' to fp32 rounding
(the sum order differs); a weight tied to the embedding (the head) gets a packed copy. The compiled CPU step reads
every scheme's weights from one buffer per dtype (:mod:`sbd_ext.weight_arena`).

``"bf16"`` is ``"packed"`` with each weight rounded to bf16 (to nearest even): half the bytes, widened exactly in
registers, the products and sums those of ``"packed"`` in fp32 (activations stay fp32), so a one-row forward -- a pass
over the weights -- reads half as much, at bf16's rounding of the weights (8 bits of mantissa; int8's per-row scale
keeps about 7 at best). A row's result does not depend on the rows beside it, so verify is exact for it too.
With AMX-BF16 (``build_info()["cpu_bf16_tiles"]``) it packs in tiles and rounds x to bf16 too (docs/ops.md).

It is one-way and for inference: gradients do not flow through an int8 or packed weight, and the tensors are buffers
(``weight_int8``, ``weight_scale``, ``weight_packed``), not a checkpoint format (quantize after loading). The quantized
model's ``save_pretrained`` (and :func:`sbd_ext.integration.save_pretrained`) writes a packed model's weights unpacked
(the same values, a checkpoint ``from_pretrained`` loads) and refuses an int8 / w8a8 model; ``model.train()`` on a
quantized model whose base is still trainable, or its whole ``model.parameters()`` taken with autograd on (an
optimizer's list), warns once per model that the linear weights are frozen buffers. A tied head follows the embedding:
an in-place edit or ``resize_token_embeddings`` (seen by the tensor's version, storage and shape; not an edit through
``.data``) re-packs (re-quantises) the head's copy at its next forward outside torch.compile.
"""

from __future__ import annotations

import functools
import threading
import warnings

import torch
from torch import nn
from torch.nn import functional as F

from . import _C, merged_linears, packing
from .greedy_head import SCREEN, drop_screen, screened_rows, set_screen
from .linear import RowLinear, as_rows, bf16_tiles_in_use, row_count
from .ops import row_linear
from .packing import (
    PANEL,
    constant_weight,
    pack_row_linear_int8,
    pack_row_linear_weight,
    unpack_row_linear_int8,
    unpack_row_linear_weight,
)
from .reference import quantized_x
from .weight_arena import kernel_tensor

__all__ = ["SCHEMES", "Int8Linear", "PackedLinear", "check_trainable_weights", "quantize", "quantize_weight"]
__all__ += ["quantized_scheme", "saveable_state_dict"]

SCHEMES = ("packed", "bf16", "int8", "w8a8")
_PANEL_DTYPES = {"packed": torch.float32, "bf16": torch.bfloat16}
_STATE = "_sbd_quantized"
_LOCK = threading.Lock()


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of a 2-D fp32 weight [N, K]: ``(q int8 [N, K], scale fp32 [N])`` with
    ``weight ≈ q * scale[:, None]``, ``|q| <= 127``. An all-zero row gets scale 1 (and q 0). Non-finite weights are
    refused (a NaN would quantise to a silent 0)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize: a linear weight is 2-D [N, K], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"quantize: the weight must be floating point, got {weight.dtype}")
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize: the weight has NaN or infinite entries")
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8).contiguous()
    return q, scale.contiguous()


def _kernel_rows(x: torch.Tensor, weight: torch.Tensor) -> int:
    """The rows of ``x`` that a converted layer runs through row_linear (fp32, on the weight's device, no autograd
    graph to record), or 0 for the ``F.linear`` fallback."""
    if x.dtype != torch.float32 or x.device != weight.device or (torch.is_grad_enabled() and x.requires_grad):
        return 0
    return row_count(x)


def _kernel_out(out: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    """row_linear's [rows, N'] result as the layer's output [..., n] (N' > n: the padding rows' outputs dropped)."""
    if out.shape[1] != n:
        out = out[:, :n].contiguous()
    return out.view(*x.shape[:-1], n)


def _dequantized(module: Int8Linear, dtype: torch.dtype) -> torch.Tensor:
    return module.int8_weight().to(dtype) * module.weight_scale.to(dtype)[:, None]


def _cpu_vnni() -> bool:
    """Whether row_linear's packed int8 path runs on AVX512-VNNI here (build_info()["cpu_vnni"])."""
    return bool(_C.build_info().get("cpu_vnni", False))


class Int8Linear(nn.Linear):
    """``nn.Linear`` with an int8 weight (``weight_int8`` [N, K]) and one fp32 scale per output row
    (``weight_scale`` [N]); with ``quantize_x`` (scheme ``"w8a8"``) its input is quantised too, and where the CPU
    has AVX512-VNNI the weight is kept in row_linear's packed int8 layout instead (``weight_int8_packed``:
    :func:`~sbd_ext.packing.pack_row_linear_int8`, the same values; :meth:`int8_weight` gives [N, K] either way).
    fp32 rows without an autograd graph run :func:`~sbd_ext.ops.row_linear` on the int8 weight (any device: on CUDA its
    binding widens the weight; any row count: a prefill runs in slices of :data:`~sbd_ext.linear.ROW_LIMIT` rows inside
    the op, so the layer does not branch on its row count, which torch.compile would guard); anything else (autograd,
    other dtypes) runs ``F.linear`` on the weight dequantised for that call (and, with ``quantize_x``, on the input as
    the kernel quantises it). ``.weight`` is the tied fp32 tensor where the layer shares the embedding's, else the
    dequantised weight (computed on each access, for inspection)."""

    quantize_x = False
    _arena_tensors = ("weight_int8_packed", "weight_scale_padded", "weight_int8", "weight_scale")  # weight_arena
    _arena_late = ("weight_scale_padded", "weight_scale")  # a drafter's [W; A] scales stay adjacent (weight_arena)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        tied = self._parameters.get("weight")
        return tied if tied is not None else _dequantized(self, self.weight_scale.dtype)

    def int8_weight(self) -> torch.Tensor:
        """The int8 weight [N, K] (unpacked, a new tensor, where the layer keeps it packed)."""
        q = self._buffers.get("weight_int8")
        if q is not None:
            return q
        return unpack_row_linear_int8(self.weight_int8_packed, self.out_features, self.in_features)

    def kernel_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, scale) as row_linear takes them: packed with its scales padded alike (w8a8 on VNNI), else as is."""
        w = "weight_int8_packed" if "weight_int8_packed" in self._buffers else "weight_int8"
        s = "weight_scale_padded" if "weight_scale_padded" in self._buffers else "weight_scale"
        return kernel_tensor(self, w), kernel_tensor(self, s)  # inside a compiled step: slices of the weight arena

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _follow_tied(self)
        q, scale = self.kernel_weight()
        rows = _kernel_rows(x, q)
        out = merged_linears.member_out(self, x) if rows else None  # q/k/v, gate/up: one call
        if out is None and rows:
            out = _kernel_out(row_linear(as_rows(x, rows), q, scale, self.quantize_x), x, self.out_features)
        elif out is None:
            # "w8a8": the input as the kernel quantises it, so this path computes what the kernel computes
            xin = quantized_x(x.float()).to(x.dtype) if self.quantize_x else x
            out = F.linear(xin, _dequantized(self, x.dtype))
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        x = ", x=int8 per 32" if self.quantize_x else ""
        return f"{super().extra_repr()}, weight=int8 per-row{x}"


class PackedLinear(nn.Linear):
    """``nn.Linear`` with its weight in row_linear's panel layout (``weight_packed`` [N / 16, K, 16]; ``"packed"``:
    fp32, the same values; ``"bf16"``: rounded to bf16, widened in the kernel): its CPU kernel runs a verify forward's
    9-16 rows at the FMA rate. fp32 rows without an autograd graph run :func:`~sbd_ext.ops.row_linear` on it (any row
    count; on CUDA it is unpacked; a head with a screen in greedy decoding: :mod:`sbd_ext.greedy_head`), anything else
    ``F.linear`` on the weight unpacked for that call. ``.weight``: the tied fp32 tensor where the layer shares the
    embedding's, else the unpacked weight."""

    _arena_tensors = ("weight_packed",) + SCREEN  # weight_arena

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        tied, wp = self._parameters.get("weight"), self.weight_packed
        return tied if tied is not None else unpack_row_linear_weight(wp, self.out_features, self.in_features).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _follow_tied(self)
        wp = kernel_tensor(self, "weight_packed")
        rows = _kernel_rows(x, wp)
        screened = screened_rows(self, x, wp, rows)  # greedy decoding: a head's choice over its screen
        out = merged_linears.member_out(self, x) if rows else None  # q/k/v, gate/up: one call
        if out is None and (screened is not None or rows):
            raw = row_linear(as_rows(x, rows), wp) if screened is None else screened
            out = _kernel_out(raw, x, self.out_features)
        elif out is None:
            out = F.linear(x, unpack_row_linear_weight(wp, self.out_features, self.in_features).to(x.dtype))
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight={packing.layout(self.weight_packed)}"


def _tied_key(w: torch.Tensor) -> tuple:
    """What an edit of a tied weight changes: in place (its version), replaced storage or a resize (its data)."""
    return id(w), w.data_ptr(), tuple(w.shape), w._version


@torch.no_grad()
def _follow_tied(m: nn.Module) -> None:
    """A tied layer's packed / int8 copy made again from the tied fp32 weight when that weight changed since the copy
    was made (an in-place edit of the embedding, ``resize_token_embeddings``): the head follows the embedding. Skipped
    inside torch.compile (the check is Python state; the next eager forward makes it)."""
    tied = m._parameters.get("weight")
    if tied is None or torch.compiler.is_compiling() or m.__dict__.get("_sbd_tied_key") == _tied_key(tied):
        return
    m.out_features = tied.shape[0]
    if isinstance(m, PackedLinear):
        tiles = packing.is_bf16_tiles(m.weight_packed)
        m.weight_packed = constant_weight(pack_row_linear_weight(tied.to(m.weight_packed.dtype), pad=True, tiles=tiles))
        if "screen_packed" in m._buffers:
            set_screen(m, tied)
    else:
        packed = "weight_int8_packed" in m._buffers
        if packed:
            _set_int8_layout(m, False)
        m.weight_int8, m.weight_scale = map(constant_weight, quantize_weight(tied))
        _set_int8_layout(m, packed)
    m._sbd_tied_key = _tied_key(tied)


def _tied_ids(model: nn.Module) -> set[int]:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    w = getattr(emb, "weight", None)
    return {id(w)} if isinstance(w, torch.Tensor) else set()


@torch.no_grad()
def quantize(model: nn.Module, scheme: str = "int8", screen_head: bool = True) -> nn.Module:
    """The weights of every plain ``nn.Linear`` / ``RowLinear`` of an fp32 ``model`` in another format, in place
    (see the module doc); returns ``model``. ``scheme``: "int8" (int8 weights), "w8a8" (and int8 inputs), "packed"
    (fp32 weights in row_linear's panel layout: the same values, an output size that is not a multiple of 16 padded
    with zero rows whose outputs the layer drops; ``screen_head``: the output head also gets a bf16 screen,
    :mod:`sbd_ext.greedy_head`) or "bf16" (those panels in bf16). Calling it again with the same scheme is a no-op;
    between "int8" and "w8a8" it switches the layers' inputs (the int8 weights are the same); "bf16" / "int8" / "w8a8"
    on a packed model convert the packed layers too; any other change from rounded weights (int8 or bf16) is refused.
    ValueError: an unknown scheme or non-fp32 linear weights (``model.float()`` first); TypeError: not a module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize: model must be a torch.nn.Module, got {type(model).__name__}")
    if scheme not in SCHEMES:
        raise ValueError(f"quantize: unknown scheme {scheme!r}; supported: {', '.join(SCHEMES)}")
    with _LOCK:
        current = getattr(model, _STATE, None)
        if current not in (None, "packed", scheme) and {current, scheme} != {"int8", "w8a8"}:
            raise ValueError(
                f"quantize: this model's weights are already rounded to {current!r}; {scheme!r} is made from the "
                "fp32 weights (reload the fp32 model to convert it)"
            )
        kinds = (nn.Linear, RowLinear) if scheme == "packed" else (nn.Linear, RowLinear, PackedLinear)
        targets = [m for m in model.modules() if type(m) in kinds]
        bad = sorted({str(m.weight.dtype) for m in targets if m.weight.dtype != torch.float32})
        if bad:
            what = "the packed layout" if scheme in _PANEL_DTYPES else "int8 quantisation"
            raise ValueError(
                f"quantize: {what} is for fp32 models (the kernel's activations are fp32); "
                f"this model has linear weights in {', '.join(bad)}: call model.float() first"
            )
        tied = _tied_ids(model)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        panel, tiles = _PANEL_DTYPES.get(scheme), scheme == "bf16" and bf16_tiles_in_use()  # AMX-BF16 tiles
        if panel is not None:  # checks before any change
            converted = [(pack_row_linear_weight(m.weight.to(panel), pad=True, tiles=tiles),) for m in targets]
        else:
            converted = [quantize_weight(m.weight) for m in targets]
        for m, new in zip(targets, converted, strict=True):
            w = m.weight
            if "weight" in m._parameters and id(w) not in tied:
                del m.weight  # frees the fp32 weight (the module's parameter; nothing else holds it)
            if isinstance(m, PackedLinear):
                del m.weight_packed
                drop_screen(m)
            if panel is not None:
                m.register_buffer("weight_packed", constant_weight(new[0].to(w.device)))
                m.__class__ = PackedLinear
            else:
                m.register_buffer("weight_int8", constant_weight(new[0].to(w.device)))
                m.register_buffer("weight_scale", constant_weight(new[1].to(w.device)))
                m.__class__ = Int8Linear
            if scheme == "packed" and screen_head and m is head and m.bias is None:
                set_screen(m, w)
            if "weight" in m._parameters:  # tied: the copy follows the tied weight (_follow_tied)
                m._sbd_tied_key = _tied_key(w)
        pack = scheme == "w8a8" and _cpu_vnni()
        for m in model.modules():
            if isinstance(m, Int8Linear):
                m.quantize_x = scheme == "w8a8"
                _set_int8_layout(m, pack and m.weight_scale.device.type == "cpu")
        setattr(model, _STATE, scheme)
        _guard(model)
    return model


def _guard(model: nn.Module) -> None:
    """The quantized model's own ``train``, ``parameters`` and ``save_pretrained`` (instance attributes: the class and
    every other instance stay as they are; ``functools.partial`` so that copies and pickles keep working)."""
    model.train = functools.partial(_train, model)
    model.parameters = functools.partial(_all_parameters, model)
    if callable(getattr(type(model), "save_pretrained", None)):
        model.save_pretrained = functools.partial(_save_pretrained, model)


def _base_trainable(model: nn.Module) -> bool:
    """Whether the base is being trained: its input embedding requires grad (as :func:`check_trainable_weights`)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    w = getattr(emb, "weight", None)
    return isinstance(w, torch.Tensor) and w.requires_grad


def _warn_frozen(model: nn.Module, what: str) -> None:
    if model.__dict__.get("_sbd_warned_frozen") or not _base_trainable(model):
        return
    model._sbd_warned_frozen = True
    scheme = quantized_scheme(model)
    warnings.warn(
        f"{what} on a quantized model: its linear weights are frozen buffers under scheme {scheme!r} "
        "(sbd_ext.quantize), not parameters, so an optimizer over model.parameters() would train only the embeddings "
        "and norms; train the fp32 model and quantize afterwards, or train adapters over the frozen base "
        "(sbd_ext.adapters.prepare)",
        UserWarning,
        stacklevel=3,
    )


def _train(model: nn.Module, mode: bool = True) -> nn.Module:
    out = type(model).train(model, mode)
    if mode:
        _warn_frozen(model, "model.train()")
    return out


def _all_parameters(model: nn.Module, recurse: bool = True):
    yield from type(model).parameters(model, recurse)
    # the whole list taken (an optimizer's), not next(model.parameters()) for a device or dtype
    if torch.is_grad_enabled():
        _warn_frozen(model, "model.parameters()")


def saveable_state_dict(model: nn.Module, state_dict: dict | None = None, who: str = "save_pretrained"):
    """``state_dict`` (None: the model's) as a checkpoint of ``model`` to save: unchanged (None stays None) without
    converted layers; a packed layer's ``weight_packed`` as its ``weight`` in ``nn.Linear``'s layout (the same fp32
    values, what from_pretrained loads). Raises ValueError for rounded layers (``"int8"`` / ``"w8a8"`` / ``"bf16"``):
    their values are not the original weights, and from_pretrained would give those layers random ones."""
    rounded = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, Int8Linear) or (isinstance(m, PackedLinear) and m.weight_packed.dtype != torch.float32)
    ]
    if rounded:
        first = rounded[0][1]
        kind = "bf16" if isinstance(first, PackedLinear) else "w8a8" if first.quantize_x else "int8"
        raise ValueError(
            f"{who}: this model is quantized with scheme {quantized_scheme(model) or kind!r} (sbd_ext.quantize: "
            f"rounded weights in buffers, e.g. {rounded[0][0] or 'the model'}), which is not a checkpoint format "
            "(from_pretrained would load those layers with random weights); quantize is for inference after loading: "
            "save the fp32 model, and call sbd_ext.quantize after from_pretrained"
        )
    packed = [(n, m) for n, m in model.named_modules() if isinstance(m, PackedLinear)]
    if not packed:
        return state_dict
    sd = dict(model.state_dict() if state_dict is None else state_dict)
    for n, m in packed:
        at = f"{n}." if n else ""
        if sd.pop(at + "weight_packed", None) is not None and at + "weight" not in sd:
            sd[at + "weight"] = unpack_row_linear_weight(m.weight_packed, m.out_features, m.in_features).contiguous()
    return sd


def _save_pretrained(model: nn.Module, save_directory, *args, **kwargs):
    if len(args) >= 2:  # save_pretrained(dir, is_main_process, state_dict, ...)
        args = (args[0], saveable_state_dict(model, args[1]), *args[2:])
    else:
        kwargs["state_dict"] = saveable_state_dict(model, kwargs.get("state_dict"))
    return type(model).save_pretrained(model, save_directory, *args, **kwargs)


def _set_int8_layout(m: Int8Linear, packed: bool) -> None:
    """Keep ``m``'s int8 weight in the packed layout (``weight_int8_packed``, with ``weight_scale_padded`` when the
    rows were padded to whole panels) or in [N, K] (``weight_int8``), converting if needed."""
    if packed == ("weight_int8_packed" in m._buffers):
        return
    if packed:
        m.register_buffer("weight_int8_packed", constant_weight(pack_row_linear_int8(m.weight_int8, pad=True)))
        pad = -m.out_features % PANEL
        if pad:
            padded = constant_weight(F.pad(m.weight_scale, (0, pad), value=1.0))
            m.register_buffer("weight_scale_padded", padded, persistent=False)
        del m.weight_int8
    else:
        m.register_buffer("weight_int8", constant_weight(m.int8_weight()))
        del m.weight_int8_packed
        m._buffers.pop("weight_scale_padded", None)


def quantized_scheme(model: nn.Module) -> str | None:
    """The scheme :func:`quantize` applied to ``model`` ("packed", "bf16", "int8" or "w8a8"), or None: part of a
    compiled variant's key."""
    return getattr(model, _STATE, None)


def check_trainable_weights(model: nn.Module, who: str) -> None:
    """Refuse to fine-tune a model whose base is being trained (its input embedding requires grad) while linear
    layers hold inference-only weights (:func:`quantize`: packed or int8 buffers, not parameters): the optimizer
    would silently leave those layers as they are. Adapter training over a frozen base (its embedding frozen, e.g.
    :func:`sbd_ext.adapters.prepare`) is allowed."""
    scheme = quantized_scheme(model)
    if scheme is None or not _base_trainable(model):
        return
    frozen = [n for n, m in model.named_modules() if isinstance(m, (Int8Linear, PackedLinear))]
    if frozen:
        raise ValueError(
            f"{who}: this model's linear layers hold {scheme!r} weights for inference (sbd_ext.quantize), which "
            f"training cannot update ({len(frozen)} layers, e.g. {frozen[0]}): train the fp32 model and quantize "
            "afterwards, or train adapters over the frozen base (sbd_ext.adapters.prepare)"
        )
