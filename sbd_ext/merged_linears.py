"""Sibling projections in one kernel call inside the compiled CPU step: q/k/v, and gate/up (core).

Why: a decoding forward is a stream over the weights, and each linear call's start costs more than its bytes explain
(the hardware prefetcher restarts, the op call itself): SmolLM2's k_proj and v_proj (110 KB each in int8) took
~15 us cold where their bytes stream in ~4 (docs/notes/benchmarks-log.md, 2026-12-02). q_proj, k_proj and v_proj read
the same input, as do gate_proj and up_proj; in the weight arena (:mod:`sbd_ext.weight_arena`) their kernel weights lie
one after another in module order, so one :func:`~sbd_ext.ops.row_linear` call over the group's weights (their panels
concatenated along the outputs: the same values, no copy) gives every member's output columns. Each output column is
summed in the order of the member's own call (row_linear's sums do not depend on the other columns; int8 inputs are
quantised per row of x alone), so the outputs are the members' own, bit for bit: tokens do not change.

How: :func:`link` (run by the arena when it links a model) finds each group whose members' kernel tensors (weight, and
the int8 scales) are adjacent slices of one arena buffer and marks every member with a :class:`Member`. Inside the
compiled step with the arena on, the group's first member's forward (q_proj, gate_proj) runs the one call and keeps
``(x, out)`` on the group; a later member called with the same ``x`` (the same tensor object: what the model's
attention and MLP pass each projection) takes its columns, and the last one drops them. Anything else (another input,
another order, eager code, a user's own ``torch.compile`` without the arena) runs each member's own call.

Members are :class:`~sbd_ext.quantization.PackedLinear` (fp32 / bf16 panels or tiles, not a screened head) and
:class:`~sbd_ext.quantization.Int8Linear` of one kind, or a drafter's :class:`~sbd_ext.drafter.lora.GatedLoRALinear`
adapters over such bases with their fused ``[W; A]`` copies adjacent: an NTP forward (no gate) then runs one call over
``[W_q; A_q; W_k; A_k; W_v; A_v]`` and keeps the W columns (A's rows, 16 per member, ride along: ~2 % more bytes
for SmolLM2 against one call per projection).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .linear import as_rows, row_count
from .ops import gated_lora_linear, row_linear

__all__ = ["GROUPS", "MERGED", "Group", "Member", "call_weights", "link", "member_out", "unlink"]

# The sibling projections of one block, by attribute name, in the order the model's forward calls them.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
MERGED = "_sbd_merged"  # a member's Member, in its __dict__ (not a submodule, not state)


class Group:
    """One group's call of this forward: the input it ran on and its output [rows, F] (None between calls)."""

    def __init__(self):
        self.x: torch.Tensor | None = None
        self.out: torch.Tensor | None = None


@dataclass
class Member:
    """A member's place in its group's call: the group, its index, the arena (its ``on``), the merged weight's and
    scales' (flat key, offset, shape) in the arena, whether x is quantised, and its output columns [col, col + n)."""

    group: Group
    index: int
    last: bool
    arena: object
    weight: tuple[str, int, tuple[int, ...]]
    scale: tuple[str, int, tuple[int, ...]] | None
    quantize_x: bool
    col: int
    n: int
    # A drafter's adapters (GatedLoRALinear) with their packed B' one after another as well: the gated call's
    # [W_i; A_i] segments (N_i), B' (flat key, offset, shape) and this member's first column of its output
    segments: tuple[int, ...] = ()
    lora_b: tuple[str, int, tuple[int, ...]] | None = None
    gated_col: int = 0


def _kernel_names(m: nn.Module) -> tuple[nn.Module, str, str | None, bool] | None:
    """(the module holding the tensors a member's one call reads, its weight's name, its scales' or None, quantize_x)
    of a module that can join a group, or None. By class name: the quantized and drafter classes import this module."""
    kind = type(m).__name__
    buffers = m.__dict__.get("_buffers", {})
    if kind == "PackedLinear" and "screen_packed" not in buffers:
        return m, "weight_packed", None, False
    if kind == "Int8Linear":
        w = "weight_int8_packed" if "weight_int8_packed" in buffers else "weight_int8"
        s = "weight_scale_padded" if "weight_scale_padded" in buffers else "weight_scale"
        return m, w, s, bool(m.quantize_x)
    if kind == "GatedLoRALinear":  # with no gate (NTP) it is its base; over [W; A] where the base has that copy
        base = _kernel_names(m.base)
        fused = m.__dict__.get("_fused")
        if base is None or fused is None or not fused.numel():
            return base
        scaled = m.__dict__.get("_fused_scale")
        return m, "_fused", "_fused_scale" if scaled is not None and scaled.numel() else None, base[3]
    return None


