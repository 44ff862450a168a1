"""``sbd-ext`` argument validation and error handling, and prompt text through the embedded tokenizers.

Bad arguments are argparse usage errors (exit code 2, one ``error:`` line naming the argument) found before anything
is loaded; requests the model cannot serve exit with code 1 and one line; neither prints a traceback. Prompt text is
text (``<eos>`` typed in it is not the EOS token) and characters the tokenizer cannot encode are named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sbd_ext import adapters, drafter
from sbd_ext.demo import cli, evaluate, models
from sbd_ext.demo.tokenizer import build_char_tokenizer, unknown_characters


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    prev = torch.get_num_threads()
    yield
    torch.set_num_threads(prev)  # cli sets 1 thread (--threads default)


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2, argv
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    "argv, names",
    [
        (["generate", "--block-size", "0"], "--block-size: must be an integer >= 1, got 0"),  # was silently 8
        (["generate", "--block-size", "-3"], "--block-size"),
        (["generate", "--block-size", "2.5"], "--block-size: must be an integer >= 1, got '2.5'"),
        (["generate", "--example", "-1"], "--example: must be an integer in [0, 9999], got -1"),  # was IndexError
        (["generate", "--example", str(cli.MAX_EXAMPLE + 1)], "--example"),
        (["generate", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["generate", "--max-new-tokens", "-5"], "--max-new-tokens"),
        (["generate", "--temperature", "-1"], "--temperature: must be a finite number >= 0"),
        (["generate", "--temperature", "nan"], "--temperature"),
        (["generate", "--temperature", "inf"], "--temperature"),
        (["generate", "--threshold", "-0.1"], "--threshold"),
        (["generate", "--threshold", "nan"], "--threshold"),
        (["generate", "--seed", str(2**63)], "--seed"),
        (["generate", "--threads", "-1"], "--threads"),
        (["generate", "--model", "no-such-model"], "--model: no model 'no-such-model'"),
        (["eval", "--n", "0"], "--n: must be an integer in [1, 100000], got 0"),  # was ZeroDivisionError
        (["eval", "--n", "100000000"], "--n: must be an integer in [1, 100000]"),  # was: built them all, then hung
        (["generate", "--threads", "100000"], f"--threads: must be an integer in [0, {cli.MAX_THREADS}]"),  # segfault
        (["eval", "--threads", str(cli.MAX_THREADS + 1)], "--threads"),
        (["eval", "--n", "-5"], "--n"),
        (["eval", "--batch-size", "0"], "--batch-size"),  # was ZeroDivisionError
        (["eval", "--gammas", "0.1", "-1"], "--gammas"),
        (["eval", "--gammas", "nan"], "--gammas"),
        (["eval", "--block-sizes", "8", "0"], "--block-sizes"),
        (["eval", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["eval", "--threads", "-2"], "--threads"),
        (["eval", "--sbd-model", "/no/such/folder"], "--sbd-model: no model '/no/such/folder'"),
        (["eval", "--ntp-model", "nope"], "--ntp-model"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, names, capsys):
    line = _usage_error(argv, capsys)
    assert f"argument {names}" in line, line


def _user_error(argv: list[str], capsys) -> str:
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_requests_the_model_cannot_serve_are_one_line(capsys, tmp_path):
    line = _user_error(["generate", "--block-size", "1", "--max-new-tokens", "4", "hi"], capsys)
    assert line.startswith("sbd-ext generate: error: block_size=1 is outside the block sizes") and "[2, 16]" in line
    line = _user_error(["generate", "--block-size", "17", "--max-new-tokens", "4", "hi"], capsys)
    assert "block_size=17" in line
    # A folder holding a model not trained for SBD (the NTP control), decoded with SBD.
    line = _user_error(["generate", "--model", str(models.path("ntp-arith")), "--max-new-tokens", "4", "hi"], capsys)
    assert "not trained for SBD" in line
    # A prompt longer than the model's positions (512).
    line = _user_error(["generate", "--max-new-tokens", "4", "1 " * 600], capsys)
    assert "max_position_embeddings = 512" in line
    # eval writes into --out: a file in the way is an OSError, reported in one line.
    (tmp_path / "taken").write_text("")
    argv = ["eval", "--n", "1", "--gammas", "0.1", "--block-sizes", "8", "--samplers", "eb", "--ntp-model", "none"]
    line = _user_error(argv + ["--max-new-tokens", "8", "--out", str(tmp_path / "taken")], capsys)
    assert "sbd-ext eval: error:" in line and "taken" in line


def test_traceback_on_request(monkeypatch, capsys):
    monkeypatch.setenv("SBD_EXT_TRACEBACK", "1")
    with pytest.raises(ValueError, match="block_size=1"):
        cli.main(["generate", "--block-size", "1", "--max-new-tokens", "4", "hi"])


def test_explicit_block_size_is_used(capsys):
    assert cli.main(["generate", "--block-size", "4", "--max-new-tokens", "8", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "[SBD k=4, eb sampler" in out and "NFE" in out


def test_process_exit_codes_without_tracebacks():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH")]))}
    env.pop("SBD_EXT_TRACEBACK", None)
    for argv, code in ((["generate", "--block-size", "0"], 2), (["generate", "--block-size", "1", "hi"], 1)):
        # cwd: next to the sbd_ext these tests imported (the installed one in CI), not a checkout's un-built source
        # folder, which `python -m` would put first on the path.
        p = subprocess.run(
            [sys.executable, "-m", "sbd_ext.demo", *argv], capture_output=True, text=True, env=env, cwd=_repo_root()
        )
        assert p.returncode == code, (argv, p.stderr)
        assert "Traceback" not in p.stderr and p.stderr.rstrip().splitlines()[-1].startswith("sbd-ext generate: error:")


def _repo_root() -> str:
    import sbd_ext

    return os.path.dirname(os.path.dirname(sbd_ext.__file__))


# ---- prompt text ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return models.load(models.DEFAULT_MODEL)[1]


def test_control_token_text_in_a_prompt_is_text(tok):
    text = "Q: Is <eos> or <|mask|> or <bos><pad><unk> a word?\nA: "
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id  # the one special token, added by id
    assert set(ids[1:]).isdisjoint(tok.all_special_ids), ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok([text, "hi"], padding=True).input_ids[0] == ids  # the batched path (evaluate.decode) too


def test_every_embedded_tokenizer_and_a_fresh_build_keep_it(tmp_path):
    for name in models.available():
        if adapters.is_artifact(models.path(name)) or drafter.is_drafter(models.path(name)):
            continue  # an adapter / drafter over a base model uses the base's tokenizer (the CLI splits special tokens)
        cfg = json.loads((models.path(name) / "tokenizer_config.json").read_text())
        assert cfg.get("split_special_tokens") is True, name
    fresh = build_char_tokenizer()
    fresh.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for t in (fresh, again):
        assert t.eos_token_id not in t("stop <eos> here").input_ids


def test_unknown_characters(tok):
    assert unknown_characters(tok, "Mia has 23 pens.\n~!") == []
    assert unknown_characters(tok, "<eos> <|mask|>") == []
    assert unknown_characters(tok, "café\tno é, ü") == ["é", "\t", "ü"]  # each once, in order
    ids = tok("é").input_ids
    assert ids == [tok.bos_token_id, tok.unk_token_id]  # what the warning is about


def test_cli_prompt_is_text_and_unknown_characters_warned(monkeypatch, capsys):
    seen = []
    real = evaluate.decode

    def spy(model, tok, prompts, *args, **kwargs):
        seen.append(tok(list(prompts)).input_ids[0])
        return real(model, tok, prompts, *args, **kwargs)

    monkeypatch.setattr(evaluate, "decode", spy)
    question = "Tom has 3 <eos> apples é and 4 <|mask|> pears, é. How many?"
    assert cli.main(["generate", "--max-new-tokens", "8", "--color", "never", question]) == 0
    err = capsys.readouterr().err
    (ids,) = seen
    _, tok = models.load(models.DEFAULT_MODEL)
    assert ids.count(tok.unk_token_id) == 2 and set(ids[1:]).isdisjoint({tok.eos_token_id, tok.mask_token_id})
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "'é' (U+00E9)" in warnings[0] and "<unk>" in warnings[0], err


def _answer_lines(out: str) -> list[str]:
    """The completion and the decoding summary of `sbd-ext generate`, without timings."""
    import re

    out = re.sub(r"\| [\d.]+ s \(\d+ tokens/s\) \| model load [\d.]+ s", "", out)
    return [line for line in out.splitlines() if line.strip() and not line.startswith("answer ")]


@pytest.mark.parametrize("keep_demo_json", [True, False])
def test_generate_with_an_exported_folder_is_the_models_answer(tmp_path, capsys, keep_demo_json):
    """Issue 35 item 7: `sbd-ext generate --model <folder from sbd-ext export>` ignored the folder's
    generation_config (decoding with k=16) and its prompt format (the question unwrapped): garbage where
    `--model sbd-arith` is right. Also for a folder without sbd_demo.json (its generation_config.json and chat
    template alone)."""
    from sbd_ext.demo import export, tasks

    dest = export.export(models.DEFAULT_MODEL, tmp_path / "exported")
    if not keep_demo_json:
        (dest / "sbd_demo.json").unlink(missing_ok=True)
    question = next(iter(tasks.problems("test", 1))).message
    argv = ["generate", "--color", "never", "--max-new-tokens", "96", question]
    assert cli.main(argv) == 0
    want = _answer_lines(capsys.readouterr().out)
    assert cli.main(["generate", "--model", str(dest), *argv[1:]]) == 0
    got = _answer_lines(capsys.readouterr().out)
    assert got == want
    assert "SBD k=8, eb sampler 0.1" in want[-1]
