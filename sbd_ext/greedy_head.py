"""Greedy decoding's output head: when a packed fp32 head may return logits for argmax only.

``sbd_ext.quantize(model, "packed")`` gives the output head a screen (its rows in bf16 and their norms), and
:func:`sbd_ext.ops.screened_head` then reads about half the head's bytes and still returns the fp32 head's choice:
each row's largest entry is the exact head's, the other entries bounded approximations. That is all greedy
next-token decoding and verify read of a forward's logits for their output (verify's drafts read the block rows'
distributions too, and any draft is checked), so :func:`sbd_ext.generate` enters :func:`greedy_head` for them; sampled
decoding and plain SBD (whose block tokens are its output) keep the exact head. The switch is per thread, so
generations on other threads keep theirs, and a compiled step guards on it (a graph of each kind).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .linear import as_rows
from .ops import screened_head
from .packing import constant_weight, pack_screened_head
from .weight_arena import kernel_tensor

__all__ = [
    "SCREEN",
    "drop_screen",
    "greedy_exclude",
    "greedy_exclude_now",
    "greedy_head",
    "screened_rows",
    "set_screen",
]

SCREEN = ("screen_packed", "screen_norm")  # a packed fp32 head's screen: buffers (and weight-arena tensors)

_GREEDY = threading.local()  # .exclude: None, or the token id this thread's greedy decoding bans (-1: none)


@contextlib.contextmanager
def greedy_head(exclude: int | None = -1):
    """Within the block, on this thread, a packed fp32 output head with a screen returns logits for argmax only,
    exact at each row's largest entry over all columns and over all but ``exclude`` (a token id the caller bans, -1
    none); ``None``: exact logits (as outside the block)."""
    prev = getattr(_GREEDY, "exclude", None)
    _GREEDY.exclude = exclude
    try:
        yield
    finally:
        _GREEDY.exclude = prev


def greedy_exclude_now() -> int | None:
    """This thread's setting (:func:`greedy_head`): None (exact logits) or the banned id (-1: none)."""
    return getattr(_GREEDY, "exclude", None)


def greedy_exclude(job) -> int | None:
    """What a decoding job may screen with: the id it bans (its mask token; -1 none) where its output is the argmax of
    every forward's logits (temperature 0, next-token or verify decoding), else None."""
    if job.temperature != 0 or (job.sbd and not job.verify):
        return None
    return -1 if job.mask_id is None else int(job.mask_id)


def set_screen(m, weight: torch.Tensor) -> None:
    """A packed fp32 head ``m``'s screen (:func:`~sbd_ext.packing.pack_screened_head`; half the head's bytes more in
    memory) made from its fp32 weight [N, K]: buffers left out of ``state_dict`` (derived, like a tied head's copy)."""
    screen, norm = pack_screened_head(weight.float())
    m.register_buffer(SCREEN[0], constant_weight(screen.to(weight.device)), persistent=False)
    m.register_buffer(SCREEN[1], constant_weight(norm.to(weight.device)), persistent=False)


def drop_screen(m) -> None:
    for name in SCREEN:
        m._buffers.pop(name, None)


def screened_rows(m, x: torch.Tensor, wp: torch.Tensor, rows: int) -> torch.Tensor | None:
    """A packed head's ``rows`` rows of ``x`` through :func:`~sbd_ext.ops.screened_head` ([rows, N'], for argmax)
    where this thread decodes greedily (:func:`greedy_head`) and ``m`` has a screen on the CPU; else None."""
    exclude = greedy_exclude_now()
    if not rows or exclude is None or SCREEN[0] not in m._buffers or x.device.type != "cpu":
        return None
    ex = exclude if 0 <= exclude < m.out_features else -1
    return screened_head(as_rows(x, rows), wp, kernel_tensor(m, SCREEN[0]), kernel_tensor(m, SCREEN[1]), ex)
