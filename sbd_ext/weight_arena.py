"""One buffer per dtype for the weights a compiled CPU step reads (the *arena*).

Why: a compiled step takes every tensor it reads as an input of its graph, and each input costs on every call (the
wrapper's handle for it, its allocation, a slot in AOT's argument list). With the quantized layers' kernel weights and
scales and a drafter's fused copies in one buffer per dtype, sliced inside the graph, a SmolLM2 w8a8 NTP graph takes 127
inputs instead of 547, the same tokens, and its call is ~0.6 ms shorter (7.4-7.7 -> 6.9-7.0 ms median; AMD EPYC Zen 4, 1
thread; docs/notes/benchmarks-log.md). The arena also sits on transparent huge pages where Linux gives them
(:func:`flat_buffer`): ~17 % less per packed fp32 graph call, ~12 % less in w8a8.

How: :func:`prepare` copies every tensor a module class lists in ``_arena_tensors`` (``Int8Linear``'s weight and scales,
``PackedLinear``'s panels, a ``GatedLoRALinear``'s fused copies) into the model's arena and puts a view of the arena in
its place: the same values, and what shared a tensor or a storage (a drafter's fused ``[W; A]`` and the base weight that
views it) still does; ``state_dict`` and loading in place see the views, a tensor taken from a layer before keeps its
own memory. Inside the compiled step (:func:`in_use`) a layer reads ``kernel_tensor(self, name)``, a slice of the arena;
anywhere else (eager, a user's own ``torch.compile``) its own tensor. :func:`prepare` runs before each compiled
generation and checks that every listed tensor still lies where the arena put it: a ``model.to(...)``, an assigned
buffer or a rebuilt copy moves it out, and the arena is built again (the old one is freed once nothing points into it);
on another device than the CPU the links are dropped. A ``state_dict`` of a part of the model saved with ``torch.save``
writes the whole arena (a view saves its storage).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import threading

import torch
from torch import nn

from . import merged_linears
from .packing import constant_weight

__all__ = ["Arena", "flat_buffer", "in_use", "kernel_tensor", "prepare"]

LINK = "_sbd_arena"  # a module's link: (Arena, {name: (dtype name, offset, shape)})
MODEL_ARENA = "_sbd_weight_arena"  # the model's Arena
ALIGN = 64  # bytes: each storage's slot starts on a cache line
HUGE_PAGE = 1 << 21  # bytes: a transparent huge page (x86-64)
_LOCK = threading.Lock()


class Arena:
    """The flat buffers (``flats``: dtype name -> 1-D constant weight), whether a compiled step of this module
    reads them now (``on``, set by :func:`in_use`: part of the graphs' guards) and whether sibling projections run as
    one call there (``merged``, :mod:`sbd_ext.merged_linears`; ``SBD_EXT_MERGED_LINEARS=0``: each its own; a guard
    too: switching it compiles the other graph once)."""

    def __init__(self, flats: dict[str, torch.Tensor]):
        self.flats, self.on = flats, False
        self.merged = os.environ.get("SBD_EXT_MERGED_LINEARS", "1") != "0"


def kernel_tensor(m: nn.Module, name: str) -> torch.Tensor:
    """``m``'s tensor ``name`` as the kernel reads it: inside a compiled step with the arena in use, a slice of the
    arena (one graph input for all layers); else the module's own tensor (the same values)."""
    if torch.compiler.is_compiling():
        link = m.__dict__.get(LINK)
        if link is not None and link[0].on:
            spec = link[1].get(name)
            if spec is not None:
                key, off, shape = spec
                return link[0].flats[key][off : off + math.prod(shape)].view(shape)
    return getattr(m, name)


def _listed(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every tensor the model's modules list for the arena (non-empty, present)."""
    out = []
    for m in model.modules():
        for name in getattr(type(m), "_arena_tensors", ()):
            d = m.__dict__
            t = d["_buffers"].get(name)
            if t is None:
                t = d["_parameters"].get(name, d.get(name))
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                out.append((m, name, t))
    return out


def _in_place(model: nn.Module, arena: Arena | None, listed: list) -> bool:
    """Whether every listed tensor is where ``arena`` put it, and every module's link names a listed tensor."""
    if arena is None:
        return False
    linked, ptrs = 0, {k: (f.data_ptr(), f.element_size(), f.dtype) for k, f in arena.flats.items()}
    for m, name, t in listed:
        link = m.__dict__.get(LINK)
        spec = None if link is None or link[0] is not arena else link[1].get(name)
        if spec is None:
            if t.is_contiguous():
                return False  # a tensor the arena has not seen
            continue
        key, off, shape = spec
        if key not in ptrs:
            return False
        base, item, dtype = ptrs[key]
        if t.data_ptr() != base + off * item or t.dtype != dtype or t.shape != shape or not t.is_contiguous():
            return False
        linked += 1
    return linked == sum(len(m.__dict__[LINK][1]) for m in model.modules() if LINK in m.__dict__)


def _unlink(model: nn.Module) -> None:
    for m in model.modules():
        m.__dict__.pop(LINK, None)
    model.__dict__.pop(MODEL_ARENA, None)
    merged_linears.unlink(model)


def _put(m: nn.Module, name: str, t: torch.Tensor) -> None:
    """Set ``m``'s listed tensor ``name`` (a buffer, a parameter or a plain attribute) to ``t``."""
    for d in (m._buffers, m._parameters):
        if name in d:
            d[name] = t
            return
    m.__dict__[name] = t


@torch.no_grad()
def _build(model: nn.Module, listed: list) -> Arena:
    """Copy every listed tensor's storage (``listed`` is emptied) into new flat buffers (one per dtype), give each
    module views of them in place of its tensors (one new object per old one: what shared an object or a storage still
    does) and link the modules. New objects, not the old ones moved (``set_``): a kernel in another thread that still
    reads an old tensor (an eager generation) keeps its storage alive until it returns."""
    groups: dict[tuple, list] = {}  # (dtype, storage address) -> the listed tensors on that storage
    # module order, but the tensors a class names in _arena_late (a drafter's B copies, the int8 bases' scales) after
    # all others, by name: the kernel tensors of sibling projections lie one after another (sbd_ext.merged_linears)
    for entry in sorted(listed, key=lambda e: (1, e[1]) if e[1] in getattr(type(e[0]), "_arena_late", ()) else (0,)):
        t = entry[2]
        groups.setdefault((t.dtype, t.untyped_storage().data_ptr()), []).append(entry)
    sizes: dict[torch.dtype, int] = {}
    slots = {}
    for (dtype, ptr), entries in groups.items():
        n = entries[0][2].untyped_storage().nbytes() // dtype.itemsize
        at = -(-sizes.get(dtype, 0) * dtype.itemsize // ALIGN) * ALIGN // dtype.itemsize  # aligned start
        slots[(dtype, ptr)] = at
        sizes[dtype] = at + n
    huge = os.environ.get("SBD_EXT_WEIGHT_ARENA", "1") != "nohuge"
    flats = {str(d)[6:]: constant_weight(flat_buffer(n, d, huge)) for d, n in sizes.items()}
    arena = Arena(flats)
    links: dict[int, tuple[nn.Module, dict]] = {}
    listed.clear()  # each old storage is freed as soon as its tensors are replaced: peak memory ~ 1x, not 2x
    for dtype, ptr in list(groups):
        entries = groups.pop((dtype, ptr))
        flat, at = flats[str(dtype)[6:]], slots[(dtype, ptr)]
        old = entries[0][2].untyped_storage()
        flat.data[at : at + old.nbytes() // flat.element_size()].copy_(torch.empty(0, dtype=dtype).set_(old))
        new: dict[int, torch.Tensor] = {}  # id(old tensor) -> its view of the arena
        for m, name, t in entries:
            if id(t) not in new:
                view = flat.detach().as_strided(t.shape, t.stride(), flat.storage_offset() + at + t.storage_offset())
                new[id(t)] = constant_weight(view) if isinstance(t, nn.Parameter) else view
            _put(m, name, new[id(t)])
            if t.is_contiguous():
                spec = (str(dtype)[6:], at + t.storage_offset(), tuple(t.shape))
                links.setdefault(id(m), (m, {}))[1][name] = spec
    _unlink(model)
    for m, specs in links.values():
        m.__dict__[LINK] = (arena, specs)
    model.__dict__[MODEL_ARENA] = arena
    merged_linears.link(model, LINK)  # sibling projections whose tensors lie one after another: one call
    _trim()
    return arena


def flat_buffer(n: int, dtype: torch.dtype, huge: bool) -> torch.Tensor:
    """An uninitialised 1-D buffer of ``n`` elements; with ``huge`` (and over 2 MB) starting on a 2 MB boundary, on
    huge pages where Linux gives them."""
    item = dtype.itemsize
    if not huge or n * item < HUGE_PAGE:
        return torch.empty(n, dtype=dtype)
    # A fresh anonymous mapping: its pages are untouched, so the kernel can back them with huge pages on first touch
    # (memory from the allocator may be heap pages already mapped at 4 KB: a long-lived process reuses freed blocks
    # up to glibc's mmap threshold, 32 MB). The tensor keeps the mapping alive; it is unmapped with the last view.
    mapping = mmap.mmap(-1, n * item + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not shmem
    # Transparent huge pages (2 MB), asked for before a page is touched: a forward streams every weight once, and on
    # 4 KB pages that is a TLB miss per 4 KB (~135k per SmolLM2 fp32 forward). Where the kernel gives huge pages only
    # on request (/sys/kernel/mm/transparent_hugepage/enabled: madvise, this project's AMD EPYC VMs) a SmolLM2 NTP
    # graph call took ~17 % less in packed fp32 and ~12 % less in w8a8 (Zen 4, 1 thread).
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    return raw[skip : skip + n * item].view(dtype)


def _trim() -> None:
    """Give the freed old storages back to the OS: glibc keeps freed heap blocks below its mmap threshold (SmolLM2
    w8a8: ~100 MB more resident after a build without it)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass


def prepare(model: nn.Module, device: torch.device | str = "cpu") -> Arena | None:
    """The model's arena for a compiled step on ``device``, built or rebuilt where a listed tensor is not in it (the
    first call, or after a ``.to()``, an assigned buffer, a rebuilt copy); None, with every link dropped, on a device
    other than the CPU, where any listed tensor is not on the CPU, or with ``SBD_EXT_WEIGHT_ARENA=0``."""
    with _LOCK:
        listed = _listed(model)
        off = os.environ.get("SBD_EXT_WEIGHT_ARENA", "1") == "0"  # the switch: every layer reads its own tensors
        # ("nohuge": an arena on 4 KB pages, for measuring what the huge pages buy)
        if off or torch.device(device).type != "cpu" or not listed or any(t.device.type != "cpu" for _, _, t in listed):
            _unlink(model)
            return None
        arena = model.__dict__.get(MODEL_ARENA)
        return arena if _in_place(model, arena, listed) else _build(model, listed)


@contextlib.contextmanager
def in_use(model: nn.Module, device: torch.device | str = "cpu", checked: bool = True):
    """The model's compiled CPU step reads its weights from the arena inside this block: :func:`prepare` first
    (~2.5 ms for SmolLM2 with its drafter: every listed tensor's place), or, with ``checked=False``, the arena the
    last :func:`prepare` left, unchecked (a caller that owns the model and calls per forward)."""
    arena = model.__dict__.get(MODEL_ARENA) if not checked and torch.device(device).type == "cpu" else None
    arena = arena or prepare(model, device)
    if arena is not None:
        arena.on = True
    try:
        yield arena
    finally:
        if arena is not None:
            arena.on = False
