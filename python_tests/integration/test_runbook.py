"""bench/run_gpu.sh, the GPU runbook, dry-run on the CPU for every stage (SBD_RUNBOOK_CPU=1): its selections
collect, its profiler / sanitizer target runs, its build evaluates setup.py, and its results are packed the way a
GPU call returns them (two files per stage under $OUT, at most 8 may come back). A stage that rots fails here."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tarfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
STAGES = ["build", "test", "bench", "ncu", "sanitize", "smollm2", "e2e", "gguf-part", "cpu"]
STEPS = {  # the steps each stage's summary must list as ok
    "build": ["build"],
    "test": ["test_cuda", "test_rest"],
    "bench": ["bench"],
    "ncu": ["ncu_attn-4k", "ncu_attn-32k", "ncu_entropy"],
    "sanitize": ["sanitize_memcheck", "sanitize_racecheck"],
    "smollm2": ["test_smollm2", "bench_smollm2"],
    "e2e": ["bench_e2e"],
    "gguf-part": [],
    "cpu": ["lscpu", "cpu_tests", "cpu_bench"],
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash"),
]


@pytest.mark.parametrize("stage", STAGES)
def test_runbook_dry_run(stage, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "SBD_RUNBOOK_CPU": "1", "TMPDIR": str(tmp_path), "PYTHON": os.sys.executable}
    r = subprocess.run(
        ["bash", str(ROOT / "bench" / "run_gpu.sh"), stage], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted([f"{stage}.tar.gz", f"{stage}-summary.md"]), files
    summary = (out / f"{stage}-summary.md").read_text()
    for step in STEPS[stage]:
        assert f"| {step} | ok |" in summary, summary
    with tarfile.open(out / f"{stage}.tar.gz") as tar:
        names = {pathlib.Path(n).name for n in tar.getnames()}
    assert {"env.log", "steps.tsv", "summary.md"} <= names, names
    assert {f"{s}.log" for s in STEPS[stage]} <= names, names


def test_runbook_refuses_an_unknown_stage():
    r = subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh"), "benchh"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
