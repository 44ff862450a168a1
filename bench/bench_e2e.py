"""End-to-end wall-clock: answering the same held-out problems with HF generate, sbd_ext NTP mode and SBD.

Reproduce: pytest bench/bench_e2e.py --benchmark-only -s
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

Each row's extra_info holds tokens generated, tokens/s, mean NFE and accuracy; a summary at the end of the module
prints every row's tokens/s and how many times faster it answers than HF generate.
"""

from __future__ import annotations

import pytest
import torch

from sbd_ext.demo import models, tasks
from sbd_ext.demo.evaluate import decode, format_prompt

N_PROMPTS = 50
MAX_NEW = 160
GROUP = f"e2e arith: {N_PROMPTS} held-out prompts, batch 1, greedy (CPU fp32, 1 thread)"
_results: dict[str, dict] = {}


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
    return models.load(models.CONTROL_MODEL)  # attn_implementation="sbd", for sbd_ext's rows


@pytest.fixture(scope="module")
def control_sdpa():
    return models.load(models.CONTROL_MODEL, attn_implementation="sdpa")  # HF generate as users run it


@pytest.fixture(scope="module")
def sbd_model():
    return models.load(models.DEFAULT_MODEL)


def _prompts(name, probs):
    tmpl = models.demo_info(name).get("prompt_template")
    return [format_prompt(p.prompt, tmpl) for p in probs]


def _record(benchmark, name, role, completions, nfe, n_tokens, probs):
    med = benchmark.stats.stats.median
    info = {
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


def _summary():
    if "hf_generate_ntp_control" not in _results:
        return
    base = _results["hf_generate_ntp_control"]["median_s"]
    print(f"\n{GROUP}")
    print("| row | role | median s | tokens/s | mean NFE | accuracy % | × faster than HF generate |")
    print("|---|---|---|---|---|---|---|")
    for name, r in _results.items():
        nfe = f"{r['mean_nfe']:.1f}" if r["mean_nfe"] else ""
        print(
            f"| {name} | {r['role']} | {r['median_s']:.2f} | {r['tokens_per_s']:.0f} | {nfe} | "
            f"{100 * r['accuracy']:.1f} | {base / r['median_s']:.2f} |"
        )


def test_hf_generate_ntp_control(benchmark, control_sdpa, problems):
    model, tok = control_sdpa
    prompts = _prompts(models.CONTROL_MODEL, problems)
    encs = [tok(p, return_tensors="pt") for p in prompts]

    def run():
        outs = []
        for enc in encs:
            g = model.generate(
                **enc,
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            outs.append(g[0, enc.input_ids.shape[1] :])
        return outs

    benchmark.group = GROUP
    outs = benchmark.pedantic(run, rounds=3, warmup_rounds=1, iterations=1)
    completions = [tok.decode(o, skip_special_tokens=True) for o in outs]
    n_tokens = sum(len(o) for o in outs)
    _record(benchmark, "hf_generate_ntp_control", "baseline", completions, 0, n_tokens, problems)


def _sbd_ext_row(benchmark, name, role, model, tok, prompts, problems, **kw):
    def run():
        return decode(model, tok, prompts, batch_size=1, max_new_tokens=MAX_NEW, **kw)

    benchmark.group = GROUP
    res = benchmark.pedantic(run, rounds=3, warmup_rounds=1, iterations=1)
    _record(benchmark, name, role, res["completions"], sum(res["nfe"]), sum(res["num_generated"]), problems)


def test_sbd_ext_ntp_mode(benchmark, control, problems):
    model, tok = control
    _sbd_ext_row(
        benchmark,
        "sbd_ext_ntp_mode",
        "reference",
        model,
        tok,
        _prompts(models.CONTROL_MODEL, problems),
        problems,
        mode="ntp",
    )


@pytest.mark.parametrize("which", ["gamma_low", "gamma_high", "other_sampler", "verify"])
def test_sbd(benchmark, sbd_model, problems, which):
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
        f"sbd_{which}",
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
    )
    benchmark.extra_info["gamma"] = gamma
    benchmark.extra_info["block_size"] = k
    benchmark.extra_info["sampler"] = sampler
