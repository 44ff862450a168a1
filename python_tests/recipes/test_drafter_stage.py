"""The drafter's GPU training stage (sbd_ext.recipes.smollm2.drafter_stage, `bash bench/run_gpu.sh drafter-train`),
run on the CPU at its dry-run sizes over a tiny base: every phase ends with its figures recorded, the big results
come back in parts that reassemble into a loadable drafter, the samples survive their uint16 export, a second call
continues instead of starting over, and a deadline too near stops the stage cleanly."""

from __future__ import annotations

import json
import tarfile
import time

import pytest
import torch

from sbd_ext import drafter
from sbd_ext.recipes.smollm2 import drafter as recipe
from sbd_ext.recipes.smollm2 import drafter_stage as stage


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage")
    args = ["--work", str(root / "work"), "--results", str(root / "res"), "--returns", str(root / "ret")]
    first = stage.main([*args, "--dry-run", "--device", "cpu", "--phases", "data", "sweep"])
    second = stage.main([*args, "--dry-run", "--device", "cpu"])
    return root, args, first, second


def test_every_phase_ran_and_recorded_its_figures(dry):
    root, _, first, second = dry
    assert (first, second) == (0, 0)
    st = json.loads((root / "res" / "stage.json").read_text())
    assert st["done"] == ["data", "sweep", "train", "head", "store", "eval"]
    assert st["store"]["answers"] == st["data"]["samples"] and st["store"]["entries"] > 0
    assert st["data"]["samples"] == stage.DRY["templates"] and st["data"]["answer_tokens"] > 0
    assert set(st["sweep"]) == {str(r) for r in stage.DRY["ranks"]}
    assert all(0.0 <= v["slot1_heldout"] <= 1.0 and v["s_per_step"] > 0 for v in st["sweep"].values())
    assert st["final"]["rank"] in stage.DRY["ranks"] and st["final"]["steps"] == stage.DRY["max_steps"]
    rows = st["eval"]["new"]
    assert rows[0]["mode"] == "ntp" and all(r["equal_to_ntp"] == "2/2" for r in rows[1:])
    log = (root / "res" / "stage.log").read_text()
    assert "sweep rank" in log and "eval new" in log


def test_the_returned_parts_reassemble_into_the_drafter(dry, tmp_path):
    root = dry[0]
    parts = sorted((root / "ret").glob("drafter-artifact.tar.part*"))
    assert parts and all(p.stat().st_size <= stage.PART for p in parts)
    tar = tmp_path / "a.tar"
    tar.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(tar) as t:
        t.extractall(tmp_path, filter="data")
    cfg = drafter.read_drafter_config(tmp_path / "artifact")
    assert cfg["r"] == json.loads((root / "res" / "stage.json").read_text())["final"]["rank"]
    assert "sampler_head" in cfg["sbd"] and "draft_store" in cfg["sbd"]


def test_samples_survive_the_export(dry, tmp_path):
    root = dry[0]
    rows = torch.load(root / "work" / recipe.SAMPLES_FILE, weights_only=True)
    back = stage.import_samples(root / "ret" / "drafter-samples.npz")
    assert back == rows
    with pytest.raises(ValueError, match="uint16"):
        stage.export_samples([{"prompt_ids": [70000], "answer_ids": [1]}], tmp_path / "x.npz")


def test_imported_samples_replace_the_data_phase(dry, tmp_path):
    root = dry[0]
    work = tmp_path / "work"
    args = ["--work", str(work), "--results", str(tmp_path / "res"), "--dry-run", "--device", "cpu"]
    args += ["--base", str(root / "work" / "tiny-base")]  # the samples' own base (another one's are refused)
    assert stage.main([*args, "--phases", "data", "--import-samples", str(root / "ret" / "drafter-samples.npz")]) == 0
    st = json.loads((tmp_path / "res" / "stage.json").read_text())
    assert st["data"]["samples"] == stage.DRY["templates"]
    assert "imported" in (tmp_path / "res" / "stage.log").read_text()


