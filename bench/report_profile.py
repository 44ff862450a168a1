"""The standard set's ``profile`` suite (``bench/report.py --suites profile``): where a one-row compiled NTP forward's
time goes on this CPU, per weight scheme, against the core's plain read rate (issue 63).

For SmolLM2-135M-Instruct (as the chat suite loads it, with its drafter attached and idle) in packed fp32, bf16 and
w8a8, decoding held-out chat prompts with compiled NTP (the host loop), per forward:

- ``weights_mb``: the bytes a one-row forward streams (every linear's weight buffers and the head's);
  ``read_gbs``: a plain read of that many bytes on one core (``torch.sum`` over a buffer of that size, the best of a
  few rounds): the copy rate the issue measures against;
- ``linears_ms``: the linears and the head at one row (the self time of their ``sbd_ext`` ops under
  ``torch.profiler``, the prompt's prefill left out by shape), with ``linears_vs_read`` = the plain read's time for
  the same bytes over it (1.0: at the read rate);
- ``attention_ms``: ``block_attention`` at one row, likewise;
- ``step_ms``: the compiled step (the graph and its call), timed around it without the profiler;
  ``fixed_ms`` = step - linears - attention: the compiled step's cost beyond its kernels (norms, rotary and
  residuals in inductor's code, the ~240 op calls, the graph's inputs; the issue's bar is 1 ms);
- ``forward_ms``: the whole decoding loop per forward (the step, the host's reveal, the prompt's eager prefill
  amortised over the answer).
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

import sbd_ext
from sbd_ext.decoding import compiled as compiled_step
from sbd_ext.decoding.step import EagerStep
from sbd_ext.demo import models
from sbd_ext.quantization import Int8Linear, PackedLinear
from sbd_ext.recipes.drafter.prompts import eval_prompts
from sbd_ext.recipes.smollm2 import checkpoint

LINEAR_OPS = ("sbd_ext::row_linear", "sbd_ext::gated_lora_linear")
ATTENTION_OPS = ("sbd_ext::block_attention",)


def weight_bytes(model) -> int:
    """The bytes of every quantized / packed linear's stored tensors: the base's weights a one-row forward streams (an
    adapter's factors not counted: ~3 % more where an idle drafter's projections run over [W; A]; the embedding a
    tied head shares not counted: the lookup reads one row of it)."""
    emb = model.get_input_embeddings().weight.data_ptr()
    n = 0
    for m in model.modules():
        if isinstance(m, (Int8Linear, PackedLinear)):
            ts = (*m._buffers.values(), *m._parameters.values())
            n += sum(t.nbytes for t in ts if t is not None and t.data_ptr() != emb)
    return n


def read_rate(nbytes: int, rounds: int) -> float:
    """GB/s of a plain one-core read of ``nbytes`` (a float32 sum over a buffer of that size, the best round)."""
    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / 1e9


def _rows(name: str, shape: list[int]) -> int:
    """The new rows of one op call from its first input's shape: x [..., K] of a linear, q [B, H, T, D] of attention."""
    if name in ATTENTION_OPS:
        return shape[0] * shape[2] if len(shape) == 4 else -1
    n = 1
    for d in shape[:-1]:
        n *= d
    return n


def _op_ms(prof, names: tuple[str, ...]) -> float:
    """Self CPU ms of the one-row calls of ops ``names`` (the prompt's prefill has more rows)."""
    us = 0.0
    for ev in prof.key_averages(group_by_input_shape=True):
        shapes = getattr(ev, "input_shapes", None) or []
        if ev.key in names and shapes and shapes[0] and _rows(ev.key, list(shapes[0])) == 1:
            us += ev.self_cpu_time_total
    return us / 1e3


def suite_profile(device: torch.device, n: int, max_new: int, compiled: bool = True) -> dict:
    if device.type != "cpu":
        raise ValueError("the profile suite is the CPU's (on a GPU the roofline stage measures the forward)")
    tok = checkpoint.load_smollm2(attn_implementation="sdpa")[1]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [torch.tensor([checkpoint.chat_prompt(tok, p["text"])]) for p in eval_prompts()[:n]]
    rows = []
    for scheme in ("packed", "bf16", "w8a8") if compiled else ("packed",):
        model, _ = models.load("smollm2-drafter", quantize=scheme)
        kw = dict(max_new_tokens=max_new, eos_token_id=eos, compile=compiled, mode="ntp", verify=False)
        for p in prompts:  # warm: compiles (or loads) the step's graph
            sbd_ext.generate(model, p, **kw)
        step_cls = compiled_step.StaticStep if compiled else EagerStep
        acc = {"step": 0.0}
        real = step_cls.__call__

        def timed(self, fw, _real=real, _acc=acc):
            t0 = time.perf_counter()
            out = _real(self, fw)
            _acc["step"] += time.perf_counter() - t0
            return out

        step_cls.__call__ = timed
        try:
            wall, forwards, decode = 0.0, 0, 0  # every forward, and those after the prompt's (the step's)
            for p in prompts:
                t0 = time.perf_counter()
                res = sbd_ext.generate(model, p, **kw)
                wall += time.perf_counter() - t0
                forwards += int(res.nfe.sum())
                decode += int(res.nfe.sum()) - 1
        finally:
            step_cls.__call__ = real
        prof_forwards = 0
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for p in prompts:
                prof_forwards += int(sbd_ext.generate(model, p, **kw).nfe.sum()) - 1
        nbytes = weight_bytes(model)
        linears = _op_ms(prof, LINEAR_OPS) / prof_forwards
        attention = _op_ms(prof, ATTENTION_OPS) / prof_forwards
        step = 1e3 * acc["step"] / decode
        gbs = read_rate(nbytes, 5)
        rows.append(
            {
                "scheme": scheme,
                "weights_mb": round(nbytes / 1e6, 1),
                "read_gbs": round(gbs, 2),
                "linears_ms": round(linears, 3),
                "linears_vs_read": round(nbytes / gbs / 1e6 / linears, 3) if linears > 0 else None,
                "attention_ms": round(attention, 3),
                "step_ms": round(step, 3),
                "fixed_ms": round(step - linears - attention, 3),
                "forward_ms": round(1e3 * wall / forwards, 3),
            }
        )
        del model
    mode = "compiled" if compiled else "eager (a dry run)"
    return {
        "what": f"SmolLM2-135M-Instruct, NTP {mode}, host loop, {n} held-out chat prompts x {max_new}, per forward; "
        "linears / attention: their ops' one-row self time under torch.profiler",
        "rows": rows,
    }


__all__ = ["suite_profile", "weight_bytes", "read_rate"]
