"""End-to-end wall-clock: answering the same held-out problems with HF generate, sbd_ext NTP mode and SBD, eager and
compiled.

Reproduce: OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) pytest bench/bench_e2e.py --benchmark-only -s
(the fresh inductor cache makes the reported compile times cold ones; ~6 min on 2 cores, most of it compiling)
Workload: the first N_PROMPTS held-out arithmetic problems (:mod:`sbd_ext.demo.tasks`), answered one after the other at
batch 1 (latency, where SBD matters), greedy, max_new_tokens = 160, fp32, torch on 1 thread (the embedded models
have 0.8 M parameters: more threads only add synchronisation). One round = all prompts. Rows:

- ``hf_generate_ntp_control`` (baseline): ``model.generate`` greedy with its KV cache (DynamicCache, SDPA) on the
  NTP control model ``ntp-arith``;
- ``sbd_ext_ntp_mode`` (reference): :func:`sbd_ext.decoding.generate` with ``mode="ntp"`` on the same control
  model (one token per forward through SBDCache and the sbd_ext kernels);
- ``sbd_gamma_low`` / ``sbd_gamma_high`` (ours): SBD decoding of the SBD model ``sbd-arith`` with the block size,
  sampler and gamma_low / gamma_high of its ``sbd_demo.json``;
- ``sbd_other_sampler`` (ours): the same at gamma_low with the other entropy rule (the entropy threshold when the
  model's sampler is the paper's entropy-bounded one, and the reverse);
- ``sbd_verify`` (ours): lossless verify mode at gamma_low (the SBD model's own NTP output, checked block by block).
- ``*_compiled`` (ours): ``compile=True`` (the decode step under ``torch.compile``) for NTP mode and SBD at gamma_low
  and gamma_high; ``hf_generate_static_compiled`` (baseline): HF's own fast path, ``cache_implementation="static"``
  with its decode forward under ``torch.compile`` (fullgraph, default mode: there are no CUDA graphs on the CPU).
  Each compiled row's ``first_call_s`` is the wall-clock of its first generation (compile included).

Each row's extra_info holds tokens generated, tokens/s, mean NFE and accuracy; a summary at the end of the module
prints every row's tokens/s and how many times faster it answers than HF generate.

On a GPU (``bash bench/run_gpu.sh e2e-cuda``): ``SBD_BENCH_DEVICE=cuda`` runs every row with the models on the GPU
(fp32; sbd_ext's compiled rows are CUDA graphs, HF's static row its ``torch.compile``), each generation synchronised
before its time is taken; ``SBD_BENCH_N`` sets the number of problems (default 50). Without a GPU those rows skip.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from transformers import CompileConfig

from sbd_ext.demo import models, tasks
from sbd_ext.demo.evaluate import decode, format_prompt

N_PROMPTS = int(os.environ.get("SBD_BENCH_N", "50"))
MAX_NEW = 160
DEVICE = torch.device(os.environ.get("SBD_BENCH_DEVICE", "cpu"))
if DEVICE.type == "cuda":
    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="SBD_BENCH_DEVICE=cuda needs a GPU")
    _WHERE = f"CUDA {torch.cuda.get_device_name() if torch.cuda.is_available() else ''} fp32".replace("  ", " ")
else:
    _WHERE = "CPU fp32, 1 thread"
GROUP = f"e2e arith: {N_PROMPTS} held-out prompts, batch 1, greedy ({_WHERE})"
_results: dict[str, dict] = {}


def _sync():
    """A generation's time ends when the device is done with it."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
    _summary()


@pytest.fixture(scope="module")
def problems():
    return list(tasks.problems("test", N_PROMPTS))


@pytest.fixture(scope="module")
def control():
    return models.load(models.CONTROL_MODEL, device=DEVICE)  # attn_implementation="sbd", for sbd_ext's rows


@pytest.fixture(scope="module")
def control_sdpa():
    return models.load(models.CONTROL_MODEL, device=DEVICE, attn_implementation="sdpa")  # HF generate as users run it


@pytest.fixture(scope="module")
def sbd_model():
    return models.load(models.DEFAULT_MODEL, device=DEVICE)


def _prompts(name, probs):
    tmpl = models.demo_info(name).get("prompt_template")
    return [format_prompt(p.prompt, tmpl) for p in probs]


def _record(benchmark, name, role, completions, nfe, n_tokens, probs, first_call_s=None):
    med = benchmark.stats.stats.median
    info = {
        "first_call_s": first_call_s,
        "role": role,
        "tokens": n_tokens,
        "tokens_per_s": n_tokens / med,
        "mean_nfe": nfe / len(probs) if nfe else None,
        "accuracy": tasks.accuracy(completions, probs),
    }
    benchmark.extra_info.update(info)
    benchmark.extra_info["note"] = f"{info['tokens_per_s']:.0f} tok/s, acc {100 * info['accuracy']:.0f}%" + (
        f", NFE {info['mean_nfe']:.1f}" if nfe else ""
    )
    _results[name] = dict(info, median_s=med)
    print(f"\n[row] {name}: {med:.3f} s, {benchmark.extra_info['note']}", flush=True)  # kept if a run is cut short


