"""The host's side of the device cycle (:mod:`sbd_ext.decoding.device_cycle`): the device state built from the host's
after the prefill and written back at the end, the loop that runs the cycles (compiled: one graph per cycle) and
reads the status every ``SYNC_EVERY`` cycles, streaming, and the errors the state records."""

from __future__ import annotations

import contextlib
import weakref

import torch

from .. import ops, weight_arena
from ..cache import SBDCache
from . import compiled as _compiled
from . import device_cycle as dcyc
from . import direct_call
from .compile_options import _COMPILE_LOCK, compiled_once
from .compiled import _compiled_variant_ok, _variant_key
from .device_cycle import ERRORS, FIELDS, SYNC_EVERY
from .settings import Job
from .state import SequenceState
from .step import EagerStep, decode
from .streaming import StreamingState

__all__ = ["CycleState", "decode_device", "state_from_host", "state_to_host"]


class CycleState:
    """The decoding state of a batch on the device (see FIELDS), built from the host's after the prefill."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.__dict__.update(tensors)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f) for f in FIELDS)


def state_from_host(
    seqs: list[SequenceState],
    job: Job,
    clen: list[int],
    device: torch.device,
    width: int | None = None,
    length: int | None = None,
) -> CycleState:
    """The device state equal to the host's ``seqs`` and the cache lengths ``clen``; ``width``: the pending
    tokens' buffer (default k: after the prefill); ``length``: the output buffer's (default: the longest prompt +
    the budget + 2k)."""
    B, K = len(seqs), job.block_size
    W = K if width is None else width
    L = max(len(s.prompt) for s in seqs) + job.max_new_tokens + 2 * K  # room for a cycle's appends past the budget
    L = L if length is None else max(L, length)
    out = torch.zeros(B, L, dtype=torch.int64)
    pend = torch.zeros(B, W, dtype=torch.int64)
    block = torch.full((B, K), job.filler, dtype=torch.int64)
    corr = torch.zeros(B, L, dtype=torch.bool)
    ints = {f: [] for f in ("n_gen", "p_len", "n_pend", "n_draft", "k", "bver", "nfe", "ncorr")}
    for b, s in enumerate(seqs):
        row = s.prompt + s.gen
        out[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
        if len(s.pending) > W or len(s.block) > K:
            raise RuntimeError("internal: the host state holds more pending or block tokens than the buffers")
        pend[b, : len(s.pending)] = torch.tensor(s.pending, dtype=torch.int64)
        if s.block and not s.done:
            block[b, : len(s.block)] = torch.tensor(s.block, dtype=torch.int64)
        for p in s.corrections:
            corr[b, p] = True
        for f, v in (
            ("n_gen", len(s.gen)),
            ("p_len", len(s.prompt)),
            ("n_pend", len(s.pending)),
            ("n_draft", s.n_draft),
            ("k", 0 if s.done else len(s.block)),
            ("bver", s.block_verified),
            ("nfe", s.nfe),
            ("ncorr", s.corrected),
        ):
            ints[f].append(v)
    t = {f: torch.tensor(v, dtype=torch.int64) for f, v in ints.items()}
    t.update(out=out, pend=pend, block=block, corr=corr, clen=torch.tensor(clen, dtype=torch.int64))
    t.update(done=torch.tensor([s.done for s in seqs]), err=torch.zeros(B, dtype=torch.int64))
    return CycleState({f: v.to(device) for f, v in t.items()})


def raise_errors(err: list[int]) -> None:
    for b, e in enumerate(err):
        if e:
            raise RuntimeError(ERRORS[e].format(b=b))


def state_to_host(st: CycleState, seqs: list[SequenceState]) -> list[int]:
    """Write the finished state back to ``seqs`` (their output and counts); returns the cache lengths."""
    out, n_gen, p_len, corr = st.out.cpu(), st.n_gen.tolist(), st.p_len.tolist(), st.corr.cpu()
    nfe, ncorr = st.nfe.tolist(), st.ncorr.tolist()
    for b, s in enumerate(seqs):
        s.gen = out[b, p_len[b] : p_len[b] + n_gen[b]].tolist()
        s.nfe, s.corrected = nfe[b], ncorr[b]
        s.corrections = corr[b].nonzero().flatten().tolist()
        s.pending, s.n_draft, s.block, s.done = [], 0, [], True
    return st.clen.tolist()


def final_tokens(st: CycleState, job: Job) -> list[list[int]]:
    """Each sequence's generated tokens that are final now (as :class:`~sbd_ext.decoding.streaming.StreamingState`
    says): the output, and in plain SBD the block's revealed prefix up to its first masked position."""
    out, n_gen, p_len = st.out.cpu(), st.n_gen.tolist(), st.p_len.tolist()
    block, k, done = st.block.cpu(), st.k.tolist(), st.done.tolist()
    res = []
    for b in range(out.shape[0]):
        gen = out[b, p_len[b] : p_len[b] + n_gen[b]].tolist()
        if job.sbd and not job.verify and not done[b] and k[b]:
            blk = block[b, : k[b]].tolist()
            n = next((j for j, t in enumerate(blk) if t == job.mask_id), len(blk))
            gen += blk[:n]
        res.append(gen)
    return res


