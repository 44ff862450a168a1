"""The compiled decode step (``generate(..., compile=True)``): :class:`StaticStep`, its ``torch.compile``-d
forward, the cache pool that keeps CUDA-graph buffers at fixed addresses, and the locks that keep compiled
generations apart."""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref

import torch

from .. import families, ops, weight_arena
from ..cache import SBDCache
from ..greedy_head import greedy_exclude
from ..linear import row_linear_state
from ..quantization import quantized_scheme
from . import direct_call
from .compile_options import _COMPILE_LOCK, CPU_COMPILE_OPTIONS, cache_tag, compiled_once  # noqa: F401 (re-exported)
from .settings import Job
from .state import SequenceState
from .step import DecodeStep, EagerStep, ForwardRows, StepLogits, decode

__all__ = ["StaticStep", "COMPILED_RUN_LOCK", "compiled_rows_forward", "decode_compiled", "pooled_cache"]


# Compiled generations run one at a time (CUDA-graph trees and the pooled caches are per process). Eager generations
# stay concurrent. Dynamo's guards on the step (~20k: the model's modules, hooks and parameters, the cache) cost
# 2-4 ms per call on one AVX2 EPYC thread, ~7 % of a w8a8 SmolLM2 forward. A step skips them
# (torch.compiler.set_stance(skip_guard_eval_unsafe=True): dynamo then checks only the guards that told its graphs
# apart) only around its own compiled call, only for a call whose shapes and arguments passed the full guards earlier
# in the same generation (nothing runs between two steps that could change the model), and only while the process
# has no other Python thread: the stance is process-wide, and another thread's torch.compile function entered during
# the call would skip its guards too and could return stale results. Servers (threads) keep every guard.
COMPILED_RUN_LOCK = threading.Lock()


def _skip_guards_now() -> bool:
    """Whether a step may skip dynamo's guards now: no other Python thread can enter a compiled function (tqdm's
    monitor thread, which a progress bar starts -- loading a checkpoint draws one -- only watches its bars)."""
    if threading.active_count() == 1:
        return True
    monitor = getattr(sys.modules.get("tqdm._monitor"), "TMonitor", None)
    me = threading.current_thread()
    return monitor is not None and all(t is me or isinstance(t, monitor) for t in threading.enumerate())


# The variants (model, batch size, block, mode, dtype, device, linear layers) compiled so far in this process.
# dynamo keeps at most config.recompile_limit graphs per function and raises FailOnRecompileLimitHit beyond it: a
# new variant past that bound decodes eagerly (same tokens), with one warning.
_VARIANTS: set = set()
_EAGER: set = set()  # variants that hit the bound anyway: eager from then on
_FALLBACK_WARNED = False


def _variant_key(model, job: Job, device: torch.device, dtype) -> tuple:
    key = (id(model), len(job.prompts), job.block_size, job.mode, job.first_from_ntp, job.branch_rows, job.alternates)
    key += (dtype, device.type, row_linear_state(model), quantized_scheme(model))  # linear layers: own graph
    return key + (greedy_exclude(job),)  # the output head: exact, or screened for argmax (sbd_ext.greedy_head)


def _compiled_variant_ok(key: tuple, variants: set | None = None) -> bool:
    """Whether variant ``key`` of a compiled function runs compiled: within dynamo's bound on that function's
    graphs, counted in ``variants`` (default: the static step's, _VARIANTS; each compiled function has its own)."""
    variants = _VARIANTS if variants is None else variants
    if key in _EAGER:
        return False
    if key in variants:
        return True
    if len(variants) < torch._dynamo.config.recompile_limit - 1:  # headroom: the prefill width on the CPU
        variants.add(key)
        return True
    _fall_back(key)
    return False


def _recompile_limit_hit(e: Exception) -> bool:
    """Whether ``e`` is dynamo's graph bound (fullgraph raises FailOnRecompileLimitHit, chained from an Unsupported
    "recompile limit exceeded"), not another compile failure."""
    return isinstance(e, torch._dynamo.exc.FailOnRecompileLimitHit) or "recompile limit" in str(e).lower()


def _fall_back(key: tuple) -> None:
    """Variant ``key`` decodes eagerly from now on (same tokens, no speed-up), with one warning per process."""
    global _FALLBACK_WARNED
    _EAGER.add(key)
    if not _FALLBACK_WARNED:
        _FALLBACK_WARNED = True
        warnings.warn(
            f"sbd_ext.generate(compile=True): torch._dynamo's limit of compiled graphs is reached ({len(_VARIANTS)} "
            f"variants: model, batch size, k, mode, dtype, linear layers, and thread counts); new variants decode "
            f"eagerly (same tokens, no speed-up). Raise torch._dynamo.config.recompile_limit to compile more",
            stacklevel=5,
        )


