"""Calling a compiled step's graph without dynamo's per-call layers (CPU).

Each call of a ``torch.compile``-d function goes through dynamo's frame evaluation (its guards, even under the
guard-skipping stance only those that tell the graphs apart) and the bytecode dynamo wrote for the frame, which
fetches every graph input -- ~550 weights for SmolLM2 -- from the model's attributes and then calls the compiled
graph (AOT autograd's runtime wrapper around inductor's code). Measured on SmolLM2-135M w8a8 (AMD EPYC Zen 4,
1 thread): 11.3 ms per NTP step through the compiled function, 8.7 ms calling the compiled graph with the same
inputs directly.

Within one generation nothing changes the model or the cache object between two steps (the assumption the
guard-skipping stance makes too), so the step captures the argument list that dynamo's bytecode built on a full
call, and later calls of the same shapes pass that list with this call's tokens, plan and row count in it
(:class:`DirectCall`). The capture is refused -- the step keeps calling through dynamo -- unless every argument is
accounted for: the compiled function ran exactly once, the tokens and the plan tensor each sit at exactly one place,
every integer is the cache's row count or the tokens' row count (not both), and the function returned the graph's
first output itself. AOT's runtime wrapper and inductor's code run as before (input mutations, the cache's in-place
writes).
"""

from __future__ import annotations

import torch

__all__ = ["DirectCall", "capture"]

PREFIX = "__compiled_fn"  # the globals dynamo installs for the compiled graphs of a frame's code


class DirectCall:
    """A captured call of a compiled graph: ``fn(*args)`` with ``tokens`` / ``meta`` / the row count replaced."""

    def __init__(self, fn, args: list, tokens_at: int, meta_at: int, rows_at: list[int]):
        self.fn, self.args = fn, args
        self.tokens_at, self.meta_at, self.rows_at = tokens_at, meta_at, rows_at

    def __call__(self, tokens: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        args = list(self.args)
        args[self.tokens_at], args[self.meta_at] = tokens, meta
        for i in self.rows_at:
            args[i] = tokens.shape[2]
        return self.fn(*args)[0]


def capture(fn, code_globals: dict, call_args: tuple, tokens: torch.Tensor, meta: torch.Tensor, cache_rows: int):
    """Run ``fn(*call_args)`` (a compiled function whose frame's globals are ``code_globals``) and return its result
    and a :class:`DirectCall` of the compiled graph it ran, or None where the call cannot be replayed safely (see the
    module docstring)."""
    calls: list = []
    names = [k for k in code_globals if k.startswith(PREFIX)]
    real = {k: code_globals[k] for k in names}

    def recorder(graph_fn):
        def record(*a):
            out = graph_fn(*a)
            calls.append((graph_fn, list(a), out))
            return out

        return record

    for k in names:
        code_globals[k] = recorder(real[k])
    try:
        result = fn(*call_args)
    finally:
        for k in names:
            code_globals[k] = real[k]
    return result, _direct(calls, result, tokens, meta, cache_rows)


def _direct(calls: list, result, tokens: torch.Tensor, meta: torch.Tensor, cache_rows: int) -> DirectCall | None:
    if len(calls) != 1:
        return None
    graph_fn, args, out = calls[0]
    if not isinstance(out, (list, tuple)) or not out or out[0] is not result:
        return None
    tokens_at = [i for i, a in enumerate(args) if a is tokens]
    meta_at = [i for i, a in enumerate(args) if a is meta]
    if len(tokens_at) != 1 or len(meta_at) != 1:
        return None
    rows, rows_at = tokens.shape[2], []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            continue
        if type(a) is not int or (a == rows) == (a == cache_rows):  # neither count, or both: ambiguous
            return None
        if a == rows:
            rows_at.append(i)
    return DirectCall(graph_fn, args, tokens_at[0], meta_at[0], rows_at)
