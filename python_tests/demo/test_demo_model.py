"""The embedded demo models (sbd_ext.demo.models) and the ``sbd-ext`` command line, end to end on the CPU."""

import os
import subprocess
import sys

import pytest
import torch

import sbd_ext
from sbd_ext import adapters, drafter
from sbd_ext.demo import cli, models, tasks
from sbd_ext.demo.evaluate import decode, format_prompt
from sbd_ext.metadata import get_sbd_metadata

N_PROBLEMS = 8


@pytest.fixture(scope="module")
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # the model is tiny: one thread is the fast setting
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def sbd(one_thread):
    return models.load_default()


def test_embedded_models_present_and_small():
    names = models.available()
    assert models.DEFAULT_MODEL in names and models.CONTROL_MODEL in names
    for name in names:
        folder = models.path(name)
        if adapters.is_artifact(folder):  # an adapter over a base model from a package (smollm2-sbd)
            files = (adapters.ADAPTER_FILE, adapters.MASK_ROW_FILE, adapters.CONFIG_FILE, "sbd_demo.json")
        elif drafter.is_drafter(folder):  # a gated drafter over an unmodified base from a package (smollm2-drafter)
            files = (drafter.CONFIG_FILE, drafter.WEIGHTS_FILE, "ship_check.json")
        else:
            files = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "sbd_demo.json")
        for f in files:
            assert (folder / f).is_file(), f"{name}: {f} missing"
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        # the largest: smollm2-drafter, 12.7 MB (its rank-16 LoRA factors 9.8 MB in bf16 + its sampler head 1.2 MB +
        # its draft store 1.7 MB)
        assert size < 13e6, f"{name} is {size / 1e6:.1f} MB"
    with pytest.raises(FileNotFoundError):
        models.path("no-such-model")


def test_load_default_offline(sbd, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    model, tok = models.load_default()
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.mask_token_id == tok.mask_token_id
    assert list(cfg.sbd_block_size_range) == [2, 16]
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert not model.training
    control, control_tok = models.load(models.CONTROL_MODEL)
    # The control is fine-tuned by plain NTP from the same pre-trained checkpoint: same vocabulary, no SBD metadata,
    # so SBD decoding refuses it instead of decoding with an untrained mask token.
    assert control_tok.get_vocab() == tok.get_vocab()
    assert get_sbd_metadata(control.config) == (None, None)
    with pytest.raises(ValueError, match="not trained for SBD"):
        sbd_ext.generate(control, torch.tensor([[tok.bos_token_id]]), mode="sbd", block_size=8, max_new_tokens=2)


def test_sbd_decode_heldout_correct(sbd):
    """Greedy SBD decoding at the model's gamma_low (the CLI path) answers held-out problems, >= 3 tokens/forward."""
    model, tok = sbd
    info = models.demo_info()
    probs = list(tasks.problems("test", N_PROBLEMS))
    prompts = [format_prompt(p.prompt, info["prompt_template"]) for p in probs]
    res = decode(
        model,
        tok,
        prompts,
        mode="sbd",
        block_size=info["block_size"],
        sampler=info["sampler"],
        threshold=info["gamma_low"],
    )
    assert tasks.accuracy(res["completions"], probs) >= 7 / 8, res["completions"]
    assert sum(res["num_generated"]) / sum(res["nfe"]) >= 3.0  # >= 3x fewer forwards than next-token decoding
    ntp = decode(model, tok, prompts, mode="ntp")
    assert tasks.accuracy(ntp["completions"], probs) >= 7 / 8
    assert ntp["nfe"] == ntp["num_generated"]


def test_sort_model_heldout(one_thread):
    """The list sort/reverse pair: the SBD model decodes held-out lists next-token style and with SBD (> 2 tokens per
    forward at its gamma_low); answers are checked against the task's own solution."""
    model, tok = models.load("sbd-sort")
    info = models.demo_info("sbd-sort")
    assert info["task"] == "sort"
    probs = list(tasks.problems("test", 32, task="sort"))
    prompts = [format_prompt(p.prompt, info["prompt_template"]) for p in probs]
    ntp = decode(model, tok, prompts, mode="ntp")
    assert tasks.accuracy(ntp["completions"], probs) >= 0.8, ntp["completions"]
    res = decode(
        model, tok, prompts, block_size=info["block_size"], sampler=info["sampler"], threshold=info["gamma_low"]
    )
    assert tasks.accuracy(res["completions"], probs) >= 0.6, res["completions"]
    assert sum(res["num_generated"]) / sum(res["nfe"]) >= 2.0


def test_cli_generate(sbd, capsys):
    q = "Mia has 23 pens. She buys 5 more. She gives 8 to Sam. How many pens does Mia have now?"
    assert cli.main(["generate", q, "--show-steps", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "NFE" in out and "tokens/forward" in out and "forward   1" in out
    assert "expected 20: correct" in out
    assert cli.main(["generate", "--mode", "ntp", "--example", "1", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "NTP (1 token/forward)" in out and "correct" in out


def test_cli_subprocess():
    """``python -m sbd_ext.demo generate`` runs end to end in a fresh interpreter and prints the stats."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_COLOR="1")
    # Run next to the sbd_ext these tests imported (the installed one in CI), not the un-built source folder
    # that `python -m` would pick up from a checkout's root.
    r = subprocess.run(
        [sys.executable, "-m", "sbd_ext.demo", "generate", "--example", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(sbd_ext.__file__))),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "NFE" in r.stdout and "correct" in r.stdout, r.stdout
