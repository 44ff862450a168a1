"""One forward's plan over an :class:`sbd_ext.cache.SBDCache` (core): the rows every layer's attention appends and
attends with, the branch's and the alternates' rows behind them, passed to the model as the ``sbd_plan`` forward
kwarg. Built by :meth:`SBDCache.forward_plan` (eager) or :meth:`SBDCache.device_plan` (compiled); re-exported by
:mod:`sbd_ext.cache`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import ops
from .hf import ATTN_IMPLEMENTATION

if TYPE_CHECKING:
    from .cache import SBDCache

__all__ = ["SBDForwardPlan"]


@dataclass
class SBDForwardPlan:
    """One forward's plan, passed to the model as the ``sbd_plan`` forward kwarg.

    It reaches :func:`sbd_ext.hf.sbd_attention_forward` through ``LlamaModel.forward(**kwargs)`` -> decoder layer
    -> ``LlamaAttention.forward(**kwargs)`` -> ``attention_interface(..., **kwargs)``, which calls :meth:`attend`.
    """

    cache: SBDCache
    cache_lens: torch.Tensor  # [B] int32, rows valid before this forward
    n_commit: torch.Tensor  # [B] int32
    n_valid: torch.Tensor  # [B] int32
    layers_done: int = 0
    # Host hint (eager plans): rows [lo, hi) hold every set-block row of the forward ((0, 0): none) but the branch's.
    # None when the plan is built from device tensors (compiled step); readers then use n_commit / n_valid.
    block_rows: tuple[int, int] | None = None
    # The branch (verify decoding with ``branch=True``): the forward's last ``branch_rows`` rows are a second set
    # block of each sequence, placed behind its first committed rows only: they attend to the cache up to
    # ``branch_lens[b]`` rows (the rows before the forward plus the committed rows up to the branch point, whose K/V
    # the first call of each layer has just appended) and bidirectionally to each other, and write nothing.
    # ``branch_valid[b]`` of them are real (0: sequence b has no branch in this forward).
    branch_rows: int = 0
    branch_lens: torch.Tensor | None = None  # [B] int32
    branch_valid: torch.Tensor | None = None  # [B] int32
    branch_commit: torch.Tensor | None = None  # [B] int32 zeros: the branch commits nothing

    # The alternates (verify with ``alternates``): after the branch, groups of ``alt_rows`` rows, each a committed
    # row (a runner-up of the first draft, at the first draft's position) and a set block behind it. They see the
    # cache up to the branch point, as the branch does; each group's first row writes its K/V where the first
    # draft's are, so after the last group the first draft's row is appended there again (``alt_restore[b]`` = 1
    # where sequence b had an alternate): the cache is as the forward without them left it.
    alt_rows: int = 0
    alt_valid: tuple = ()  # per group, [B] int32 valid rows (0 or alt_rows)
    alt_commit: tuple = ()  # per group, [B] int32 (1 where valid)
    alt_restore: torch.Tensor | None = None  # [B] int32

    def set_branch(self, rows: int, lens: torch.Tensor, valid: torch.Tensor) -> None:
        self.branch_rows, self.branch_lens, self.branch_valid = int(rows), lens, valid
        self.branch_commit = torch.zeros_like(valid)  # once per forward, not per layer

    def set_alternates(self, rows: int, valid: torch.Tensor) -> None:
        """``valid`` [A, B] int32: group j's valid rows of sequence b (0 or ``rows``); after :meth:`set_branch`."""
        commit = (valid > 0).to(torch.int32)  # once per forward, not per layer
        self.alt_rows, self.alt_valid, self.alt_commit = int(rows), tuple(valid.unbind(0)), tuple(commit.unbind(0))
        self.alt_restore = commit.amax(0)

    @property
    def tail_rows(self) -> int:
        """The rows after the main ones: the branch's, then the alternates'."""
        return self.branch_rows + len(self.alt_valid) * self.alt_rows

    def attend(
        self,
        module,
        query,
        key,
        value,
        scaling: float,
        dropout: float = 0.0,
        softcap: float | None = None,
        window_left: int = -1,
    ) -> torch.Tensor:
        """block_attention of this forward's rows over layer ``module.layer_idx``'s cache; returns [B, T, Hq, D].

        ``softcap`` / ``window_left``: the layer's attention features (:mod:`sbd_ext.families`), kernel parameters."""
        if dropout != 0.0:
            raise RuntimeError("SBD decoding does not support attention dropout: call model.eval()")
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
            raise RuntimeError("SBD decoding is inference only (the kernel has no backward): use torch.no_grad()")
        layer = self.cache.layers[module.layer_idx]
        if key.shape[2] != query.shape[2]:
            raise RuntimeError(
                "sbd_plan: the attention received cached keys; pass the SBDCache as past_key_values of the forward"
            )
        if layer.keys.dtype != query.dtype:
            raise TypeError(f"SBDCache holds {layer.keys.dtype} but the model computes in {query.dtype}")
        T, R = query.shape[2], self.tail_rows
        if R and not 0 < R < T:
            raise RuntimeError(f"sbd_plan: a branch of {R} rows in a forward of {T} rows")
        if self.alt_valid and not self.branch_rows:
            raise RuntimeError("sbd_plan: alternates without a branch")

        def attend_rows(rows: slice, cache_lens, n_commit, n_valid) -> torch.Tensor:
            q, k, v = query[:, :, rows], key[:, :, rows], value[:, :, rows]
            return ops.block_attention(
                q, k, v, layer.keys, layer.values, cache_lens, n_commit, n_valid, scaling, softcap, window_left
            )

        out = attend_rows(slice(0, T - R), self.cache_lens, self.n_commit, self.n_valid)
        if R:  # the branch: over the cache as the first call left it, cut at the branch point; writes nothing
            Rb, parts = self.branch_rows, [out]
            parts.append(attend_rows(slice(T - R, T - R + Rb), self.branch_lens, self.branch_commit, self.branch_valid))
            at = T - R + Rb
            for valid, commit in zip(self.alt_valid, self.alt_commit, strict=True):  # each over the same cut
                parts.append(attend_rows(slice(at, at + self.alt_rows), self.branch_lens, commit, valid))
                at += self.alt_rows
            if self.alt_valid:  # the first draft's row (forward row branch_lens - cache_lens) appended again
                B, at = query.shape[0], (self.branch_lens - self.cache_lens).long()

                def row(t: torch.Tensor) -> torch.Tensor:
                    return t.gather(2, at.view(B, 1, 1, 1).expand(B, t.shape[1], 1, t.shape[3]))

                ops.block_attention(
                    row(query), row(key), row(value), layer.keys, layer.values, self.branch_lens, self.alt_restore,
                    self.alt_restore, scaling, softcap, window_left,
                )  # fmt: skip
            out = torch.cat(parts, dim=1)
        self.layers_done += 1
        return out

    def check_layers(self) -> None:
        """After the forward: every layer must have gone through :meth:`attend` (else the cache missed rows)."""
        if self.layers_done != len(self.cache.layers):
            raise RuntimeError(
                f"sbd_plan reached the attention function of {self.layers_done} of {len(self.cache.layers)} layers: "
                f"the model must use attn_implementation={ATTN_IMPLEMENTATION!r} and forward `sbd_plan` to its "
                "attention"
            )
