"""``transformers serve`` decodes an SBD checkpoint with SBD (issue 25, item 4): a real server in a subprocess on
127.0.0.1 (a free port, a bounded wait, always stopped), OpenAI-client requests, answers checked against
:func:`sbd_ext.generate` on the same model and prompt. Needs the serving extra (``pip install ".[serve]"``; the
test extra includes it)."""

import json

import openai
import pytest
import torch
from sbd_models import one_thread

import sbd_ext
from sbd_ext.demo import export, models, tasks
from sbd_ext.integration.server import TransformersServer

pytestmark = pytest.mark.slow

N_PROMPTS = 3
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return export.export(models.DEFAULT_MODEL, tmp_path_factory.mktemp("served") / "sbd-arith")


@pytest.fixture(scope="module")
def server(checkpoint):
    with TransformersServer(checkpoint, trust_remote_code=True) as srv:
        yield srv


@pytest.fixture
def client(server):
    """A new client per test: a refused request (HTTP 500) resets its connection, which a shared client reuses."""
    return server.client(), server.model


@pytest.fixture(scope="module")
def local(checkpoint):
    """The same checkpoint in this process, as transformers loads it (its generation config, its chat template)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with one_thread():
        model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sbd").eval()
        tok = AutoTokenizer.from_pretrained(checkpoint)
        yield model, tok


def _questions(n=N_PROMPTS):
    return [p.message for p in tasks.problems("test", n=n)]


def _expected(local, question, max_new_tokens=MAX_TOKENS, **settings):
    """sbd_ext.generate on the chat-formatted prompt: (text, number of generated tokens)."""
    model, tok = local
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )["input_ids"]
    out = sbd_ext.generate(model, ids, max_new_tokens=max_new_tokens, return_trace=False, **settings)
    n = int(out.num_generated[0])
    p = int(out.prompt_lengths[0])
    gen = out.sequences[0, p : p + n]
    return tok.decode(gen, skip_special_tokens=True), n


def _ask(client, question, **kwargs):
    """One chat completion; ``client`` is (an OpenAI client, the served model's name)."""
    api, model = client
    return api.chat.completions.create(model=model, messages=[{"role": "user", "content": question}], **kwargs)


def test_export_carries_sbd_settings_and_chat_template(checkpoint, local):
    model, tok = local
    gc = json.loads((checkpoint / "generation_config.json").read_text())
    info = models.demo_info(models.DEFAULT_MODEL)
    assert gc["sbd_block_size"] == info["block_size"] and gc["sbd_threshold"] == info["gamma_low"]
    assert (checkpoint / "custom_generate" / "generate.py").is_file()
    q = _questions(1)[0]
    msgs = [{"role": "user", "content": q}]
    chat = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert list(chat["input_ids"]) == tok(f"Q: {q}\nA: ")["input_ids"]  # the model's own prompt, BOS included
    with pytest.raises(Exception, match="user and assistant turns only"):
        tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": q}])


def test_chat_completion_equals_sbd_generate(client, local):
    for q in _questions():
        want, n = _expected(local, q)  # the checkpoint's recommended settings (generation_config.json)
        r = _ask(client, q, max_tokens=MAX_TOKENS)
        assert r.choices[0].message.content == want
        assert r.usage.completion_tokens == n
        assert r.choices[0].finish_reason == "stop"


def test_streamed_chat_completion_equals_sbd_generate(client, local):
    q = _questions(1)[0]
    want, _ = _expected(local, q)
    pieces = []
    stream = _ask(client, q, max_tokens=MAX_TOKENS, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == want
    assert len(pieces) > 1  # streamed as tokens become final, not in one piece at the end


@pytest.mark.parametrize(
    "config, settings",
    [
        ({"sbd_block_size": 4, "sbd_threshold": 0.35}, {"block_size": 4, "threshold": 0.35}),
        ({"sbd_sampler": "entropy", "sbd_threshold": 0.5}, {"sampler": "entropy", "threshold": 0.5}),
        ({"sbd_verify": True}, {"verify": True}),
        ({"sbd_mode": "ntp"}, {"mode": "ntp"}),
    ],
)
def test_per_request_sbd_settings(client, local, config, settings):
    """SBD settings per request, through the request's generation config (over the checkpoint's own)."""
    q = _questions(2)[1]
    want, n = _expected(local, q, **settings)
    r = _ask(client, q, max_tokens=MAX_TOKENS, extra_body={"generation_config": json.dumps(config)})
    assert r.choices[0].message.content == want and r.usage.completion_tokens == n


def test_sampled_request_follows_the_seed(client, local):
    """temperature > 0 samples (HF's meaning); the request's seed seeds torch, which seeds SBD's Philox stream."""
    q = _questions(1)[0]
    torch.manual_seed(11)
    seed = int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64))
    want, _ = _expected(local, q, temperature=0.9, seed=seed)
    r = _ask(client, q, max_tokens=MAX_TOKENS, temperature=0.9, seed=11)
    assert r.choices[0].message.content == want


def test_no_max_tokens_is_cut_to_the_model_positions(client, local):
    """The server asks for 1024 new tokens by default, past this model's 512 positions: cut to fit, not an error."""
    model, tok = local
    q = _questions(1)[0]
    prompt_len = len(tok(f"Q: {q}\nA: ")["input_ids"])
    want, _ = _expected(local, q, max_new_tokens=model.config.max_position_embeddings - prompt_len)
    assert _ask(client, q).choices[0].message.content == want


