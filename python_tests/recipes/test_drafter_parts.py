"""A data run's answers committed in parts (sbd_ext.recipes.drafter.parts): each full part written once, the parts
reassembling into the run's samples, a later run continuing after them, and another run's samples refused."""

from __future__ import annotations

import json

import pytest
import torch

from sbd_ext.recipes.drafter import SAMPLES_FILE, parts


def _rows(n: int, lo: int = 0) -> list[dict]:
    return [
        {
            "prompt": f"p{i}",
            "prompt_ids": [1, i % 50000],
            "answer_ids": list(range(i % 7 + 1)),
            "task": "general",
            "source": "templates",
        }
        for i in range(lo, lo + n)
    ]


def _save(work, rows):
    work.mkdir(parents=True, exist_ok=True)
    torch.save(rows, work / SAMPLES_FILE)


def test_full_parts_are_written_once_and_reassemble(tmp_path):
    work, dest = tmp_path / "run", tmp_path / "parts"
    rows = _rows(17)
    _save(work, rows[:7])
    assert [p.name for p in parts.save_parts(work, dest, part=3)] == ["part-000.npz", "part-001.npz"]
    first = (dest / "part-000.npz").stat().st_mtime_ns
    _save(work, rows)  # the run went on
    assert [p.name for p in parts.save_parts(work, dest, part=3)] == ["part-002.npz", "part-003.npz", "part-004.npz"]
    assert (dest / "part-000.npz").stat().st_mtime_ns == first  # not rewritten
    man = json.loads((dest / "parts.json").read_text())
    assert man["parts"] == 5 and man["samples"] == 15
    assert man["answer_tokens"] == sum(len(r["answer_ids"]) for r in rows[:15])
    assert parts.import_samples(dest) == rows[:15]  # the partial last part (2 samples) waits for the next save
    assert parts.save_parts(work, dest, part=3) == []


def test_restore_continues_a_run_and_refuses_another(tmp_path):
    work, dest = tmp_path / "run", tmp_path / "parts"
    rows = _rows(9)
    _save(work, rows)
    parts.save_parts(work, dest, part=4)
    fresh = tmp_path / "fresh"
    assert parts.restore_parts(dest, fresh) == 8
    assert torch.load(fresh / SAMPLES_FILE, weights_only=True) == rows[:8]
    assert parts.restore_parts(dest, work) == 9  # a run ahead of its parts keeps its samples
    assert torch.load(work / SAMPLES_FILE, weights_only=True) == rows
    other = tmp_path / "other"
    _save(other, _rows(5, lo=100))
    with pytest.raises(ValueError, match="another run"):
        parts.restore_parts(dest, other)
    with pytest.raises(ValueError, match="another run"):
        parts.save_parts(other, dest, part=4)
    with pytest.raises(ValueError, match="parts of 4 samples"):
        parts.save_parts(work, dest, part=3)


def test_a_missing_part_or_manifest_is_refused(tmp_path):
    work, dest = tmp_path / "run", tmp_path / "parts"
    _save(work, _rows(6))
    parts.save_parts(work, dest, part=2)
    (dest / "part-001.npz").unlink()
    with pytest.raises(ValueError, match="missing"):
        parts.import_samples(dest)
    with pytest.raises(ValueError, match="parts.json"):
        parts.import_samples(tmp_path)


def test_the_command_line(tmp_path, capsys):
    work, dest = tmp_path / "run", tmp_path / "parts"
    _save(work, _rows(5))
    assert parts.main(["save", "--work", str(work), "--dest", str(dest), "--part", "2"]) == 0
    assert "2 new part(s)" in capsys.readouterr().out
    assert parts.main(["restore", "--dest", str(dest), "--work", str(tmp_path / "b")]) == 0
    assert "4 samples" in capsys.readouterr().out
    assert parts.main(["restore", "--dest", str(tmp_path / "none"), "--work", str(work)]) == 1
    assert "no such file or folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a count below 1: a usage error, as for the recipe's other counts
        parts.main(["save", "--work", str(work), "--dest", str(dest), "--part", "0"])
    assert e.value.code == 2