def test_a_second_call_continues_and_a_near_deadline_stops_cleanly(dry, tmp_path):
    root, args, _, _ = dry
    before = (root / "work" / "final" / "checkpoint.pt").stat().st_mtime_ns
    assert stage.main([*args, "--dry-run", "--device", "cpu"]) == 0  # everything done: nothing retrained
    assert (root / "work" / "final" / "checkpoint.pt").stat().st_mtime_ns == before
    fresh = ["--work", str(tmp_path / "w"), "--results", str(tmp_path / "r"), "--dry-run", "--device", "cpu"]
    assert stage.main([*fresh, "--deadline", str(time.time() + 5)]) == 3
    assert "before the deadline" in (tmp_path / "r" / "stage.log").read_text()


def test_train_stops_at_its_deadline_and_resumes_the_same_schedule(dry, tmp_path):
    """recipe.train(deadline=...): stops at the first step past it, checkpointed, the artifact saying how far it got;
    resume=True finishes the same schedule."""
    root = dry[0]
    out = tmp_path / "run"
    out.mkdir()
    (out / recipe.SAMPLES_FILE).symlink_to(root / "work" / recipe.SAMPLES_FILE)
    base = str(root / "work" / "tiny-base")
    cfg = recipe.DrafterConfig(steps=6, batch_size=2, max_len=64, rank=2, warmup=1, checkpoint_every=1, base=base)
    with pytest.warns(UserWarning, match="ran out after step 1"):
        rec = recipe.train(out, cfg, deadline=time.time() - 1)  # a call makes one step at least
    assert rec["steps_done"] == 1 and drafter.read_drafter_config(out / "artifact")["sbd"]["steps_done"] == 1
    rec = recipe.train(out, cfg, resume=True)
    assert rec["steps_done"] == 6 and json.loads((out / "train_log.json").read_text())["precision"] == "fp32"


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda"])
def test_a_device_the_machine_lacks_is_a_usage_error(device, tmp_path, capsys):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for cmd in (["data", "--out", str(tmp_path)], ["train", "--out", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            recipe.main([*cmd, "--device", device])
        assert e.value.code == 2 and "--device" in capsys.readouterr().err


def test_length_buckets_keep_every_sample_once_and_cut_the_padding():
    """make_batches(bucket=True): the same samples (each once, no batch mixing two answers' rows), far less padding
    than random batches of the same lengths; bucket=False gives the earlier batches exactly."""
    import random

    rng = random.Random(0)
    rows = [{"prompt_ids": [1] * rng.randint(5, 40), "answer_ids": [2] * rng.randint(1, 120)} for _ in range(256)]
    for i, r in enumerate(rows):
        r["prompt_ids"][0] = 1000 + i  # the sample's identity
    plain = recipe.make_batches(rows, 8, 160, 0, seed=3)
    bucketed = recipe.make_batches(rows, 8, 160, 0, seed=3, bucket=True)

    def ids(batches):
        return sorted(int(b["input_ids"][i, 0]) for b in batches for i in range(b["input_ids"].shape[0]))

    assert ids(plain) == ids(bucketed) == list(range(1000, 1256))
    assert recipe.padding_fraction(bucketed) < 0.5 * recipe.padding_fraction(plain)
    for b in bucketed:  # the loss covers each row's answer, nothing of its padding
        assert (b["loss_mask"] <= b["attention_mask"].bool()).all()
    order = list(range(256))
    random.Random(3).shuffle(order)  # the earlier make_batches: one shuffle, batches in that order
    assert [int(b["input_ids"][0, 0]) for b in plain] == [1000 + order[i] for i in range(0, 256, 8)]


def test_committed_parts_replace_the_data_phase(dry, tmp_path):
    """A CPU data run's parts (sbd_ext.recipes.drafter.parts) import like the stage's own npz."""
    from sbd_ext.recipes.drafter import parts

    root = dry[0]
    dest = tmp_path / "parts"
    parts.save_parts(root / "work", dest, part=3)
    work = tmp_path / "work"
    args = ["--work", str(work), "--results", str(tmp_path / "res"), "--dry-run", "--device", "cpu"]
    args += ["--base", str(root / "work" / "tiny-base"), "--phases", "data", "--import-samples", str(dest)]
    assert stage.main(args) == 0
    rows = torch.load(root / "work" / recipe.SAMPLES_FILE, weights_only=True)
    assert torch.load(work / recipe.SAMPLES_FILE, weights_only=True) == rows[: len(rows) // 3 * 3]
    assert "imported" in (tmp_path / "res" / "stage.log").read_text()