def decode_compiled(model, cache: SBDCache, seqs: list[SequenceState], job: Job, device: torch.device) -> None:
    """Decode ``seqs`` with the static step; under COMPILED_RUN_LOCK (taken by generate). Past dynamo's bound on
    compiled variants, eagerly (see _VARIANTS)."""
    variant = _variant_key(model, job, device, next(model.parameters()).dtype)
    if not _compiled_variant_ok(variant):
        decode(seqs, job, EagerStep(model, cache, device))
        return
    drafter = getattr(model, "sbd_drafter", None)
    if drafter is not None:  # the graphs read the adapters' decoding copies of their factors unchecked
        drafter.refresh(model, device)
    step = StaticStep(model, cache, job, device, variant)
    # The prefill (the prompt's rows) is eager in every mode, also where the step takes any row count (SBD on the
    # CPU): the prompt's cached K/V are then the same bits in NTP and verify decoding. inductor's code rounds a few
    # ops differently from ATen's (the RMSNorm's mean, the rotary cos / sin), so a prompt prefilled by the compiled
    # graph in one mode and eagerly in the other gave different caches, and under w8a8 -- where a last-bit change
    # can move an input across an int8 step -- compiled verify parted from compiled NTP on 3 of 4 held-out SmolLM2
    # chat prompts (2026-11-29). Every later forward is compiled in both modes, and a row's values do not depend on
    # the forward's row count.
    prefill = EagerStep(model, cache, device)
    prefill.max_drafts = step.max_drafts  # its drafts are the static step's first forward's rows
    f = decode(seqs, job, prefill, max_forwards=1)
    with cache.static_forwards(), weight_arena.in_use(model, device):
        decode(seqs, job, step, f)
    if device.type == "cuda":
        ops.check_cuda_errors()  # the graph replays skip the binding that raises the kernel's length errors


def _static_forward(
    model,
    cache: SBDCache,
    tokens: torch.Tensor,
    meta: torch.Tensor,
    block_rows: int,
    sbd: bool = True,
    branch_rows: int = 0,
    block_from: int = 0,
    alternates: int = 0,
) -> torch.Tensor:
    """One forward of the static step, traced by torch.compile (fullgraph): nothing here reads a host length.

    tokens: [2, B, T] int64, the input ids and the position ids; meta: [3, B] int32, per sequence the cache length,
    committed rows and valid rows ([5, B] with ``branch_rows``: then the branch's cache length and valid rows, the
    branch being the last ``branch_rows`` rows; ``alternates`` > 0: that many groups of ``1 + branch_rows`` rows after
    it, meta's next ``alternates`` rows their valid rows). Runs the decoder and the output head; with ``block_rows``
    > 0 only each sequence's block rows [n_commit, n_commit + block_rows) reach the head (the head is the costliest
    matmul of a small model with a large vocabulary); ``block_from`` shifts that range (-1: the last committed row
    too, whose logits are the model's next token). ``sbd`` False (NTP forwards): the plan says there are no
    set-block rows, so a gated drafter adds nothing to the graph (not even a zero-gated adapter). Returns logits
    [B, block_rows or T, V].
    """
    B = tokens.shape[1]
    # Every layer's K/V buffers have the cache's row count S, marked dynamic (SBDCache.static_forwards): said here,
    # the graph has one symbol for S instead of one per buffer (60 host ints, each made a tensor and read back on
    # every call of a SmolLM2 step, ~0.6 ms of a ~50 ms CPU forward).
    S = cache.layers[0].keys.shape[2]
    for layer in cache.layers:
        torch._check(layer.keys.shape[2] == S)
        torch._check(layer.values.shape[2] == S)
    plan = cache.device_plan(meta[0], meta[1], meta[2], (branch_rows, meta[3], meta[4]) if branch_rows else None)
    if alternates:
        plan.set_alternates(1 + branch_rows, meta[5 : 5 + alternates])
    if not sbd:
        plan.block_rows = (0, 0)
    hidden = model.get_decoder()(
        input_ids=tokens[0], position_ids=tokens[1], past_key_values=cache, use_cache=True, sbd_plan=plan
    ).last_hidden_state
    plan.check_layers()
    if block_rows:
        rows = (meta[1].long() + block_from).view(B, 1) + torch.arange(block_rows, device=meta.device).view(
            1, block_rows
        )
        # A shortened last block (budget) or a finished sequence reads past its rows: clamped, never used.
        rows = rows.clamp(min=0, max=tokens.shape[2] - 1)
        hidden = torch.gather(hidden, 1, rows.unsqueeze(-1).expand(B, block_rows, hidden.shape[-1]))
    return families.lm_logits(model, hidden)  # the head as the model's forward applies it (final soft-capping)


