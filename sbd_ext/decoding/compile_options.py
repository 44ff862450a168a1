"""How sbd_ext compiles a function (the static step, the device cycle): ``torch.compile`` with per-device options
(CUDA graphs on CUDA; on the CPU a C++ wrapper built apart from its kernels), the op schemas in inductor's cache key,
and the guard settings of each call. Used by :mod:`sbd_ext.decoding.compiled` and
:mod:`sbd_ext.decoding.device_loop`."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import threading

import torch

from . import c_shims

__all__ = ["CPU_COMPILE_OPTIONS", "cache_tag", "compiled_once", "gc_paused"]

# The CPU step's inductor options. The C++ wrapper is one function per graph with every layer unrolled; built with its
# kernels in one g++ -O3 run SmolLM2's verify graph took 23.5 min (Zen 3), so cpp_wrapper_build_separate compiles
# the kernels at -O3 and the wrapper (glue) at -O1: 252.8 s, the same forward. The Python wrapper compiles in 183 s
# but runs ~10 % slower. size_asserts off: 788 size / stride checks per SmolLM2 verify forward (~1-2 ms of ~50) that
# dynamo's guards and the ops' tested fake kernels already cover. (docs/notes/benchmarks-log.md)
CPU_COMPILE_OPTIONS = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True, "size_asserts": False}

_COMPILED: dict[tuple, object] = {}  # (function, device type) -> its compiled form
_COMPILE_LOCK = threading.Lock()


def compiled_once(fn, device: torch.device):
    """``torch.compile(fn, fullgraph=True, dynamic=False)`` with this module's per-device options (CUDA graphs on
    CUDA, the C++ wrapper on the CPU) and the op schemas in inductor's cache key; built once per (fn, device
    type)."""
    kw = {"mode": "reduce-overhead"} if device.type == "cuda" else {"options": c_shims.cpu_options(CPU_COMPILE_OPTIONS)}
    with _COMPILE_LOCK:
        key = (fn, device.type)
        if key not in _COMPILED:
            _COMPILED[key] = _with_cache_tag(torch.compile(fn, fullgraph=True, dynamic=False, **kw))
        return _COMPILED[key]


def cache_tag() -> str:
    """A tag of sbd_ext's op schemas for inductor's on-disk cache key. The key does not cover a custom op's schema:
    code compiled against an earlier sbd_ext whose op took other arguments (row_linear gained ``scale``) would be
    loaded from the cache and call the op with the old argument list, a crash. With the schemas in the key, an
    upgrade compiles afresh."""
    ops = (
        "block_attention",
        "entropy_sample",
        "gated_lora_linear",
        "mask_replace",
        "row_linear",
        "screened_head",
        "topk_logsumexp",
    )
    schemas = "|".join(str(getattr(torch.ops.sbd_ext, op).default._schema) for op in ops)
    schemas += "|c_shims" if c_shims.shims_available() else ""  # the C functions' signatures follow the schemas
    return "sbd_ext-" + hashlib.sha256(schemas.encode()).hexdigest()[:16]


# How the step's guards are built (patched around each of its calls, ~20 us; the process's settings elsewhere):
# - skip_nnmodule_hook_guards=False: dynamo's default skips guards on module hooks, so a forward hook a user adds
#   after the first compiled generation was silently ignored (stale graph, other tokens than eager); now it recompiles.
# - recursive dict tags: dynamo checks ~10k guards on every call of the step (a SmolLM2 verify forward with its
#   drafter: 10.8k, mostly the modules' structure: types, hook dicts, attributes not shadowed), ~2.2 ms of a ~35 ms
#   forward on one Zen 4 thread. With recursive dict tags (dynamo's own check, off by default) a module whose
#   __dict__ is unchanged since the last call (its version tag) skips its subtree's guards; an assignment to any
#   module attribute at any depth changes a tag and the full guards run (2.25 -> 1.35 ms per forward in
#   compile_wrapper, 2026-11-26). The pointer budget covers a large model.
_GUARD_CONFIG = dict(
    skip_nnmodule_hook_guards=False,
    use_recursive_dict_tags_for_guards=True,
    max_saved_pointers_for_recursive_dict_tags_check=1 << 14,
)


# Python's cyclic garbage collector during a call that compiles. dynamo and inductor leave ~1M tracked objects per
# graph (SmolLM2's verify step with its drafter: 375k -> 1.5M in the process), the collector's oldest generation runs
# again each time the objects it holds grew by a quarter, and dynamo collects the younger two after each frame it
# compiles (run_gc_after_compile): 8 full collections during that first call (4.5 s) and 8 of the younger ones
# (2.6 s), and a full one (0.7-1.7 s) still due in the decoding after it. Paused for the call (dynamo's own
# collections off), then one full collection where the call left more than COLLECT_AFTER new tracked objects (a
# compile; a compiled call allocates hundreds).
COLLECT_AFTER = 100_000


@contextlib.contextmanager
def gc_paused():
    """The collector paused inside the block (where it was enabled), one full collection after it where the block
    left more than :data:`COLLECT_AFTER` new tracked objects. Process-wide, like ``gc.disable`` itself: compiled
    generations run one at a time (``COMPILED_RUN_LOCK``), and a thread that finds the collector paused leaves it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        if gc.get_count()[0] > COLLECT_AFTER:
            gc.collect()


def _with_cache_tag(fn):
    tag = cache_tag()

    def run(*args):
        outer = torch.compiler.config.cache_key_tag  # a user's own tag is kept
        with (
            torch.compiler.config.patch(cache_key_tag=f"{outer}|{tag}" if outer else tag),
            torch._dynamo.config.patch(**_GUARD_CONFIG, run_gc_after_compile=False),
            gc_paused(),
        ):
            return fn(*args)

    return run
