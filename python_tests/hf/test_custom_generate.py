"""transformers' own entry points decode with SBD (issue 25, items 1-3): ``model.generate`` through the
``custom_generate`` folder shipped in the package and through a checkpoint saved with it, the ``sbd_*`` fields of
the generation config, streamers, ``pipeline("text-generation")``; all equal to :func:`sbd_ext.generate`."""

import threading
import time

import pytest
import torch
from sbd_models import one_thread
from transformers import AutoModelForCausalLM, GenerationConfig, TextIteratorStreamer, TextStreamer, pipeline

import sbd_ext
from sbd_ext.demo import models, tasks
from sbd_ext.demo.evaluate import format_prompt
from sbd_ext.integration import CUSTOM_GENERATE_DIR, SBDGenerateDecoderOnlyOutput, save_pretrained

CG = str(CUSTOM_GENERATE_DIR)


@pytest.fixture(scope="module")
def demo():
    with one_thread():
        model, tok = models.load_default()
        tok.padding_side = "left"
        yield model, tok


def _prompts(tok, n):
    info = models.demo_info()
    return [format_prompt(p.prompt, info.get("prompt_template")) for p in tasks.problems("test", n=n)]


@pytest.fixture(scope="module")
def batch(demo):
    model, tok = demo
    return tok(_prompts(tok, 3), return_tensors="pt", padding=True)


@pytest.fixture(scope="module")
def checkpoint(demo, tmp_path_factory):
    model, tok = demo
    folder = tmp_path_factory.mktemp("sbd_ckpt")
    model.generation_config.sbd_block_size = 8
    model.generation_config.sbd_threshold = 0.1
    try:
        save_pretrained(model, folder)
    finally:
        del model.generation_config.sbd_block_size, model.generation_config.sbd_threshold
    tok.save_pretrained(folder)
    return folder


def _generated(ids, out_ref, b, prompt_width):
    """Row b's generated tokens in an HF output (the inputs' width first) and in sbd_ext.generate's output."""
    p, n = int(out_ref.prompt_lengths[b]), int(out_ref.num_generated[b])
    return ids[b, prompt_width : prompt_width + n].tolist(), out_ref.sequences[b, p : p + n].tolist()


@pytest.mark.parametrize(
    "hf_kwargs, sbd_kwargs",
    [
        ({}, {}),  # greedy, the defaults
        ({"sbd_block_size": 8, "sbd_threshold": 0.1}, {"block_size": 8, "threshold": 0.1}),
        ({"sbd_verify": True, "sbd_block_size": 8}, {"verify": True, "block_size": 8}),
        ({"sbd_sampler": "entropy", "sbd_block_size": 4}, {"sampler": "entropy", "block_size": 4}),
        ({"do_sample": True, "temperature": 0.8, "sbd_seed": 7}, {"temperature": 0.8, "seed": 7}),
        ({"sbd_mode": "ntp"}, {"mode": "ntp"}),
    ],
)
def test_model_generate_equals_sbd_generate(demo, batch, hf_kwargs, sbd_kwargs):
    model, tok = demo
    out = model.generate(**batch, custom_generate=CG, trust_remote_code=True, max_new_tokens=48, **hf_kwargs)
    ref = sbd_ext.generate(model, batch["input_ids"], batch["attention_mask"], max_new_tokens=48, **sbd_kwargs)
    width = batch["input_ids"].shape[1]
    assert isinstance(out, torch.Tensor) and out.dtype == torch.long
    assert torch.equal(out[:, :width], batch["input_ids"])  # the prompt as given, padding included
    for b in range(out.shape[0]):
        got, want = _generated(out, ref, b, width)
        assert got == want
        assert (out[b, width + len(got) :] == tok.pad_token_id).all()
    assert out.shape[1] == width + int(ref.num_generated.max())


def test_return_dict_carries_nfe(demo, batch):
    model, _ = demo
    out = model.generate(
        **batch, custom_generate=CG, trust_remote_code=True, max_new_tokens=32, return_dict_in_generate=True
    )
    ref = sbd_ext.generate(model, batch["input_ids"], batch["attention_mask"], max_new_tokens=32)
    assert isinstance(out, SBDGenerateDecoderOnlyOutput)
    assert torch.equal(out.nfe, ref.nfe) and torch.equal(out.num_generated, ref.num_generated)
    assert (out.nfe < out.num_generated).any()  # SBD: fewer forwards than tokens


