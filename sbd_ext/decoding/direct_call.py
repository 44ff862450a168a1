"""Calling a compiled step's graph without dynamo's per-call layers (CPU).

Each call of a ``torch.compile``-d function goes through dynamo's frame evaluation (its guards, even under the
guard-skipping stance only those that tell the graphs apart) and the bytecode dynamo wrote for the frame, which
fetches every graph input -- ~550 weights for SmolLM2 -- from the model's attributes and then calls the compiled
graph (AOT autograd's runtime wrapper around inductor's code). Measured on SmolLM2-135M w8a8 (AMD EPYC Zen 4,
1 thread): 11.3 ms per NTP step through the compiled function, 8.7 ms calling the compiled graph with the same
inputs directly.

Within one generation nothing changes the model or the cache object between two steps (the assumption the
guard-skipping stance makes too), so the step captures the argument list that dynamo's bytecode built on a full
call, and later calls of the same shapes pass that list with this call's own tensors and dynamic size in it
(:class:`DirectCall`): the host step's tokens, plan and row count; the device cycle's row index (its state
tensors are the same objects every cycle). The capture is refused -- the caller keeps calling through dynamo --
unless every argument is accounted for: the compiled function ran exactly once, each swapped tensor sits at exactly
one place, every integer is either the dynamic size or one of the sizes the caller names as fixed (not both), and
the function returned the graph's first output itself (the cycle: nothing, and the graph returned nothing). AOT's
runtime wrapper and inductor's code run as before (input mutations, the cache's and the state's in-place writes).
"""

from __future__ import annotations

import torch

__all__ = ["DirectCall", "capture"]

PREFIX = "__compiled_fn"  # the globals dynamo installs for the compiled graphs of a frame's code


class DirectCall:
    """A captured call of a compiled graph: ``fn(*args)`` with the call's own tensors put in at ``swap_at`` and,
    where ``size_of`` = (i, dim), ``tensors[i].shape[dim]`` at ``size_at`` (a dynamic row count)."""

    def __init__(self, fn, args: list, swap_at: list[int], size_at: list[int], size_of, returns: bool):
        self.fn, self.args = fn, args
        self.swap_at, self.size_at, self.size_of, self.returns = swap_at, size_at, size_of, returns

    def __call__(self, *tensors: torch.Tensor):
        args = list(self.args)
        for i, t in zip(self.swap_at, tensors, strict=True):
            args[i] = t
        if self.size_of is not None:
            n = tensors[self.size_of[0]].shape[self.size_of[1]]
            for i in self.size_at:
                args[i] = n
        out = self.fn(*args)
        return out[0] if self.returns else None


def capture(fn, code_globals: dict, call_args: tuple, swap: tuple, size_of=None, constants=(), returns=True):
    """Run ``fn(*call_args)`` (a compiled function whose frame's globals are ``code_globals``) and return its result
    and a :class:`DirectCall` of the compiled graph it ran, or None where the call cannot be replayed safely (see the
    module docstring). ``swap``: the tensors that change from call to call (each must be exactly one graph input);
    ``size_of`` = (i, dim): ``swap[i].shape[dim]`` is a dynamic size, replaced where it is an integer input;
    ``constants``: the other integers the graph may take (sizes fixed within a generation); ``returns``: the
    function returns the graph's first output (else None, and the graph must return nothing else)."""
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
    return result, _direct(calls, result, swap, size_of, set(constants), returns)


def _direct(calls: list, result, swap: tuple, size_of, constants: set, returns: bool) -> DirectCall | None:
    if len(calls) != 1:
        return None
    graph_fn, args, out = calls[0]
    if not isinstance(out, (list, tuple)):
        return None
    if returns and (not out or out[0] is not result):
        return None
    if not returns and (result is not None or len(out) != 0):  # outputs dynamo's code would use afterwards
        return None
    swap_at = []
    for t in swap:
        at = [i for i, a in enumerate(args) if a is t]
        if len(at) != 1:
            return None
        swap_at.append(at[0])
    size = None if size_of is None else swap[size_of[0]].shape[size_of[1]]
    size_at = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            continue
        if type(a) is not int or (a == size) == (a in constants):  # neither known, or both: ambiguous
            return None
        if a == size:
            size_at.append(i)
    return DirectCall(graph_fn, args, swap_at, size_at, size_of, returns)