# --------------------------------------------------------------------------------------------------------
# the host's loop
# --------------------------------------------------------------------------------------------------------
_CYCLE_VARIANTS: set = set()  # the cycle's compiled variants (dynamo bounds each function's graphs)


_STATE_POOL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {shapes: CycleState}


def _pooled(model, st: CycleState) -> CycleState:
    """The state of an earlier generation of ``model`` with the same shapes, refilled with ``st``'s values (else
    ``st``, pooled). CUDA graphs read and write the state in place at fixed addresses (marked static): a new
    buffer each generation would make CUDA-graph trees record the cycle again (and give up after 128 records).
    Compiled generations run one at a time (COMPILED_RUN_LOCK), so a pooled state has one user."""
    key = tuple((tuple(t.shape), t.dtype) for t in st.tensors()) + (str(st.out.device),)
    with _COMPILE_LOCK:
        pool = _STATE_POOL.setdefault(model, {})
        old = pool.get(key)
        if old is None:
            pool[key] = st
            for t in st.tensors():
                torch._dynamo.mark_static_address(t)
            return st
    for t, v in zip(old.tensors(), st.tensors(), strict=True):
        t.copy_(v)
    return old


class _CycleCall:
    """The cycle's calls in one generation. Compiled on the CPU, the first call of each row count goes through dynamo
    and records its graph call (:mod:`~sbd_ext.decoding.direct_call`); later cycles of that row count call the graph
    directly with their row index: the state, the cache and the model are the same objects every cycle."""

    def __init__(self, fn, args: tuple, device: torch.device, cache: SBDCache, st: CycleState):
        self.fn, self.args = fn, args
        self.compiled = fn is not dcyc.cycle
        self.capture = self.compiled and device.type == "cpu" and _compiled.DIRECT_CALLS
        # the sizes fixed within the generation that the graph may take as integers (dynamic dims)
        self.fixed = {cache.layers[0].keys.shape[2], st.out.shape[1], st.corr.shape[1], st.pend.shape[1]}
        self.direct: dict = {}
        self.tries: dict = {}

    def __call__(self, rows: torch.Tensor | None) -> None:
        key = None if rows is None else rows.shape[0]
        direct = self.direct.get(key)
        if direct is not None:
            direct(*(() if rows is None else (rows,)))
            return
        args = self.args + (rows,)
        if rows is not None and self.compiled:  # through dynamo: the row count is a dynamic size (one graph)
            torch._dynamo.mark_dynamic(rows, 0)
        if not self.capture or self.tries.get(key, 0) >= 2:  # a second try where the first call compiled
            self.fn(*args)
            return
        self.tries[key] = self.tries.get(key, 0) + 1
        swap, size_of = ((), None) if rows is None else ((rows,), (0, 0))
        _, direct = direct_call.capture(self.fn, _CYCLE_GLOBALS, args, swap, size_of, self.fixed, returns=False)
        if direct is not None:
            self.direct[key] = direct


_CYCLE_GLOBALS = dcyc.cycle.__globals__  # where dynamo installs the cycle's compiled graphs