def test_settings_flow(demo, batch):
    """explicit keywords > per-call generation_config > model.generation_config > defaults."""
    model, _ = demo
    ids, am = batch["input_ids"][:1], batch["attention_mask"][:1]

    def nfe(**kw):
        return int(
            model.generate(
                ids,
                attention_mask=am,
                custom_generate=CG,
                trust_remote_code=True,
                max_new_tokens=40,
                return_dict_in_generate=True,
                **kw,
            ).nfe[0]
        )

    def ref_nfe(**kw):
        return int(sbd_ext.generate(model, ids, am, max_new_tokens=40, **kw).nfe[0])

    assert nfe(sbd_mode="ntp") == ref_nfe(mode="ntp")
    per_call = GenerationConfig(sbd_mode="ntp")
    assert nfe(generation_config=per_call) == ref_nfe(mode="ntp")
    assert nfe(generation_config=per_call, sbd_mode="sbd") == ref_nfe()
    model.generation_config.sbd_mode = "ntp"
    try:
        assert nfe() == ref_nfe(mode="ntp")  # the model's generation config
        assert int(sbd_ext.generate(model, ids, am, max_new_tokens=40).nfe[0]) == ref_nfe(mode="ntp")
        assert int(sbd_ext.generate_reference(model, ids, am, max_new_tokens=40).nfe[0]) == ref_nfe(mode="ntp")
        assert nfe(generation_config=GenerationConfig(sbd_mode="sbd")) == ref_nfe(mode="sbd")
        # an explicit settings object wins over the generation config entirely
        settings = sbd_ext.GenerationSettings(max_new_tokens=40)
        assert int(sbd_ext.generate(model, ids, am, settings).nfe[0]) == ref_nfe(mode="sbd")
    finally:
        del model.generation_config.sbd_mode
    # A threshold set for one sampler is not carried over to another chosen above it.
    model.generation_config.sbd_sampler, model.generation_config.sbd_threshold = "eb", 5.0
    try:
        assert nfe(sbd_sampler="confidence") == ref_nfe(sampler="confidence")
        assert nfe() == ref_nfe(sampler="eb", threshold=5.0)
    finally:
        del model.generation_config.sbd_sampler, model.generation_config.sbd_threshold


def test_bad_sbd_fields_are_clear_errors(demo, batch):
    model, _ = demo
    model.generation_config.sbd_block_size = "eight"
    try:
        with pytest.raises(ValueError, match=r"model.generation_config \(sbd_block_size='eight'\).*block_size"):
            sbd_ext.generate(model, batch["input_ids"][:1], max_new_tokens=4)
    finally:
        del model.generation_config.sbd_block_size
    with pytest.raises(ValueError, match=r"generation_config \(sbd_sampler='nope'\)"):
        model.generate(
            batch["input_ids"][:1],
            custom_generate=CG,
            trust_remote_code=True,
            generation_config=GenerationConfig(sbd_sampler="nope"),
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_beams": 2}, "num_beams"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"do_sample": True, "top_k": 5}, "top_k"),
        ({"do_sample": True, "top_p": 0.9}, "top_p"),
        ({"num_return_sequences": 2}, "num_return_sequences"),
        ({"stop_strings": ["####"]}, "stop_strings"),
        ({"output_scores": True}, "output_scores"),
        ({"logits_processor": [object()]}, "logits_processor"),
        ({"no_such_argument": 1}, "no_such_argument"),
    ],
)
def test_unsupported_is_refused(demo, batch, kwargs, match):
    model, _ = demo
    with pytest.raises(ValueError, match=match):
        model.generate(**batch, custom_generate=CG, trust_remote_code=True, max_new_tokens=4, **kwargs)


def test_greedy_ignores_sampling_filters(demo, batch):
    model, _ = demo
    out = model.generate(**batch, custom_generate=CG, trust_remote_code=True, max_new_tokens=8, top_k=5)
    assert out.shape[0] == 3


