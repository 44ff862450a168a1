"""A gated drafter for a model of one's own (``python -m sbd_ext.recipes.drafter --base DIR``): the recipe's data,
train, head, eval and ship stages over a local HF model folder (here a copy of the embedded ``ntp-arith`` Llama with
a chat template), an artifact that names that folder as its base and loads over it, and decoding with it that equals
the unmodified model's own NTP decoding (greedy and sampled)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import sbd_ext
from sbd_ext import drafter
from sbd_ext.artifact_checks import ArtifactError
from sbd_ext.demo import export, models
from sbd_ext.recipes import drafter as own
from sbd_ext.recipes.drafter.bases import prompt_ids
from sbd_ext.recipes.drafter.prompts import eval_prompts
from sbd_ext.recipes.smollm2 import drafter as recipe

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
TRAIN = ["--steps", "3", "--batch-size", "2", "--rank", "4", "--warmup", "1", "--checkpoint-every", "2"]
TRAIN += ["--log-every", "1", "--max-len", "256"]


def _base(folder, chat_template=True):
    shutil.copytree(models.path("ntp-arith"), folder, ignore=shutil.ignore_patterns("sbd_demo.json", "train_log.json"))
    if chat_template:
        tok = AutoTokenizer.from_pretrained(folder)
        tok.chat_template = TEMPLATE
        tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run of every stage over a base folder of one's own: (base, run folder, head folder, shipped folder)."""
    root = tmp_path_factory.mktemp("own")
    base, out, head, dest = _base(root / "base"), root / "run", root / "head", root / "drafter"
    assert own.main(["data", "--base", str(base), "--out", str(out), "--n", "6", "--max-new-tokens", "8"]) == 0
    assert own.main(["train", "--base", str(base), "--out", str(out), *TRAIN]) == 0
    samples = str(out / recipe.SAMPLES_FILE)
    args = ["head", "--artifact", str(out / "artifact"), "--samples", samples, "--out", str(head), "--epochs", "1"]
    assert own.main(args) == 0
    ship = ["ship", "--out", str(head), "--dest", str(dest), "--block-size", "2", "--threshold", "100"]
    assert own.main([*ship, "--check-n", "2", "--max-new-tokens", "8"]) == 0
    return base, out, head, dest


