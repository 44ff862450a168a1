"""SBD inside vLLM (issue 37): ``vllm serve`` of an exported checkpoint (``sbd-ext export --model smollm2-drafter``)
with :class:`sbd_ext.integration.vllm.SBDProposer` as its speculative proposer, on vLLM's CPU build, no patch of
vLLM. Real servers in subprocesses on 127.0.0.1 (free ports, bounded waits, always stopped), chat requests on the
held-out general prompts; the answers must equal vLLM's own greedy decoding without the proposer (speculative decoding
is lossless) and :func:`sbd_ext.generate` on the same checkpoint; the proposer must have drafted and vLLM accepted
some of its drafts. Runs in the vLLM venv (tools/vllm_env.sh --test; CI's vLLM step)."""

import json
import sys
import urllib.request

import pytest
import torch

import sbd_ext
from sbd_ext.demo import export
from sbd_ext.integration.server import VLLMServer
from sbd_ext.integration.vllm import STATS_ENV, load_drafting_model
from sbd_ext.recipes.drafter.prompts import eval_prompts
from sbd_ext.recipes.smollm2 import checkpoint as smollm2

pytestmark = pytest.mark.slow

N_PROMPTS = 3
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    if not smollm2.is_available():
        pytest.fail(f"the SmolLM2 base is needed: {smollm2.INSTALL_HINT}")
    return export.export("smollm2-drafter", tmp_path_factory.mktemp("vllm") / "smollm2-drafter")


def _questions():
    return [p["text"] for p in eval_prompts()[:N_PROMPTS]]


def _chat(server, question: str) -> str:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0.0,
        "max_tokens": MAX_TOKENS,
    }
    req = urllib.request.Request(
        f"{server.base_url}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def plain_answers(exported):
    """vLLM's own greedy answers, no proposer."""
    with VLLMServer(exported) as server:
        return [_chat(server, q) for q in _questions()]


@pytest.fixture(scope="module")
def sbd_served(exported, tmp_path_factory):
    """The answers through vLLM with the SBD proposer, the proposer's counters and vLLM's acceptance counters."""
    stats = tmp_path_factory.mktemp("stats") / "proposer.json"
    server = VLLMServer(exported, env={STATS_ENV: str(stats)})
    # The documented command: sbd-ext serve DIR -k 4 -- <vllm serve options> (it adds the proposer).
    vllm_args = server.command[server.command.index("--dtype") :]
    launch = [sys.executable, "-m", "sbd_ext.demo.cli", "serve", server.model, "-k", "4"]
    server.command = [*launch, "--port", str(server.port), "--", *vllm_args]
    with server:
        answers = [_chat(server, q) for q in _questions()]
        counters = server.spec_decode_counters()
        accepted, drafted = counters["num_accepted_tokens"], counters["num_draft_tokens"]
    return answers, json.loads(stats.read_text()), accepted, drafted


def test_sbd_proposer_output_equals_vllm_greedy(plain_answers, sbd_served):
    answers = sbd_served[0]
    assert all(a.strip() for a in answers)
    assert answers == plain_answers


def test_sbd_proposer_drafts_and_vllm_accepts(sbd_served):
    _, stats, accepted, drafted = sbd_served
    assert stats["gated"] is True and stats["k"] == 4
    assert stats["drafts"] >= N_PROMPTS and stats["forwards"] >= stats["drafts"]
    assert drafted >= 4 * N_PROMPTS
    assert 0 < accepted <= drafted


def test_vllm_answers_equal_sbd_generate(exported, sbd_served):
    """The same checkpoint through sbd_ext (verify mode with its drafter: the base's greedy decoding)."""
    model, _ = load_drafting_model(exported)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exported)
    eos = tok.eos_token_id
    for question, served in zip(_questions(), sbd_served[0], strict=True):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        out = sbd_ext.generate(
            model, ids, attention_mask=torch.ones_like(ids), verify=True, max_new_tokens=MAX_TOKENS, eos_token_id=eos
        )
        text = tok.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True)
        assert text == served, question