def test_checkpoint_generate_is_sbd(demo, batch, checkpoint):
    """A checkpoint saved with save_pretrained decodes with SBD from model.generate, with its own sbd_* settings."""
    model, _ = demo
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True, attn_implementation="sbd")
    assert (checkpoint / "custom_generate" / "generate.py").is_file()
    assert (checkpoint / "custom_generate" / "requirements.txt").read_text().split() == ["sbd_ext"]
    assert loaded.generation_config.sbd_block_size == 8
    out = loaded.generate(**batch, max_new_tokens=48, return_dict_in_generate=True)
    ref = sbd_ext.generate(
        model, batch["input_ids"], batch["attention_mask"], max_new_tokens=48, block_size=8, threshold=0.1
    )
    width = batch["input_ids"].shape[1]
    for b in range(3):
        got, want = _generated(out.sequences, ref, b, width)
        assert got == want
    assert torch.equal(out.nfe, ref.nfe)
    ids = demo[1](_prompts(demo[1], 1), return_tensors="pt")["input_ids"]
    positional = loaded.generate(ids, max_new_tokens=8)  # generate(ids), as HF allows
    assert (
        positional[0, ids.shape[1] :].tolist()
        == sbd_ext.generate(model, ids, max_new_tokens=8, block_size=8, threshold=0.1)
        .sequences[0, ids.shape[1] :]
        .tolist()
    )
    plain = AutoModelForCausalLM.from_pretrained(checkpoint)  # without trust_remote_code: HF's own generate
    assert not isinstance(
        plain.generate(**batch, max_new_tokens=2, return_dict_in_generate=True), SBDGenerateDecoderOnlyOutput
    )


def test_streamer_iterator(demo, checkpoint):
    """TextIteratorStreamer in a thread: the stream is the decoded output, and text arrives before the end."""
    model, tok = demo
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True, attn_implementation="sbd")
    enc = tok(_prompts(tok, 1), return_tensors="pt")
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    result, done_at = {}, []

    def run():
        result["out"] = loaded.generate(**enc, streamer=streamer, max_new_tokens=64)
        done_at.append(time.perf_counter())

    thread = threading.Thread(target=run)
    thread.start()
    pieces, first_at = [], None
    for text in streamer:
        if text and first_at is None:
            first_at = time.perf_counter()
        pieces.append(text)
    thread.join()
    new = result["out"][0, enc["input_ids"].shape[1] :]
    assert "".join(pieces) == tok.decode(new)
    assert first_at is not None and first_at < done_at[0]


class _Recorder:
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("kwargs", [{}, {"sbd_verify": True}, {"sbd_mode": "ntp"}, {"do_sample": True, "sbd_seed": 3}])
def test_streamer_gets_prompt_then_final_runs(demo, kwargs):
    model, tok = demo
    enc = tok(_prompts(tok, 1), return_tensors="pt")
    rec = _Recorder()
    out = model.generate(
        **enc, custom_generate=CG, trust_remote_code=True, streamer=rec, max_new_tokens=64, sbd_block_size=8, **kwargs
    )
    assert rec.puts[0] == enc["input_ids"].tolist() and rec.ended == 1
    streamed = [t for put in rec.puts[1:] for t in put]
    # shape (n,), as HF's decoding loop puts each step's tokens: transformers serve's streamer iterates the ids
    assert all(put and all(isinstance(t, int) for t in put) for put in rec.puts[1:])
    assert streamed == out[0, enc["input_ids"].shape[1] :].tolist()


def _generate_streaming(model, batch, **kw):
    """sbd_ext.generate with on_final_tokens: (output, {row: [run of ids, ...]})."""
    runs: dict = {}
    out = sbd_ext.generate(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        on_final_tokens=lambda b, ids: runs.setdefault(b, []).append(list(ids)),
        **kw,
    )
    return out, runs


@pytest.mark.parametrize("block_size, threshold", [(8, 0.1), (16, 0.0), (16, 0.5)])
def test_stream_is_each_forwards_contiguous_revealed_prefix(demo, batch, block_size, threshold):
    """Plain SBD: after each forward a row's stream reaches exactly the end of its contiguous revealed prefix (a token
    after a still-masked position waits), computed independently from the reveal trace."""
    out, runs = _generate_streaming(demo[0], batch, max_new_tokens=64, block_size=block_size, threshold=threshold)
    waited = False
    for b in range(3):
        p = int(out.prompt_lengths[b])
        revealed, expected = set(), []
        for _, positions, _ in out.trace[b]:
            revealed.update(positions)
            n = 0
            while p + n in revealed:
                n += 1
            if n > (expected[-1] if expected else 0):
                expected.append(n)
            waited |= any(q >= p + n for q in revealed)  # something revealed beyond a masked position
        cumulative = [sum(map(len, runs[b][: i + 1])) for i in range(len(runs[b]))]
        assert cumulative == expected
    if block_size == 16 and threshold == 0.0:
        assert waited  # the out-of-order case is exercised


