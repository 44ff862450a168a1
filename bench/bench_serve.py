"""Through ``transformers serve`` (a real HTTP server on 127.0.0.1, OpenAI chat completions, streamed): how long a
client waits for the whole answer and for its first token, SBD vs next-token decoding.

Reproduce: pytest bench/bench_serve.py --benchmark-only -s   (~2-3 min on 2 cores; needs ``pip install ".[serve]"``)
Workload: the first N_REQUESTS held-out arithmetic problems (:mod:`sbd_ext.demo.tasks`) as chat messages, sent one
at a time (each waits for the previous answer), greedy, ``max_tokens`` = 160, streamed; the servers run fp32 on one
thread (``OMP_NUM_THREADS=1``), the client is this process. One round = all requests. Rows:

- ``ntp_control_served_plainly`` (baseline): the NTP control ``ntp-arith`` exported with ``sbd-ext export --plain``
  and served as transformers serves any model (``model.generate``, DynamicCache, SDPA);
- ``sbd_checkpoint_ntp_mode`` (reference): the SBD checkpoint (``sbd-ext export``, served with
  ``--trust-remote-code``) asked for next-token decoding per request (generation config ``{"sbd_mode": "ntp"}``);
- ``sbd`` (ours): the SBD checkpoint with its recommended settings (its ``generation_config.json``: k = 8, EB,
  gamma_low); ``sbd_verify`` (ours): the same in lossless verify mode; ``sbd_compiled`` (ours): ``sbd_compile``
  per request (the decode step under ``torch.compile``; ``first_call_s`` is its first, compiling request).

Per row, extra_info holds the median time to the full answer and to the first streamed token per request, the
tokens generated, and the accuracy of the answers; the summary at the end prints how many times sooner each row
answers than the plainly served NTP control.
"""

from __future__ import annotations

import json
import statistics
import time

import pytest

from sbd_ext.demo import export, models, tasks
from sbd_ext.integration.server import TransformersServer

N_REQUESTS = 20
MAX_TOKENS = 160
GROUP = f"transformers serve, arith: {N_REQUESTS} held-out requests one at a time, streamed (CPU fp32, 1 thread)"
BASELINE = "ntp_control_served_plainly"
_results: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    _summary()


@pytest.fixture(scope="module")
def problems():
    return list(tasks.problems("test", N_REQUESTS))


@pytest.fixture(scope="module")
def sbd_server(tmp_path_factory):
    folder = export.export(models.DEFAULT_MODEL, tmp_path_factory.mktemp("serve") / "sbd-arith")
    with TransformersServer(folder, trust_remote_code=True, threads=1) as srv:
        yield srv


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    folder = export.export(models.CONTROL_MODEL, tmp_path_factory.mktemp("serve") / "ntp-arith", plain=True)
    with TransformersServer(folder, threads=1) as srv:
        yield srv


def _ask_streamed(client, model, question, extra_body):
    """(answer text, seconds to the first content token, seconds to the end of the stream)."""
    t0 = time.perf_counter()
    first, pieces = None, []
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body=extra_body,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            pieces.append(chunk.choices[0].delta.content)
    return "".join(pieces), first, time.perf_counter() - t0


def _row(benchmark, name, role, server, problems, config=None, warm_up=False):
    client = server.client()
    extra = {"generation_config": json.dumps(config)} if config else None
    questions = [p.message for p in problems]
    first_call = None
    if warm_up:
        t0 = time.perf_counter()
        _ask_streamed(client, server.model, questions[0], extra)
        first_call = time.perf_counter() - t0
    rounds = []

    def run():
        rounds.append([_ask_streamed(client, server.model, q, extra) for q in questions])

    benchmark.group = GROUP
    benchmark.pedantic(run, rounds=3, warmup_rounds=1, iterations=1)
    answers = [a for a, _, _ in rounds[-1]]
    per_request = [r for rnd in rounds[1:] for r in rnd]  # the measured rounds
    info = {
        "role": role,
        "median_full_s": statistics.median(t for _, _, t in per_request),
        "median_first_token_s": statistics.median(f for _, f, _ in per_request if f is not None),
        "accuracy": tasks.accuracy(answers, problems),
        "first_call_s": first_call,
    }
    benchmark.extra_info.update(info)
    _results[name] = dict(info, median_s=benchmark.stats.stats.median)


def test_ntp_control_served_plainly(benchmark, plain_server, problems):
    _row(benchmark, BASELINE, "baseline", plain_server, problems)


def test_sbd_checkpoint_ntp_mode(benchmark, sbd_server, problems):
    _row(benchmark, "sbd_checkpoint_ntp_mode", "reference", sbd_server, problems, {"sbd_mode": "ntp"})


def test_sbd(benchmark, sbd_server, problems):
    _row(benchmark, "sbd", "ours", sbd_server, problems)


def test_sbd_verify(benchmark, sbd_server, problems):
    _row(benchmark, "sbd_verify", "ours", sbd_server, problems, {"sbd_verify": True})


def test_sbd_compiled(benchmark, sbd_server, problems):
    _row(benchmark, "sbd_compiled", "ours", sbd_server, problems, {"sbd_compile": True}, warm_up=True)


def _summary():
    if BASELINE not in _results:
        return
    base = _results[BASELINE]
    print(f"\n{GROUP}")
    print(
        "| row | role | round s (median) | full answer s / request | first token s / request | accuracy % "
        "| × sooner: full answer | × sooner: first token | first call s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in _results.items():
        first = f"{r['first_call_s']:.1f}" if r["first_call_s"] else ""
        print(
            f"| {name} | {r['role']} | {r['median_s']:.2f} | {r['median_full_s']:.3f} | "
            f"{r['median_first_token_s']:.3f} | {100 * r['accuracy']:.0f} | "
            f"{base['median_s'] / r['median_s']:.2f} | {base['median_first_token_s'] / r['median_first_token_s']:.2f} "
            f"| {first} |"
        )