def decode_device(
    model, cache: SBDCache, seqs: list[SequenceState], job: Job, device: torch.device, compiled: bool
) -> None:
    """Decode ``seqs`` (fresh) to the end with the cycle on the device (compiled: one graph per cycle; past
    dynamo's bound on compiled variants, eagerly), reading the status once every ``SYNC_EVERY`` cycles. The
    prefill -- the prompt's forward -- is one eager forward on the host first, in every mode (the same cached K/V in
    NTP and verify decoding). The finished state is written back to
    ``seqs`` and the cache's lengths."""
    cuda = device.type == "cuda"
    # On the CPU a forward's cost grows with its rows (compute-bound: the host cycle's compiled step sizes each forward
    # to its rows too), and the state is host memory, free to read: each forward gets the rows its longest sequence
    # needs (at least k, and 2: a size-1 dim would be specialised), one graph for all (a dynamic size).
    sized = job.sbd and not cuda
    # The prompt's forward is eager in every mode, so that its cached K/V are the same bits in NTP and verify
    # decoding (inductor rounds a few ops differently from ATen: see decode_compiled).
    prefill = EagerStep(model, cache, device)
    prefill.max_drafts = job.block_size  # a cycle commits at most k rows
    decode(seqs, job, prefill, max_forwards=1)
    if all(s.done for s in seqs):
        return
    width = None
    if sized:  # the pending buffer holds the rows to commit (+1: never k, so the graph never guards on width == k)
        width = max(job.block_size, max(len(s.pending) for s in seqs)) + 1
    B = len(seqs)
    # CUDA: the output buffers sized by the cache's capacity (pooled, a power of two), so that generations of other
    # lengths reuse one pooled state (_pooled) and its recorded graphs.
    length = cache.max_cache_len + 2 * job.block_size if cuda else None
    st = state_from_host(seqs, job, cache.seq_lens, device, width, length)
    stop = torch.tensor(sorted(job.stop_ids) or [-1], dtype=torch.int64, device=device)
    max_new = torch.full((B,), job.max_new_tokens, dtype=torch.int64, device=device)
    spec = (job.block_size, job.sbd, job.verify, job.first_from_ntp, job.sampler, job.threshold, job.mask_id)
    spec += (job.filler, job.seed)
    head, emb = job.sampler_head or (None, None)
    fn = dcyc.cycle
    key = ("device-cycle",) + _variant_key(model, job, device, cache.layers[0].keys.dtype)
    if compiled and _compiled_variant_ok(key, _CYCLE_VARIANTS):
        drafter = getattr(model, "sbd_drafter", None)
        if drafter is not None:  # the graphs read the adapters' decoding copies of their factors unchecked
            drafter.refresh(model, device)
        fn = compiled_once(dcyc.cycle, device)
        for t in (st.out, st.corr) + ((st.pend,) if sized else ()):  # prompt lengths and budgets: one graph
            torch._dynamo.mark_dynamic(t, 1)
        st = _pooled(model, st)  # (on the CPU too: the same path, and a repeated shape reuses its buffers)
    tensors, every = st.tensors(), SYNC_EVERY.get(device.type, 4)
    call = _CycleCall(fn, (model, cache, tensors, stop, max_new, spec, head, emb), device, cache, st)
    streams = [s for s in seqs if isinstance(s, StreamingState)]
    # Every live cycle yields a token or reveals one (else err 3): a bound that only a bug can reach.
    cycles, bound = 0, job.max_new_tokens + 3
    arena = weight_arena.in_use(model, device) if fn is not dcyc.cycle else contextlib.nullcontext()
    with cache.static_forwards(), arena:
        while True:
            for _ in range(every):
                if cuda:
                    torch.compiler.cudagraph_mark_step_begin()
                rows = None
                if sized:
                    need = int(torch.where(st.done, 0, st.n_pend + st.k).max())
                    rows = torch.arange(max(need, job.block_size, 2))
                call(rows)
            cycles += every
            both = torch.stack([st.done.long(), st.err]).cpu()  # the one device-to-host read
            raise_errors(both[1].tolist())
            if streams:
                for s, final in zip(seqs, final_tokens(st, job), strict=True):
                    if len(final) > s.streamed:
                        s.on_final_tokens(s.index, final[s.streamed :])
                        s.streamed = len(final)
            if bool(both[0].all()):
                break
            if cycles > bound:
                raise RuntimeError("internal: the device cycle made no progress")
    cache.seq_lens = state_to_host(st, seqs)
    for s in streams:
        s._emit()
    if cuda:
        ops.check_cuda_errors()