# Later calls of a generation's compiled step replay the graph call a full call captured (direct_call: dynamo's
# frame entry, guards and input-gathering bytecode skipped, ~2.5 ms of an 11 ms SmolLM2 w8a8 step on one Zen 4
# thread); False: every call through the compiled function (the guard-skipping stance after the first).
DIRECT_CALLS = True
_GRAPH_GLOBALS = _static_forward.__globals__  # where dynamo installs the compiled graphs of _static_forward
# compiled graph -> the call shapes (StaticStep's ``seen``) a fully guarded call has run it at, in this process. An SBD
# step's rows are one dynamic size (5-7 a forward for verify + branch), and each new row count used to cost a full
# call in every generation (~7 ms more than a replay on SmolLM2, ~3 per verify + branch generation): a generation
# whose captured call ran graph g replays it at another row count where a full call has run g at those shapes.
_RAN_AT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ran_at(graph_fn) -> set:
    """The shapes ``graph_fn`` ran at under the full guards (:data:`_RAN_AT`; a graph that cannot be weakly referenced
    records nothing: its calls are never replayed at another row count)."""
    try:
        return _RAN_AT.setdefault(graph_fn, set())
    except TypeError:
        return set()


def _any_rows(seen: tuple) -> tuple:
    """StaticStep's call key ``seen`` without the row count (the tokens' last dim, one dynamic size)."""
    return seen[0][:2] + seen[1:]


def _compiled_forward(device: torch.device):
    """torch.compile of :func:`_static_forward`, one per device type. On CUDA mode "reduce-overhead" captures each
    forward as a CUDA graph and replays it (the cache buffers are marked static, so they are written in place, not
    copied in). dynamic=False: B and T are specialised (one graph per batch size and k);
    the cache's row count is marked dynamic by :meth:`SBDCache.static_forwards`, so prompt lengths and budgets do
    not recompile."""
    # CUDA: "reduce-overhead" (CUDA graphs). CPU: a C++ wrapper instead of the Python one that calls each kernel
    # (~150 calls per forward of the embedded model, ~1 ms; a SmolLM2 verify forward with its drafter makes ~1900
    # calls, 631 of them row_linear), built apart from the kernels (CPU_COMPILE_OPTIONS).
    return compiled_once(_static_forward, device)


def compiled_rows_forward(
    model,
    cache: SBDCache,
    ids: torch.Tensor,
    pos: torch.Tensor,
    n_commit: list[int],
    n_valid: list[int],
    rows: int,
    row_from: int = 0,
) -> torch.Tensor:
    """One forward of ``model`` over ``cache`` (on the CPU) through the compiled step's forward, any row count.

    ``ids`` / ``pos`` [B, T] and the plan ``n_commit`` / ``n_valid`` as for :meth:`SBDCache.forward_plan`. Returns the
    logits of ``rows`` rows per sequence, from row ``n_commit[b] + row_from`` on ([B, rows, V]; -1: the last committed
    row and the block after it), and advances the cache by ``n_commit``. T is marked dynamic: one graph serves every
    row count (a prompt's prefill and each later forward), one per batch size B and (rows, row_from). The first call
    compiles (minutes on one thread for a 135M model; inductor's on-disk cache keeps it for the next process). The
    model's drafter factors are read as they were at the last ``drafter.refresh``, its quantized weights from the
    weight arena as the first call (or the last ``weight_arena.prepare``) left it. Used by the vLLM proposer
    (sbd_ext.integration.vllm, ``SBD_EXT_VLLM_COMPILE``)."""
    device = cache.layers[0].keys.device
    if device.type != "cpu":
        raise ValueError(f"compiled_rows_forward runs on the CPU (CUDA: generate(..., compile=True)), got {device}")
    if ids.dim() != 2 or ids.shape != pos.shape or ids.shape[1] < 2:
        raise ValueError(
            f"compiled_rows_forward: ids and pos must be [B, T] of the same shape with T >= 2, got "
            f"{tuple(ids.shape)} and {tuple(pos.shape)}"
        )
    n_commit, n_valid = cache.check_plan(n_commit, n_valid)
    tokens = torch.stack([ids, pos])
    meta = torch.tensor([cache.seq_lens, n_commit, n_valid], dtype=torch.int32)
    torch._dynamo.mark_dynamic(tokens, 2)
    args, key = (model, cache, tokens, meta, rows, True, 0, row_from), ("rows-forward", id(model))
    with cache.static_forwards(), weight_arena.in_use(model, device, checked=False):
        try:
            logits = (_static_forward if key in _EAGER else _compiled_forward(device))(*args)
        except (torch._dynamo.exc.FailOnRecompileLimitHit, torch._dynamo.exc.Unsupported) as e:
            if not _recompile_limit_hit(e):
                raise
            _fall_back(key)  # dynamo's graph bound on the step's code: this forward uncompiled from now on
            logits = _static_forward(*args)
    cache.advance(n_commit)
    return logits


