"""The demo training command (`python -m sbd_ext.demo.train`) on a few steps: phases, outputs, determinism."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sbd_ext.demo import train as train_demo
from sbd_ext.demo.tokenizer import build_bpe_tokenizer

TINY = ["--pretrain-steps", "6", "--finetune-steps", "4", "--eval-problems", "0", "--hidden", "32", "--layers", "1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    log = train_demo.main(["--out", str(out), *TINY])
    return out, log


def test_phases_and_outputs(run):
    out, log = run
    assert set(log["phases"]) == {"pretrain", "sbd", "ntp"}
    for kind in ("pretrain", "sbd", "ntp"):
        d = out / kind
        for f in ("config.json", "model.safetensors", "tokenizer.json", "train_log.json"):
            assert (d / f).is_file(), (kind, f)
    assert len(log["phases"]["sbd"]["history"]) > 0 and "mask_loss" in log["phases"]["sbd"]["history"][-1]
    sbd_cfg = json.loads((out / "sbd" / "config.json").read_text())
    ntp_cfg = json.loads((out / "ntp" / "config.json").read_text())
    assert sbd_cfg["mask_token_id"] is not None and sbd_cfg["sbd_block_size_range"] == [2, 16]
    assert "mask_token_id" not in ntp_cfg or ntp_cfg["mask_token_id"] is None
    # both fine-tunes start from the same checkpoint and take steps: neither equals the pre-trained weights
    pre = load_file(out / "pretrain" / "model.safetensors")
    for kind in ("sbd", "ntp"):
        w = load_file(out / kind / "model.safetensors")
        name = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(w[name], pre[name]), kind


def test_deterministic_from_seed(run, tmp_path):
    out, _ = run
    train_demo.main(["--out", str(tmp_path), *TINY])
    for kind in ("sbd", "ntp"):
        a = load_file(out / kind / "model.safetensors")
        b = load_file(tmp_path / kind / "model.safetensors")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (kind, k)


def test_install_writes_demo_info(run, tmp_path):
    out, _ = run
    train_demo.install(out, "sort", dst_root=tmp_path)
    for kind in ("sbd", "ntp"):
        info = json.loads((tmp_path / f"{kind}-sort" / "sbd_demo.json").read_text())
        assert info["task"] == "sort" and info["objective"] == kind
        assert info["sampler"] in ("eb", "entropy", "confidence") and 0 < info["gamma_low"] < info["gamma_high"]
        assert (tmp_path / f"{kind}-sort" / "model.safetensors").stat().st_mode & 0o044 == 0o044


@pytest.mark.parametrize("task", ["arith", "sort"])
def test_batches_follow_the_task(task):
    tok = build_bpe_tokenizer()
    batch = next(train_demo.batches(tok, 0, 4, answer_only=True, task=task))
    text = tok.decode(batch["input_ids"][0], skip_special_tokens=True)
    probe = "the list:" if task == "sort" else "How many"
    assert probe in text, text
    # the loss covers the answer only (then EOS): no labelled token belongs to the prompt
    for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
        labelled = tok.decode(ids[labels != train_demo.IGNORE_INDEX], skip_special_tokens=True)
        assert "####" in labelled and "Q:" not in labelled, labelled
