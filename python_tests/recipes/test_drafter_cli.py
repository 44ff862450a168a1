"""The drafter recipe's command line (issue 61 item 10): bad arguments are usage errors (exit code 2, one line on
stderr) found before anything is loaded, and a request the run cannot serve is one line naming the settings at
fault (exit code 1), never a traceback; both entry points (``python -m sbd_ext.recipes.smollm2.drafter`` and
``python -m sbd_ext.recipes.drafter --base DIR``). Nothing here loads a model."""

from __future__ import annotations

import pytest
import torch
from sbd_models import tiny_llama

from sbd_ext.recipes import drafter as own
from sbd_ext.recipes.smollm2 import drafter as recipe


def _exit_code(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's usage error
        return e.code


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1]


@pytest.fixture
def base(tmp_path):
    """A model folder without tokenizer files (config.json and weights only)."""
    tiny_llama(mask_id=None).save_pretrained(tmp_path / "base")
    return tmp_path / "base"


@pytest.fixture
def good_base(base):
    """The same with a tokenizer file (never loaded here: the arguments are refused first)."""
    (base / "tokenizer.json").write_text("{}")
    return base


@pytest.mark.parametrize("main", [recipe.main, own.main], ids=["smollm2", "own"])
@pytest.mark.parametrize(
    "args, flag",
    [
        (["data", "--n", "0"], "--n"),
        (["data", "--n", "-4"], "--n"),
        (["data", "--batch-size", "0"], "--batch-size"),
        (["data", "--threads", "-1"], "--threads"),
        (["data", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["train", "--batch-size", "0"], "--batch-size"),
        (["train", "--threads", "-1"], "--threads"),
        (["train", "--steps", "0"], "--steps"),
        (["train", "--lr", "nan"], "--lr"),
        (["train", "--full-block-prob", "1.5"], "--full-block-prob"),
        (["train", "--block-size-range", "5", "2"], "--block-size-range"),
    ],
)
def test_bad_numbers_are_usage_errors(main, args, flag, good_base, tmp_path, capsys):
    """data --n 0 / -4 exited 0 doing nothing; --batch-size 0 and --threads -1 ended in tracebacks."""
    argv = [args[0], "--out", str(tmp_path / "run"), "--base", str(good_base), *args[1:]]
    if main is recipe.main:
        argv = argv[:3] + argv[5:]  # the SmolLM2 recipe: no --base
    assert _exit_code(main, argv) == 2
    line = _one_line(capsys)
    assert flag in line and "error" in line
    assert not (tmp_path / "run").exists()


def test_a_base_without_tokenizer_files_is_named(base, tmp_path, capsys):
    """A --base folder without tokenizer files gave transformers' "sentencepiece or tiktoken" message."""
    for cmd in ("data", "train"):
        assert _exit_code(own.main, [cmd, "--base", str(base), "--out", str(tmp_path / "run")]) == 2
        line = _one_line(capsys)
        assert f"--base {base}: no tokenizer files" in line and "sentencepiece" not in line
    assert _exit_code(own.main, ["data", "--base", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r")]) == 2
    assert "not a local HF model folder" in _one_line(capsys)


@pytest.mark.parametrize("main, prog", [(recipe.main, "smollm2.drafter train"), (own.main, "recipes.drafter train")])
def test_fewer_samples_than_a_batch_names_n_and_batch_size(main, prog, tmp_path, capsys):
    """data --n 4 then train died with "train_loop: data yielded no batch", naming neither --n nor --batch-size."""
    out = tmp_path / "run"
    out.mkdir()
    sample = {"prompt": "p", "prompt_ids": [1, 2], "answer_ids": [3, 4], "task": "general", "source": "templates"}
    torch.save([dict(sample) for _ in range(4)], out / recipe.SAMPLES_FILE)
    argv = ["train", "--out", str(out)]
    if main is own.main:  # the base the samples name
        folder = tmp_path / "base"
        tiny_llama(mask_id=None).save_pretrained(folder)
        (folder / "tokenizer.json").write_text("{}")  # never loaded: refused before the model
        torch.save([dict(sample, base=str(folder.resolve())) for _ in range(4)], out / recipe.SAMPLES_FILE)
        argv += ["--base", str(folder)]
    assert main([*argv, "--batch-size", "8"]) == 1
    line = _one_line(capsys)
    assert prog in line and "4 samples, fewer than --batch-size 8" in line and "--n" in line
    assert not (out / "drafter_config.json").exists() and not (out / recipe.CHECKPOINT_FILE).exists()


def test_run_errors_are_one_line_unless_asked(tmp_path, capsys, monkeypatch):
    """A request the run cannot serve (no samples yet) is one line, exit code 1; SBD_EXT_TRACEBACK=1 raises it."""
    argv = ["train", "--out", str(tmp_path / "empty")]
    assert recipe.main(argv) == 1
    assert "no samples; run `data --out" in _one_line(capsys)
    monkeypatch.setenv("SBD_EXT_TRACEBACK", "1")
    with pytest.raises(FileNotFoundError, match="no samples"):
        recipe.main(argv)