def _summary():
    if "hf_generate_ntp_control" not in _results:
        return
    base = _results["hf_generate_ntp_control"]["median_s"]
    print(f"\n{GROUP}")
    print("| row | role | median s | tokens/s | mean NFE | accuracy % | × faster than HF generate | first call s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in _results.items():
        nfe = f"{r['mean_nfe']:.1f}" if r["mean_nfe"] else ""
        first = f"{r['first_call_s']:.1f}" if r["first_call_s"] else ""
        print(
            f"| {name} | {r['role']} | {r['median_s']:.2f} | {r['tokens_per_s']:.0f} | {nfe} | "
            f"{100 * r['accuracy']:.1f} | {base / r['median_s']:.2f} | {first} |"
        )
    for name, r in _results.items():
        eager = _results.get(name.removesuffix("_compiled"))
        if name.endswith("_compiled") and eager:
            print(f"{name}: {eager['median_s'] / r['median_s']:.2f}x faster than its eager row")


def _hf_run(model, tok, encs, **kw):
    def run():
        outs = []
        for enc in encs:
            g = model.generate(
                **enc,
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                **kw,
            )
            outs.append(g[0, enc.input_ids.shape[1] :])
        _sync()
        return outs

    return run


def _hf_row(benchmark, name, model, tok, problems, first_call=False, **kw):
    prompts = _prompts(models.CONTROL_MODEL, problems)
    encs = [tok(p, return_tensors="pt").to(DEVICE) for p in prompts]
    first = None
    if first_call:
        t0 = time.perf_counter()
        _hf_run(model, tok, encs[:1], **kw)()
        first = time.perf_counter() - t0
    benchmark.group = GROUP
    outs = benchmark.pedantic(_hf_run(model, tok, encs, **kw), rounds=3, warmup_rounds=1, iterations=1)
    completions = [tok.decode(o, skip_special_tokens=True) for o in outs]
    n_tokens = sum(len(o) for o in outs)
    _record(benchmark, name, "baseline", completions, 0, n_tokens, problems, first)


def test_hf_generate_ntp_control(benchmark, control_sdpa, problems):
    model, tok = control_sdpa
    _hf_row(benchmark, "hf_generate_ntp_control", model, tok, problems)


def test_hf_generate_static_compiled(benchmark, control_sdpa, problems):
    """HF's fast path: a static cache and the decode forward under torch.compile. transformers compiles only on
    accelerators by default; ``_compile_all_devices`` asks for it on the CPU too."""
    model, tok = control_sdpa
    cc = CompileConfig(fullgraph=True, mode="default")
    cc._compile_all_devices = True
    # One static cache size for every prompt (prompts are < 64 tokens): reused across calls, no recompilation.
    kw = dict(cache_implementation="static", max_cache_len=MAX_NEW + 64, compile_config=cc)
    _hf_row(benchmark, "hf_generate_static_compiled", model, tok, problems, first_call=True, **kw)


def _sbd_ext_row(benchmark, name, role, model, tok, prompts, problems, **kw):
    def run(ps=prompts):
        out = decode(model, tok, ps, batch_size=1, max_new_tokens=MAX_NEW, **kw)
        _sync()
        return out

    first = None
    if kw.get("compile"):
        t0 = time.perf_counter()
        run(prompts[:1])
        first = time.perf_counter() - t0
    benchmark.group = GROUP
    res = benchmark.pedantic(run, rounds=3, warmup_rounds=1, iterations=1)
    _record(benchmark, name, role, res["completions"], sum(res["nfe"]), sum(res["num_generated"]), problems, first)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sbd_ext_ntp_mode(benchmark, control, problems, compiled):
    model, tok = control
    _sbd_ext_row(
        benchmark,
        "sbd_ext_ntp_mode" + ("_compiled" if compiled else ""),
        "ours" if compiled else "reference",
        model,
        tok,
        _prompts(models.CONTROL_MODEL, problems),
        problems,
        mode="ntp",
        compile=compiled,
    )


@pytest.mark.parametrize(
    "which,compiled",
    [
        ("gamma_low", False),
        ("gamma_low", True),
        ("gamma_high", False),
        ("gamma_high", True),
        ("other_sampler", False),
        ("verify", False),
        ("verify", True),
    ],
    ids=[
        "gamma_low",
        "gamma_low-compiled",
        "gamma_high",
        "gamma_high-compiled",
        "other_sampler",
        "verify",
        "verify-compiled",
    ],
)
def test_sbd(benchmark, sbd_model, problems, which, compiled):
    model, tok = sbd_model
    info = models.demo_info(models.DEFAULT_MODEL)
    k = info.get("block_size", 16)
    if which == "other_sampler":  # the other entropy rule (eb <-> entropy threshold) at gamma_low, for comparison
        sampler = "entropy" if info.get("sampler", "eb") == "eb" else "eb"
        gamma = info.get("gamma_low", 0.1)
    else:
        key = "gamma_low" if which == "verify" else which
        sampler, gamma = info.get("sampler", "eb"), info.get(key, 0.1 if key == "gamma_low" else 0.35)
    _sbd_ext_row(
        benchmark,
        f"sbd_{which}" + ("_compiled" if compiled else ""),
        "ours",
        model,
        tok,
        _prompts(models.DEFAULT_MODEL, problems),
        problems,
        mode="sbd",
        block_size=k,
        sampler=sampler,
        threshold=gamma,
        verify=which == "verify",
        compile=compiled,
    )
    benchmark.extra_info["gamma"] = gamma
    benchmark.extra_info["block_size"] = k
    benchmark.extra_info["sampler"] = sampler
    benchmark.extra_info["compile"] = compiled