_CACHE_POOL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: [cache, leased]}


@contextlib.contextmanager
def pooled_cache(model, batch_size: int, rows: int, dtype: torch.dtype, device: torch.device):
    """Lease an SBDCache reused across generations of ``model`` with this batch size (CUDA graphs): the graphs read
    and write the cache buffers at fixed addresses, and a new buffer makes CUDA-graph trees re-record (after 128
    re-records they stop using graphs for the function). Grown to a power of two when too short; a fresh,
    unpooled cache while the pooled one is leased (concurrent calls)."""
    key = (batch_size, dtype, str(device))
    with _COMPILE_LOCK:
        pool = _CACHE_POOL.setdefault(model, {})
        entry = pool.get(key)
        if entry is not None and entry[1]:
            entry = [SBDCache(model.config, batch_size, rows, dtype, device), True]  # not pooled
        else:
            if entry is None or entry[0].max_cache_len < rows:
                entry = pool[key] = [SBDCache(model.config, batch_size, 1 << (rows - 1).bit_length(), dtype, device)]
                entry.append(False)
            entry[1] = True
    entry[0].rewind()
    try:
        yield entry[0]
    finally:
        entry[1] = False


class StaticStep(DecodeStep):
    """The compiled forwards, with no host length read inside (the plan is device tensors) and shapes fixed by
    (B, k), so one graph serves every forward of every generation with that B and k.

    On CUDA: the forwards after the prefill, [B, 2k] rows in SBD mode (up to k committed rows padded to k, then the
    block: the prefill commits the prompt, so a later forward commits one finished block at most), [B, 1] in NTP
    mode; one CUDA graph, and at small batch the padding rows are nearly free (memory-bound). The prefill is eager.

    On the CPU a forward's cost grows with its rows (compute-bound: 16 rows cost ~2x 8 rows on the embedded model),
    so SBD forwards keep eager decoding's row count -- k + the committed rows -- and that count is marked dynamic:
    one graph for all of them (at least 2 rows: a size-1 dim would be specialised). NTP forwards are [B, 1]. The
    prefill is eager in every mode (see :func:`decode_compiled`).

    Called with a host :class:`ForwardRows`; validates its plan on the host, copies ids, positions and plan to the
    device, runs the compiled forward and advances the host lengths. The caller's read-back of the sampled block is
    the forward's one device-to-host copy."""

    def __init__(self, model, cache: SBDCache, job: Job, device: torch.device, variant: tuple):
        self.model, self.cache, self.device = model, cache, device
        self.variant = variant  # its _variant_key: what falls back to eager if dynamo's limit is hit
        self.dynamic_rows = job.sbd and device.type != "cuda"
        self.max_drafts = None if self.dynamic_rows else job.block_size  # 2k static rows: k drafts + the block
        self.sbd, self.block_size = job.sbd, job.block_size
        # Plain SBD reads only the block rows; verify / first_from_ntp also read committed rows: every row then.
        self.block_rows = job.block_size if job.sbd and not job.first_from_ntp else 0
        self.branch_rows = job.branch_rows  # every forward carries them (one graph), used or not
        self.static_branch = self.branch_rows > 0
        self.static_alternates = job.alternates  # the alternates' groups too
        self.fn = _compiled_forward(device)
        self._guarded: set[tuple] = set()  # the calls (shapes, arguments) that passed the full guards
        self._direct: dict[tuple, direct_call.DirectCall] = {}  # their captured graph calls (CPU)
        self._direct_any: dict[tuple, direct_call.DirectCall] = {}  # the same, by every shape but the row count
        self._captures: dict[tuple, int] = {}  # capture tries per call

    def _call_skipping(self, args: tuple):
        """The step's call with only the guards that tell its graphs apart; None where dynamo would have to compile
        under that stance (it raises before running anything): the caller then calls with every guard."""
        try:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self.fn(*args)
        except RuntimeError as e:
            if "skip_guard_eval_unsafe" not in str(e):
                raise
            return None

    def _replay_at(self, seen: tuple) -> direct_call.DirectCall | None:
        """This generation's captured call of another row count, where its graph is known to run at ``seen`` (a
        full call ran it at these shapes earlier in the process: the row count is a dynamic size of one graph, and
        this generation's own full call checked the model and the cache); else None."""
        direct = self._direct_any.get(_any_rows(seen)) if self.dynamic_rows else None
        if direct is None or seen not in _ran_at(direct.fn):
            return None
        self._direct[seen] = direct
        return direct

    def rows(self, needed: int) -> int:
        if not self.sbd:
            return 1
        return max(needed, 2) if self.dynamic_rows else 2 * self.block_size  # (+ the branch's rows, after these)

    def __call__(self, fw: ForwardRows) -> StepLogits:
        n_commit, n_valid = self.cache.check_plan(fw.n_commit, fw.n_valid)
        tokens = torch.stack([fw.ids, fw.pos])
        rows = [self.cache.seq_lens, n_commit, n_valid]
        if self.branch_rows:
            if fw.branch_rows != self.branch_rows:
                raise RuntimeError(f"internal: a static forward needs {self.branch_rows} branch rows")
            rows += self.cache.check_branch(n_commit, *fw.branch[1:], self.branch_rows)
        if self.static_alternates:
            if fw.n_alt_groups != self.static_alternates:
                raise RuntimeError(f"internal: a static forward needs {self.static_alternates} alternates' groups")
            rows += self.cache.check_alternates(n_commit, fw.branch, fw.alternates)[1]
        meta = torch.tensor(rows, dtype=torch.int32)
        if self.device.type == "cuda":
            tokens = tokens.pin_memory().to(self.device, non_blocking=True)
            meta = meta.pin_memory().to(self.device, non_blocking=True)
            torch.compiler.cudagraph_mark_step_begin()  # the previous forward's logits are consumed
        if self.dynamic_rows:
            torch._dynamo.mark_dynamic(tokens, 2)
        # The full guards on this call's first occurrence in the generation, then only those that tell the graphs
        # apart, when no other thread exists (see COMPILED_RUN_LOCK)
        A = self.static_alternates
        args = (self.model, self.cache, tokens, meta, self.block_rows, self.sbd, self.branch_rows, 0, A)
        rows_s = self.cache.layers[0].keys.shape[2]  # the cache's capacity: a grown cache is checked in full again
        seen = (tuple(tokens.shape), tuple(meta.shape), rows_s, self.block_rows, self.sbd, self.branch_rows, A)
        direct = self._direct.get(seen) or self._replay_at(seen)
        # a full call whose argument list later calls of these shapes replay (direct_call); a second try where the
        # first call compiled the graph (it ran a function installed during the call, not the captured one)
        capture = direct is None and DIRECT_CALLS and self.device.type == "cpu" and self.fn is not _static_forward
        capture = capture and self._captures.get(seen, 0) < 2
        skip = seen in self._guarded and self.fn is not _static_forward and _skip_guards_now() and not capture
        try:
            logits = direct(tokens, meta) if direct is not None else None
            if logits is None and skip:
                logits = self._call_skipping(args)
            if logits is None and capture:
                self._captures[seen] = self._captures.get(seen, 0) + 1
                logits, direct = direct_call.capture(self.fn, _GRAPH_GLOBALS, args, (tokens, meta), (0, 2), {rows_s})
                self._guarded.add(seen)
                if direct is not None:
                    self._direct[seen] = self._direct_any[_any_rows(seen)] = direct
                    _ran_at(direct.fn).add(seen)
            if logits is None:
                logits = self.fn(*args)
                self._guarded.add(seen)
        except (torch._dynamo.exc.FailOnRecompileLimitHit, torch._dynamo.exc.Unsupported) as e:
            if not _recompile_limit_hit(e):
                raise
            # dynamo's graph bound was reached after all (guards this module cannot see, e.g. another thread
            # count, add graphs): the same forward, uncompiled, for the rest of this variant; nothing ran yet.
            _fall_back(self.variant)
            self.fn = _static_forward
            logits = self.fn(*args)
        self.cache.advance(n_commit)
        return StepLogits(logits, first_row=0, block_rows_only=self.block_rows > 0)