def _adjacent(specs: list) -> tuple[str, int, tuple[int, ...]] | None:
    """The (key, offset, shape) of the members' arena slices as one tensor concatenated along dim 0, or None where
    they are not one after another in one buffer with the same trailing shape."""
    key, off, shape = specs[0]
    rows = shape[0]
    end = off + math.prod(shape)
    for k, o, s in specs[1:]:
        if k != key or o != end or tuple(s[1:]) != tuple(shape[1:]):
            return None
        rows, end = rows + s[0], o + math.prod(s)
    return key, off, (rows, *shape[1:])


def _columns(spec: tuple) -> int:
    """The output columns a member's slice of the call spans: its weight's rows (panels x 16, or rows [N, K])."""
    shape = spec[2]
    return shape[0] * 16 if len(shape) >= 3 else shape[0]


def _group(members: list[nn.Module], link_key: str) -> list[Member] | None:
    names = [_kernel_names(m) for m in members]
    if any(n is None for n in names) or len({(type(n[0]), n[3], n[2] is None) for n in names}) != 1:
        return None
    links = [n[0].__dict__.get(link_key) for n in names]
    if any(ln is None or ln[0] is not links[0][0] for ln in links):
        return None
    w_specs = [ln[1].get(n[1]) for ln, n in zip(links, names, strict=True)]
    s_specs = [ln[1].get(n[2]) for ln, n in zip(links, names, strict=True)] if names[0][2] else None
    if any(s is None for s in w_specs + (s_specs or [])):
        return None
    weight, scale = _adjacent(w_specs), _adjacent(s_specs) if s_specs else None
    if weight is None or (s_specs and scale is None):
        return None
    b_specs = [ln[1].get("_packed_b") for ln in links] if names[0][1] == "_fused" else [None]
    lora_b = None if None in b_specs else _adjacent(b_specs)
    segments = tuple(b[2][0] * 16 for b in b_specs) if lora_b is not None else ()
    group, col, gated_col, out = Group(), 0, 0, []
    for i, (m, spec) in enumerate(zip(members, w_specs, strict=True)):
        last = i == len(members) - 1
        out.append(
            Member(
                group,
                i,
                last,
                links[0][0],
                weight,
                scale,
                names[0][3],
                col,
                m.out_features,
                segments,
                lora_b,
                gated_col,
            )
        )
        col += _columns(spec)
        gated_col += segments[i] if segments else 0
    return out


def link(model: nn.Module, link_key: str) -> int:
    """Mark every group of sibling projections whose kernel tensors are adjacent in the arena the modules' links
    (``link_key`` in their ``__dict__``) point into; returns how many groups. Called by the arena after it links."""
    unlink(model)
    groups = 0
    for parent in model.modules():
        for names in GROUPS:
            members = [parent._modules.get(n) for n in names]
            if any(m is None for m in members):
                continue
            marked = _group(members, link_key)
            if marked is None:
                continue
            for m, spec in zip(members, marked, strict=True):
                m.__dict__[MERGED] = spec
            groups += 1
    return groups


def unlink(model: nn.Module) -> None:
    for m in model.modules():
        m.__dict__.pop(MERGED, None)


def _slice(spec: Member, at: tuple[str, int, tuple[int, ...]] | None) -> torch.Tensor | None:
    if at is None:
        return None
    key, off, shape = at
    return spec.arena.flats[key][off : off + math.prod(shape)].view(shape)


def call_weights(spec: Member) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the group's weight, its scales or None): the arena's slices its one ``row_linear`` call reads."""
    return _slice(spec, spec.weight), _slice(spec, spec.scale)


def _call(spec: Member, x: torch.Tensor, rows: int, gate: torch.Tensor | None) -> torch.Tensor:
    (w, s), x2 = call_weights(spec), as_rows(x, rows)
    if gate is None:
        return row_linear(x2, w, s, spec.quantize_x)
    g = gate.to(x.dtype).reshape(-1)
    return gated_lora_linear(x2, w, _slice(spec, spec.lora_b), g, s, spec.segments)


def member_out(m: nn.Module, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor | None:
    """Inside the compiled CPU step with the arena on: this member's output [..., n] (bias not added) from its
    group's one call on ``x``, else None (the member runs its own call). The first member makes the call; a later
    member takes its columns if it gets the same ``x``. ``gate``: a drafter's adapters with their gate over every
    row (a compiled verify step): one :func:`~sbd_ext.ops.gated_lora_linear` call over the group's ``[W_i; A_i]``."""
    if not torch.compiler.is_compiling():
        return None
    spec = m.__dict__.get(MERGED)
    if spec is None or not (spec.arena.on and spec.arena.merged) or (gate is not None and spec.lora_b is None):
        return None
    if x.dtype != torch.float32 or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return None
    rows = row_count(x)
    if rows == 0:
        return None
    g = spec.group
    if spec.index == 0:
        g.x, g.out = x, _call(spec, x, rows, gate)
    elif g.x is not x:
        return None
    col = spec.col if gate is None else spec.gated_col
    out = g.out[:, col : col + spec.n]
    if spec.last:
        g.x, g.out = None, None
    return out.reshape(*x.shape[:-1], spec.n)