def test_streamer_batch_gets_hf_error(demo, batch):
    model, tok = demo
    with pytest.raises(ValueError, match="batch size 1"):
        model.generate(
            **batch, custom_generate=CG, trust_remote_code=True, streamer=TextStreamer(tok), max_new_tokens=4
        )


def test_on_final_tokens_verify_streams_verified_only(demo, batch):
    """sbd_ext.generate's hook: per row, the runs concatenate to the row's output, verify mode included."""
    for kw in ({}, {"verify": True, "block_size": 8}, {"temperature": 1.0, "seed": 1}):
        out, runs = _generate_streaming(demo[0], batch, max_new_tokens=48, **kw)
        for b in range(3):
            p, n = int(out.prompt_lengths[b]), int(out.num_generated[b])
            # A streamed token cannot be taken back: a rejected draft streamed would break this equality.
            assert sum(runs[b], []) == out.sequences[b, p : p + n].tolist()


def test_pipeline_text_generation(demo, batch, checkpoint):
    model, tok = demo
    pipe = pipeline("text-generation", model=str(checkpoint), trust_remote_code=True)
    prompt = _prompts(tok, 1)[0]
    text = pipe(prompt, max_new_tokens=48, return_full_text=False)[0]["generated_text"]
    enc = tok([prompt], return_tensors="pt")
    ref = sbd_ext.generate(model, enc["input_ids"], max_new_tokens=48, block_size=8, threshold=0.1)
    assert text == tok.decode(ref.sequences[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def test_custom_generate_folder_is_package_data():
    from pathlib import Path

    import tomllib

    assert (CUSTOM_GENERATE_DIR / "custom_generate" / "generate.py").is_file()
    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    # custom_generate is a package of its own (no setuptools "absent from the packages configuration" warning):
    # both of its files are package data, requirements.txt included
    assert {"*.py", "*.txt"} <= set(data.get("sbd_ext.integration.custom_generate", []))
    assert (CUSTOM_GENERATE_DIR / "custom_generate" / "requirements.txt").is_file()


# --- issue 35 -------------------------------------------------------------------------------------------------------


def test_streamer_is_ended_once_when_an_option_is_refused(demo):
    """Issue 35 item 1: a refused option raised before the streamer was ended (a TextIteratorStreamer consumer then
    waited forever); now the streamer is ended once and the error still raises."""
    model, tok = demo
    enc = tok(_prompts(tok, 1), return_tensors="pt")
    rec = _Recorder()
    with pytest.raises(ValueError, match="num_beams"):
        model.generate(**enc, custom_generate=CG, trust_remote_code=True, streamer=rec, max_new_tokens=4, num_beams=2)
    assert rec.ended == 1
    rec = _Recorder()
    with pytest.raises(ValueError, match="outside the block sizes"):
        model.generate(**enc, custom_generate=CG, trust_remote_code=True, streamer=rec, sbd_block_size=64)
    assert rec.ended == 1


def test_padded_batch_without_attention_mask_infers_it_like_hf(demo, batch):
    """Issue 35 item 4: without attention_mask the pads of a padded batch became prompt tokens; transformers infers
    the mask from pad_token_id (when it is not an EOS id): the answer is the one with the mask."""
    model, tok = demo
    ids, am = batch["input_ids"], batch["attention_mask"]
    assert (am == 0).any() and tok.pad_token_id not in (model.generation_config.eos_token_id,)
    with_mask = model.generate(ids, attention_mask=am, custom_generate=CG, trust_remote_code=True, max_new_tokens=32)
    without = model.generate(ids, custom_generate=CG, trust_remote_code=True, max_new_tokens=32)
    assert torch.equal(without, with_mask)
    # The reference: sbd_ext.generate with transformers' own inferred mask.
    gc = GenerationConfig(pad_token_id=tok.pad_token_id, eos_token_id=model.generation_config.eos_token_id)
    gc._pad_token_tensor = torch.tensor(tok.pad_token_id)
    gc._eos_token_tensor = torch.tensor([model.generation_config.eos_token_id])
    inferred = model._prepare_attention_mask_for_generation(ids, gc, {})
    assert torch.equal(inferred, am)
    # A pad id that is also an EOS id is not inferred from (as in transformers): every position is a token.
    eos_pad = model.generate(
        ids,
        custom_generate=CG,
        trust_remote_code=True,
        max_new_tokens=8,
        pad_token_id=tok.pad_token_id,
        eos_token_id=[model.generation_config.eos_token_id, tok.pad_token_id],
    )
    ref = sbd_ext.generate(
        model,
        ids,
        max_new_tokens=8,
        pad_token_id=tok.pad_token_id,
        eos_token_id=[model.generation_config.eos_token_id, tok.pad_token_id],
    )
    for b in range(ids.shape[0]):
        got, want = _generated(eos_pad, ref, b, ids.shape[1])
        assert got == want


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"do_sample": True, "top_h": 0.5}, "top_h"),
        ({"max_time": 0.5}, "max_time"),
        ({"dola_layers": "high"}, "dola_layers"),
        ({"token_healing": True}, "token_healing"),
    ],
)
def test_more_unsupported_options_are_refused(demo, batch, kwargs, match):
    """Issue 35 item 5: these were accepted and ignored."""
    model, _ = demo
    with pytest.raises(ValueError, match=match):
        model.generate(**batch, custom_generate=CG, trust_remote_code=True, max_new_tokens=4, **kwargs)
    with pytest.raises(ValueError, match=match):
        model.generate(
            **batch,
            custom_generate=CG,
            trust_remote_code=True,
            max_new_tokens=4,
            generation_config=GenerationConfig(**kwargs),
        )


