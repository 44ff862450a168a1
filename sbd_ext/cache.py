"""The KV cache of SBD decoding and the plan of one forward (core; used by :mod:`sbd_ext.decoding` and
:mod:`sbd_ext.hf`).

* :class:`SBDCache` -- a ``transformers.Cache`` with preallocated per-layer K/V buffers ``[B, Hkv, S_max, D]`` and
  per-sequence lengths. Only :func:`sbd_ext.ops.block_attention` writes it (the committed rows of a forward, in
  place at each sequence's length), so set-block (mask-slot) rows are never stored: the cache is exact.
* :class:`SBDForwardPlan` (:mod:`sbd_ext.forward_plan`) -- one forward's ``cache_lens`` / ``n_commit`` /
  ``n_valid``, passed to the model as the ``sbd_plan`` forward kwarg and consumed by the ``"sbd"`` attention
  function of every layer.

Two ways to run a forward over the cache:

* eager, any shape: ``with cache.forward_plan(n_commit, n_valid) as plan: model(..., sbd_plan=plan)`` validates the
  plan, builds its device tensors from the host lengths, and advances the lengths when the forward returns;
* compiled, static shapes (``generate(..., compile=True)``): inside ``with cache.static_forwards():`` the caller
  validates each plan on the host (:meth:`SBDCache.check_plan`), runs a compiled function that builds the plan from
  device tensors with :meth:`SBDCache.device_plan` (no host int is read while tracing, so nothing recompiles as the
  lengths change), then calls :meth:`SBDCache.advance`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import families
from .forward_plan import SBDForwardPlan

__all__ = ["SBDCache", "SBDForwardPlan", "SBDLayer"]


class SBDLayer(CacheLayerMixin):
    """One layer of an :class:`SBDCache`: preallocated ``keys``/``values`` [B, Hkv, S_max, D].

    ``update`` stores nothing and returns this forward's new rows: :func:`sbd_ext.ops.block_attention` appends the
    committed rows itself (in place, at the sequence's length), so set-block rows are never stored.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        owner: SBDCache,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_cache_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self._owner = owner
        self.max_cache_len = max_cache_len
        self.dtype, self.device = dtype, torch.device(device)
        shape = (batch_size, num_kv_heads, max_cache_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # preallocated in __init__

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self._owner._planned:
            raise RuntimeError(
                "SBDCache is written by the sbd_ext block-attention kernel only: run the forward inside "
                "`with cache.forward_plan(n_commit, n_valid) as plan:` and pass `sbd_plan=plan` (see sbd_ext.generate)"
            )
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The keys the attention receives are this forward's rows only (``update`` returns them; the kernel reads the
        # cache itself), so the mask transformers sizes is [query_length, query_length] at offset 0; sbd_mask returns
        # None for it and the plan's attention ignores it. Constant: nothing here reads the per-sequence lengths.
        return query_length, 0

    def get_seq_length(self) -> int:
        return max(self._owner.seq_lens, default=0)

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.keys.zero_()
        self.values.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("SBDCache does not support beam search")


class SBDCache(Cache):
    """A ``transformers.Cache`` for SBD decoding: per-layer K/V buffers [B, Hkv, S_max, D] and per-sequence lengths.

    ``seq_lens[b]`` (host ints) counts the valid rows of sequence b. A forward runs under :meth:`forward_plan`,
    which validates the plan (no overflow) and, when the forward returns, checks that every layer went through the
    kernel and advances each length by its ``n_commit`` -- once per forward, not per layer.
    """

    def __init__(
        self,
        config,
        batch_size: int,
        max_cache_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        cfg = config.get_text_config(decoder=True)
        n_heads = cfg.num_attention_heads
        n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
        head_dim = families.head_dim(cfg)
        if batch_size < 1 or max_cache_len < 1:
            raise ValueError(f"SBDCache: batch_size and max_cache_len must be >= 1, got {batch_size}, {max_cache_len}")
        self.seq_lens: list[int] = [0] * batch_size
        self._max_cache_len = max_cache_len
        self._planned = False  # a forward may run: inside forward_plan, or static_forwards (plans from the caller)
        layers = [
            SBDLayer(self, batch_size, n_kv, head_dim, max_cache_len, dtype, device)
            for _ in range(cfg.num_hidden_layers)
        ]
        super().__init__(layers=layers)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    # A read-only property: transformers 5.17 defines Cache.max_cache_len as one (deprecated, without a setter), so
    # assigning the attribute fails there; this overrides it on every version, without the deprecation warning.
    @property
    def max_cache_len(self) -> int:
        """Rows per sequence in every layer (the capacity S of the K/V buffers)."""
        return self._max_cache_len

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.seq_lens, default=0)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0  # see SBDLayer.get_mask_sizes: the attention's keys start at this forward's first row

    def lengths(self) -> torch.Tensor:
        """Per-sequence valid lengths, int64 [B] on the CPU."""
        return torch.tensor(self.seq_lens, dtype=torch.int64)

    def reset(self) -> None:
        super().reset()
        self.seq_lens = [0] * self.batch_size

    def rewind(self) -> None:
        """Every length back to 0 for a new generation; the buffers keep their rows (never read past a length)."""
        self.seq_lens = [0] * self.batch_size

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("SBDCache does not support crop (lengths are per sequence)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("SBDCache has a fixed batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("SBDCache has a fixed batch")

    def rollback(self, b: int, length: int) -> None:
        """Shorten sequence ``b`` to ``length`` valid rows (verify mode, after a correction): the rows after it
        are stale and are overwritten by later commits; attention never reads past a sequence's length."""
        if not 0 <= length <= self.seq_lens[b]:
            raise ValueError(f"SBDCache.rollback: sequence {b} holds {self.seq_lens[b]} rows, cannot keep {length}")
        self.seq_lens[b] = int(length)

    def batch_view(self, lo: int, hi: int) -> SBDCache:
        """Sequences ``[lo, hi)`` as a cache of their own that shares this cache's K/V buffers (views: a forward
        over the view appends its committed rows here). Its lengths start as a copy of this cache's: after the
        forwards, write them back with ``cache.seq_lens[lo:hi] = view.seq_lens``. No plan may be active here."""
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo < hi <= self.batch_size):
            raise ValueError(f"SBDCache.batch_view: need 0 <= lo < hi <= {self.batch_size}, got {lo!r}, {hi!r}")
        if self._planned:
            raise RuntimeError("SBDCache.batch_view: a forward plan is active on this cache")
        view = SBDCache.__new__(SBDCache)
        view.seq_lens, view._max_cache_len, view._planned = self.seq_lens[lo:hi], self._max_cache_len, False
        layers = []
        for layer in self.layers:
            v = SBDLayer.__new__(SBDLayer)
            CacheLayerMixin.__init__(v)
            v._owner, v.max_cache_len, v.dtype, v.device = view, layer.max_cache_len, layer.dtype, layer.device
            v.keys, v.values, v.is_initialized = layer.keys[lo:hi], layer.values[lo:hi], True
            layers.append(v)
        Cache.__init__(view, layers=layers)
        return view

    def check_plan(self, n_commit: Sequence[int], n_valid: Sequence[int]) -> tuple[list[int], list[int]]:
        """Validate one forward's plan against the host lengths (no overflow) -> (n_commit, n_valid) as int lists.

        n_commit[b] rows at the front of sequence b's rows are committed (causal; their K/V are appended at
        ``seq_lens[b]``); rows [n_commit[b], n_valid[b]) are the set block; the rest padding.
        """
        B = self.batch_size
        n_commit, n_valid = [int(x) for x in n_commit], [int(x) for x in n_valid]
        if len(n_commit) != B or len(n_valid) != B:
            raise ValueError(f"SBDCache.forward_plan: need {B} n_commit / n_valid entries")
        for b in range(B):
            if not 0 <= n_commit[b] <= n_valid[b]:
                raise ValueError(
                    f"SBDCache.forward_plan: sequence {b} needs 0 <= n_commit <= n_valid, "
                    f"got {n_commit[b]}, {n_valid[b]}"
                )
            if self.seq_lens[b] + n_commit[b] > self.max_cache_len:
                raise ValueError(
                    f"SBDCache overflow: sequence {b} holds {self.seq_lens[b]} rows and commits {n_commit[b]} more, "
                    f"but the cache has {self.max_cache_len} rows"
                )
        return n_commit, n_valid

    def advance(self, n_commit: Sequence[int]) -> None:
        """After a forward: each sequence's length grows by its committed rows."""
        self.seq_lens = [L + int(c) for L, c in zip(self.seq_lens, n_commit, strict=True)]

    def _claim(self) -> None:
        if self._planned:
            raise RuntimeError("SBDCache.forward_plan: a forward plan is already active")
        self._planned = True

    def check_branch(self, n_commit: Sequence[int], branch_at: Sequence[int], branch_valid: Sequence[int], rows: int):
        """Validate a forward's branch (see :class:`SBDForwardPlan`) -> (branch_lens, branch_valid) as int lists:
        sequence b's branch rows see its first ``branch_at[b]`` committed rows (0 < branch_at <= n_commit where
        ``branch_valid[b]`` > 0, else 0), so its cache length is ``seq_lens[b] + branch_at[b]``; and
        0 <= branch_valid <= rows."""
        at, bv = [int(x) for x in branch_at], [int(x) for x in branch_valid]
        if len(at) != self.batch_size or len(bv) != self.batch_size:
            raise ValueError(f"SBDCache.forward_plan: need {self.batch_size} branch_at / branch_valid entries")
        for b in range(self.batch_size):
            if not 0 <= bv[b] <= rows or not (0 < at[b] <= int(n_commit[b]) if bv[b] else at[b] == 0):
                raise ValueError(
                    f"SBDCache.forward_plan: sequence {b}'s branch needs 0 <= branch_valid <= {rows} and "
                    f"0 < branch_at <= n_commit ({int(n_commit[b])}), got branch_at {at[b]}, branch_valid {bv[b]}"
                )
        return [L + a for L, a in zip(self.seq_lens, at, strict=True)], bv

    def check_alternates(self, n_commit: Sequence[int], branch, alternates) -> tuple:
        """Validate a forward's alternates (see :class:`SBDForwardPlan`) -> (rows, valid: per group, a list of its
        valid rows per sequence). A sequence with an alternate has a branch (at ``branch_at[b]``) and commits its
        first draft (row ``branch_at[b]``)."""
        S, valid = int(alternates[0]), [[int(v) for v in group] for group in alternates[1]]
        at = [int(a) for a in branch[1]] if branch is not None and int(branch[0]) else [0] * self.batch_size
        if S < 2 or any(len(group) != self.batch_size for group in valid):
            raise ValueError(f"SBDCache.forward_plan: alternates need rows >= 2 and {self.batch_size} entries each")
        for b in range(self.batch_size):
            used = [group[b] for group in valid]
            if any(v not in (0, S) for v in used):
                raise ValueError(f"SBDCache.forward_plan: sequence {b}'s alternates need 0 or {S} valid rows: {used}")
            if any(used):
                if not 0 < at[b] < int(n_commit[b]):
                    raise ValueError(
                        f"SBDCache.forward_plan: sequence {b}'s alternates sit behind its branch point and need it "
                        f"to commit the first draft (0 < branch_at < n_commit), got branch_at {at[b]}, n_commit "
                        f"{int(n_commit[b])}"
                    )
        return S, valid

    @contextlib.contextmanager
    def forward_plan(
        self,
        n_commit: Sequence[int],
        n_valid: Sequence[int],
        branch: tuple[int, Sequence[int], Sequence[int]] | None = None,
        alternates: tuple[int, Sequence[Sequence[int]]] | None = None,
    ):
        """Validate and expose one forward's plan (eager forwards); on a normal exit, advance ``seq_lens`` by
        ``n_commit``. See :meth:`check_plan` for what the counts mean; ``branch``: ``(rows, branch_at,
        branch_valid)``, the forward's last ``rows`` rows are a second set block (:class:`SBDForwardPlan`);
        ``alternates``: ``(rows, valid)``, after the branch ``len(valid)`` groups of ``rows`` rows, ``valid[j][b]``
        of group j real for sequence b (0 or ``rows``; only beside a branch)."""
        n_commit, n_valid = self.check_plan(n_commit, n_valid)
        R = int(branch[0]) if branch is not None else 0
        rows = [self.seq_lens, n_commit, n_valid] + (list(self.check_branch(n_commit, *branch[1:], R)) if R else [])
        alts = self.check_alternates(n_commit, branch, alternates) if alternates is not None else None
        self._claim()
        device = self.layers[0].keys.device
        try:
            meta = torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True)
            spans = [(c, v) for c, v in zip(n_commit, n_valid, strict=True) if v > c]
            block_rows = (min(c for c, _ in spans), max(v for _, v in spans)) if spans else (0, 0)
            plan = SBDForwardPlan(self, meta[0], meta[1], meta[2], block_rows=block_rows)
            if R:
                plan.set_branch(R, meta[3], meta[4])
            if alts is not None:
                plan.set_alternates(alts[0], torch.tensor(alts[1], dtype=torch.int32).to(device, non_blocking=True))
            yield plan
        finally:
            self._planned = False
        plan.check_layers()
        self.advance(n_commit)

    @contextlib.contextmanager
    def static_forwards(self):
        """A run of forwards whose plans the caller builds from device tensors (:meth:`device_plan`), e.g. inside a
        compiled function; the caller validates each plan with :meth:`check_plan` and calls :meth:`advance`.

        The K/V buffers are marked for torch.compile: static addresses (CUDA graphs read and write them in place
        instead of copying them in) and a dynamic row count (caches of different lengths share one graph).
        """
        self._claim()
        for layer in self.layers:
            for t in (layer.keys, layer.values):
                torch._dynamo.mark_static_address(t)
                torch._dynamo.mark_dynamic(t, 2)
        try:
            yield self
        finally:
            self._planned = False

    def device_plan(
        self,
        cache_lens: torch.Tensor,
        n_commit: torch.Tensor,
        n_valid: torch.Tensor,
        branch: tuple[int, torch.Tensor, torch.Tensor] | None = None,
    ) -> SBDForwardPlan:
        """The plan of one forward from device tensors [B] int32 (traceable: reads no host length). Only inside
        :meth:`static_forwards`; the caller has validated the counts with :meth:`check_plan` (and
        :meth:`check_branch`). ``branch``: ``(rows, branch_lens, branch_valid)`` (:class:`SBDForwardPlan`)."""
        plan = SBDForwardPlan(self, cache_lens, n_commit, n_valid)
        if branch is not None and branch[0]:
            plan.set_branch(*branch)
        return plan