def test_the_artifact_names_the_folder_as_its_base_and_the_stages_record_it(run):
    base, out, head, dest = run
    samples = torch.load(out / recipe.SAMPLES_FILE, weights_only=True)
    assert len(samples) == 6 and {s["base"] for s in samples} == {str(base.resolve())}
    tok = AutoTokenizer.from_pretrained(base)
    first = recipe.training_prompts(1)[0]
    assert samples[0]["prompt_ids"] == tok.apply_chat_template(
        [{"role": "user", "content": first}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    train_cfg = json.loads((out / "drafter_config.json").read_text())
    # verify's drafting settings are the entry point's defaults
    assert train_cfg["block_size_range"] == [2, 5] and train_cfg["full_block_prob"] == 1.0
    assert train_cfg["first_slot_loss"] is False and train_cfg["base"] == str(base.resolve())
    for folder in (out / "artifact", head / "artifact", dest):
        cfg = drafter.read_drafter_config(folder)
        assert "base_loader" not in cfg["sbd"], folder
        assert cfg["base_model_name_or_path"] == str(base.resolve())
        assert drafter.base_folder(cfg) == base.resolve()
    assert "sampler_head" in drafter.read_drafter_config(dest)["sbd"]
    check = json.loads((dest / "ship_check.json").read_text())
    assert check["verify_equal_to_ntp"] == "2/2" and check["sbd_block_size"] == 2


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_with_the_drafter_returns_the_unmodified_models_answers(run, temperature):
    base, _, _, dest = run
    model, tok = models.load(dest)
    plain, _ = models.load(base)  # the folder as it is: no drafter, no mask token added
    assert drafter.get_drafter(model).sampler_head is not None
    assert drafter.get_drafter(plain) is None
    for p in eval_prompts()[:3]:
        ids = torch.tensor([prompt_ids(tok, p["text"])])
        kw = dict(max_new_tokens=24, temperature=temperature, seed=3)
        got = sbd_ext.generate(model, ids, verify=True, **kw)  # the shipped settings: k=2, verify
        ref = sbd_ext.generate(plain, ids, mode="ntp", **kw)
        assert got.sequences.tolist() == ref.sequences.tolist(), p["text"]


def test_a_moved_base_is_named_at_load_time(run, tmp_path):
    base, _, _, dest = run
    moved = shutil.copytree(base, tmp_path / "moved")
    model, _ = drafter.load_drafter(dest, base=moved)
    assert model.name_or_path == str(moved)
    cfg = json.loads((dest / drafter.CONFIG_FILE).read_text())
    cfg["base_model_name_or_path"] = ""
    broken = shutil.copytree(dest, tmp_path / "nobase")
    (broken / drafter.CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="names no base model"):
        models.load(broken)
    with pytest.raises(ArtifactError, match="not a local HF model folder"):
        drafter.load_drafter(dest, base=tmp_path / "missing")


def test_bad_uses_get_clear_errors(run, tmp_path, capsys):
    base, out, _, _ = run
    assert own.main(["data", "--out", str(tmp_path / "r")]) == 2
    assert own.main(["train", "--out", str(tmp_path / "r")]) == 2
    assert own.main(["head", "--samples", "x.pt", "--out", str(tmp_path / "h")]) == 2
    assert "--base DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a usage error (exit code 2), before anything is loaded
        own.main(["data", "--base", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r")])
    assert "not a local HF model folder" in capsys.readouterr().err
    other = _base(tmp_path / "other")
    # the run folder holds base's answers: one line on stderr, exit code 1 (issue 61 item 10: no traceback)
    assert own.main(["data", "--base", str(other), "--out", str(out), "--n", "8", "--max-new-tokens", "8"]) == 1
    assert "another base model's answers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        own.main(["train", "--base", str(base), "--task", "arith", "--out", str(out), "--resume", *TRAIN])
    assert "--task general" in capsys.readouterr().err
    assert own.main(["train", "--base", str(base), "--out", str(tmp_path / "r2"), *TRAIN]) == 1
    assert "run `data" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # never into the package's embedded folders
        own.main(["ship", "--out", str(out), "--block-size", "2"])
    assert "needs --dest" in capsys.readouterr().err


def test_a_model_without_a_chat_template_gets_plain_text_prompts(tmp_path):
    base = _base(tmp_path / "plain", chat_template=False)
    out = tmp_path / "run"
    assert own.main(["data", "--base", str(base), "--out", str(out), "--n", "2", "--max-new-tokens", "4"]) == 0
    tok = AutoTokenizer.from_pretrained(base)
    got = torch.load(out / recipe.SAMPLES_FILE, weights_only=True)[0]
    assert got["prompt_ids"] == tok(recipe.training_prompts(1)[0]).input_ids


def test_the_exported_checkpoint_generates_the_unmodified_models_answers(run, tmp_path):
    """``sbd-ext export --model DRAFTER``: the user's base with the drafter in sbd_drafter/; ``model.generate`` with
    trust_remote_code decodes with it (verify) and equals HF ``generate`` on the original folder."""
    base, _, _, dest = run
    folder = export.export(str(dest), tmp_path / "exported")
    assert drafter.is_drafter(folder / drafter.CHECKPOINT_SUBFOLDER)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, attn_implementation="sbd")
    plain = AutoModelForCausalLM.from_pretrained(base)
    tok = AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": eval_prompts()[5]["text"]}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    got = model.generate(**ids, max_new_tokens=24)
    assert drafter.get_drafter(model) is not None  # attached on first use
    assert got.tolist() == plain.generate(**ids, max_new_tokens=24, do_sample=False).tolist()