def test_unknown_sbd_fields_are_refused(demo, batch):
    """Issue 35 item 6: a misspelt sbd_* field (per-call config, the model's generation config, a keyword) was
    ignored; now it is an error naming it and the known fields."""
    model, _ = demo
    ids, am = batch["input_ids"][:1], batch["attention_mask"][:1]
    with pytest.raises(ValueError, match=r"sbd_blocksize.*sbd_block_size"):
        model.generate(
            ids,
            attention_mask=am,
            custom_generate=CG,
            trust_remote_code=True,
            max_new_tokens=4,
            generation_config=GenerationConfig(sbd_blocksize=4),
        )
    with pytest.raises(ValueError, match="sbd_verfy"):
        model.generate(ids, attention_mask=am, custom_generate=CG, trust_remote_code=True, sbd_verfy=True)
    model.generation_config.sbd_treshold = 0.5
    try:
        with pytest.raises(ValueError, match=r"model.generation_config.*sbd_treshold"):
            sbd_ext.generate(model, ids, am, max_new_tokens=4)
        with pytest.raises(ValueError, match="sbd_treshold"):
            model.generate(ids, attention_mask=am, custom_generate=CG, trust_remote_code=True, max_new_tokens=4)
    finally:
        del model.generation_config.sbd_treshold
    # the known ones, sbd_seed included, are accepted
    out = model.generate(
        ids,
        attention_mask=am,
        custom_generate=CG,
        trust_remote_code=True,
        max_new_tokens=4,
        generation_config=GenerationConfig(sbd_seed=3, sbd_block_size=4),
    )
    assert out.shape[1] > ids.shape[1]


def test_block_size_refusal_names_what_model_generate_takes(demo, batch):
    """Issue 35 item 15: the refusal said "pass strict_block_size=False", which model.generate refused; now it names
    sbd_strict_block_size, which model.generate (keyword or generation config) accepts."""
    model, _ = demo
    ids, am = batch["input_ids"][:1], batch["attention_mask"][:1]
    with pytest.raises(ValueError, match="sbd_strict_block_size=False") as err:
        model.generate(ids, attention_mask=am, custom_generate=CG, trust_remote_code=True, sbd_block_size=32)
    assert "pass strict_block_size" not in str(err.value)
    ref = sbd_ext.generate(model, ids, am, max_new_tokens=16, block_size=32, strict_block_size=False)
    for how in ({"sbd_strict_block_size": False}, {"generation_config": GenerationConfig(sbd_strict_block_size=False)}):
        out = model.generate(
            ids,
            attention_mask=am,
            custom_generate=CG,
            trust_remote_code=True,
            max_new_tokens=16,
            sbd_block_size=32,
            return_dict_in_generate=True,
            **how,
        )
        assert _generated(out.sequences, ref, 0, ids.shape[1])[0] == _generated(out.sequences, ref, 0, ids.shape[1])[1]
        assert torch.equal(out.nfe, ref.nfe)