def test_unsupported_request_is_refused(client, server):
    """Stop strings are one of the generation options SBD refuses: an error, never an answer that ignores them."""
    with pytest.raises(openai.APIStatusError):
        _ask(client, _questions(1)[0], max_tokens=MAX_TOKENS, stop=["pens"])
    assert server.wait_for_log("does not support generation_config.stop_strings")


def test_continuous_batching_is_refused(checkpoint, local):
    """transformers' continuous batching bypasses model.generate: on an SBD checkpoint it is refused, in process
    and through the server, instead of decoding next-token silently."""
    from transformers import AutoModelForCausalLM

    sbd_model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)
    with pytest.raises(ValueError, match="continuous batching cannot run"):
        sbd_model.init_continuous_batching()
    with TransformersServer(checkpoint, trust_remote_code=True, extra_args=["--continuous-batching"]) as srv:
        with pytest.raises(openai.APIStatusError):
            _ask((srv.client(), srv.model), _questions(1)[0], max_tokens=MAX_TOKENS)
        assert srv.wait_for_log("continuous batching cannot run")


# --- issue 35 -------------------------------------------------------------------------------------------------------


def _stream(client, question, **kwargs):
    """A streamed chat completion: (content pieces, the last finish_reason seen)."""
    pieces, finish = [], None
    for chunk in _ask(client, question, stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return pieces, finish


@pytest.mark.parametrize(
    "config, reason",
    [
        ({"sbd_block_size": 64}, "outside the block sizes the model was trained with"),
        ({"sbd_sampler": "nope"}, "sbd_sampler='nope'"),
    ],
)
def test_streamed_refusal_is_an_error_event_and_logged(client, server, local, config, reason):
    """Issue 35 item 1: a streamed request that SBD refuses was HTTP 200, empty content, finish_reason "stop" and
    nothing logged (the streamer's end() came before serve's error). Now the stream carries the error and the log has
    the reason, as for the non-streamed request (a 500)."""
    q = _questions(1)[0]
    body = {"generation_config": json.dumps(config)}
    logged = server.log_text.count(reason)
    with pytest.raises(openai.APIError) as err:
        _stream(client, q, max_tokens=MAX_TOKENS, extra_body=body)
    assert reason in str(err.value.body)
    assert server.wait_for_log(reason) and server.log_text.count(reason) > logged, server.log_text[-3000:]
    with pytest.raises(openai.APIStatusError):  # non-streamed: a 500, as before
        _ask((server.client(), server.model), q, max_tokens=MAX_TOKENS, extra_body=body)
    # The server still answers afterwards.
    want, _ = _expected(local, q)
    assert "".join(_stream((server.client(), server.model), q, max_tokens=MAX_TOKENS)[0]) == want


@pytest.mark.parametrize("temperature", [1.0, 5.0, 100.0])
@pytest.mark.parametrize("stream", [False, True])
def test_request_temperature_samples_with_the_seed(client, local, temperature, stream):
    """Issue 35 item 3: a request's temperature > 0 samples (the README's promise), seeded by the request's seed:
    equal to sbd_ext.generate sampling at that temperature with the seed torch.manual_seed(seed) gives; not the
    greedy answer (which was returned for every temperature)."""
    q = _questions(1)[0]
    greedy, _ = _expected(local, q)
    torch.manual_seed(11)
    seed = int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64))
    want, _ = _expected(local, q, temperature=temperature, seed=seed)
    if stream:
        got = "".join(_stream(client, q, max_tokens=MAX_TOKENS, temperature=temperature, seed=11)[0])
    else:
        got = _ask(client, q, max_tokens=MAX_TOKENS, temperature=temperature, seed=11).choices[0].message.content
    assert got == want
    if temperature > 1.0:
        assert got != greedy
    # temperature 0 is greedy, as before
    assert _ask(client, q, max_tokens=MAX_TOKENS, temperature=0.0, seed=11).choices[0].message.content == greedy


def _final_runs(model, ids):
    runs = []
    sbd_ext.generate(model, ids, max_new_tokens=MAX_TOKENS, on_final_tokens=lambda b, t: runs.append(list(t)))
    return runs


def test_stream_is_one_chunk_per_token(client, local):
    """Issue 35 item 18: serve's streamer sends one chunk per token (not one per final run, as the README said)."""
    from pathlib import Path

    q = _questions(1)[0]
    want, n = _expected(local, q)
    pieces, finish = _stream(client, q, max_tokens=MAX_TOKENS)
    assert "".join(pieces) == want and finish == "stop"
    model, tok = local
    ids = tok.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )["input_ids"]
    out = sbd_ext.generate(model, ids, max_new_tokens=MAX_TOKENS, return_trace=False)
    gen = out.sequences[0, ids.shape[1] : ids.shape[1] + int(out.num_generated[0])].tolist()
    visible = [t for t in gen if t not in tok.all_special_ids]
    assert len(pieces) == len(visible) > 1  # one chunk per token (the EOS ends the stream)
    assert max(len(o) for o in _final_runs(model, ids)) > 1  # though SBD finalises several tokens at once
    readme = (Path(__file__).resolve().parents[2] / "docs" / "transformers.md").read_text()  # the manual
    assert "each newly final run of tokens becomes a chunk" not in readme
    assert "one chunk per token" in readme


def test_unknown_sbd_field_in_a_request_is_refused(client, server):
    """Issue 35 item 6: a misspelt sbd_* field in a request's generation_config was ignored (the answer used the
    checkpoint's setting); now the request is refused and the log names the field."""
    with pytest.raises(openai.APIStatusError):
        _ask(client, _questions(1)[0], max_tokens=8, extra_body={"generation_config": '{"sbd_verfy": true}'})
    assert server.wait_for_log("unknown SBD field(s) ['sbd_verfy']")