def test_generation_config_as_a_dict(demo, batch):
    """Issue 35 item 15: generation_config as a dict gave "'dict' object has no attribute 'to_diff_dict'"; it is
    read as a GenerationConfig (anything else is a TypeError naming it)."""
    model, _ = demo
    ids, am = batch["input_ids"][:1], batch["attention_mask"][:1]
    out = model.generate(
        ids,
        attention_mask=am,
        custom_generate=CG,
        trust_remote_code=True,
        generation_config={"max_new_tokens": 24, "sbd_block_size": 4},
        return_dict_in_generate=True,
    )
    ref = sbd_ext.generate(model, ids, am, max_new_tokens=24, block_size=4)
    assert torch.equal(out.nfe, ref.nfe)
    got, want = _generated(out.sequences, ref, 0, ids.shape[1])
    assert got == want
    with pytest.raises(TypeError, match="generation_config must be a GenerationConfig or a dict"):
        model.generate(ids, custom_generate=CG, trust_remote_code=True, generation_config=[("max_new_tokens", 4)])


def test_bad_pad_in_the_model_config_is_named(demo, batch):
    """Issue 35 item 16: pad_token_id=-1 in the model's config (transformers runs it) failed with an error that did
    not say the value was the config's; now it names it and how to override it, and an override decodes."""
    model, tok = demo
    ids = tok(_prompts(tok, 1), return_tensors="pt")["input_ids"]
    saved = model.config.pad_token_id, model.generation_config.pad_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = -1
    try:
        for call in (
            lambda **kw: model.generate(ids, custom_generate=CG, trust_remote_code=True, max_new_tokens=8, **kw),
            lambda **kw: sbd_ext.generate(model, ids, max_new_tokens=8, **kw),
        ):
            with pytest.raises(ValueError, match=r"generation_config.pad_token_id = -1.*pass pad_token_id="):
                call()
            call(pad_token_id=0)
    finally:
        model.config.pad_token_id, model.generation_config.pad_token_id = saved


def test_out_of_vocab_eos_in_the_models_config_is_treated_alike(demo, batch):
    """Issue 35 item 16: an out-of-vocabulary eos in generation_config.json was accepted by sbd_ext.generate (the
    model's own config is not checked) but refused by model.generate (which passed it on as the caller's). Both now
    decode alike, stopping on the ids that exist; a caller's out-of-vocabulary eos is refused by both."""
    model, tok = demo
    ids = tok(_prompts(tok, 1), return_tensors="pt")["input_ids"]
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [saved, 10**6]
    try:
        out = model.generate(ids, custom_generate=CG, trust_remote_code=True, max_new_tokens=48)
        ref = sbd_ext.generate(model, ids, max_new_tokens=48)
        assert (
            out[0, ids.shape[1] :].tolist()[: int(ref.num_generated[0])]
            == ref.sequences[0, ids.shape[1] :][: int(ref.num_generated[0])].tolist()
        )
        assert out.shape[1] == ids.shape[1] + int(ref.num_generated[0])
    finally:
        model.generation_config.eos_token_id = saved
    with pytest.raises(ValueError, match="could never stop"):
        model.generate(ids, custom_generate=CG, trust_remote_code=True, max_new_tokens=8, eos_token_id=10**6)
    with pytest.raises(ValueError, match="could never stop"):
        sbd_ext.generate(model, ids, max_new_tokens=8, eos_token_id=10**6)


@pytest.mark.parametrize("source", ["built from a config", "loaded without generation_config.json"])
def test_saved_sbd_settings_survive_a_reload(source, tmp_path):
    """Issue 61 item 3: a generation config that came from the model config (``_from_model_config``) was saved with
    its sbd_* fields, and transformers dropped them on load (the checkpoint decoded plain SBD at k=16, not the saved
    verify k=4). The settings read back are the ones saved."""
    from sbd_models import tiny_llama

    from sbd_ext.decoding.gen_config import sbd_fields

    model = tiny_llama()
    if source != "built from a config":
        model.save_pretrained(tmp_path / "plain")
        (tmp_path / "plain" / "generation_config.json").unlink()
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    gc = model.generation_config
    assert gc._from_model_config
    gc.sbd_verify, gc.sbd_block_size, gc.sbd_threshold = True, 4, 0.25
    save_pretrained(model, tmp_path / "ck")
    assert gc._from_model_config  # the model's own config object is left as it was
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ck").generation_config
    want = {"sbd_verify": True, "sbd_block_size": 4, "sbd_threshold": 0.25}
    assert {k: getattr(loaded, k, None) for k in want} == want
    assert sbd_fields(loaded, "reloaded") == sbd_fields(gc, "saved")
