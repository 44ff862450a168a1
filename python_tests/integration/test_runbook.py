"""bench/run_gpu.sh, the GPU runbook, dry-run on the CPU for every stage (SBD_RUNBOOK_CPU=1): its selections
collect, its profiler / sanitizer target runs, its build evaluates setup.py, and its results are packed the way a
GPU call returns them (two files per stage under $OUT, at most 8 may come back). A stage that rots fails here."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tarfile
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
STAGES = ["build", "test", "bench", "ncu", "sanitize", "smollm2", "e2e", "e2e-cuda", "drafter-cuda", "drafter-train"]
STAGES += ["roofline", "report", "gguf-part", "cpu"]
STEPS = {  # the steps each stage's summary must list as ok
    "build": ["build"],
    "test": ["test_cuda", "test_rest"],
    "bench": ["bench"],
    "ncu": ["ncu_attn-4k", "ncu_attn-32k", "ncu_entropy"],
    "sanitize": ["sanitize_memcheck", "sanitize_racecheck"],
    "smollm2": ["test_smollm2", "bench_smollm2"],
    "e2e": ["bench_e2e"],
    "e2e-cuda": ["device_cycle_arith", "bench_e2e_cuda"],
    "drafter-cuda": ["bench_drafter_cuda", "profile_drafter"],
    "drafter-train": ["drafter_train"],
    "roofline": ["roofline"],
    "report": ["report"],
    "gguf-part": [],
    "cpu": ["lscpu", "cpu_tests", "cpu_linear", "cpu_bench"],
}

RETURNS = {"drafter-train": ["drafter-artifact.tar.part00", "drafter-samples.npz"]}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash"),
]


# The dry runs are mostly interpreter start-up and pytest collection (waiting on imports and the disk): three at a
# time take about half the wall-clock of one after another on a 2-core machine, with the same checks per stage.
PARALLEL = 3


def _dry_run(stage: str, tmp: pathlib.Path) -> tuple[subprocess.CompletedProcess, pathlib.Path]:
    out = tmp / "out"
    env = {**os.environ, "OUT": str(out), "SBD_RUNBOOK_CPU": "1", "TMPDIR": str(tmp), "PYTHON": os.sys.executable}
    r = subprocess.run(
        ["bash", str(ROOT / "bench" / "run_gpu.sh"), stage], capture_output=True, text=True, env=env, timeout=600
    )
    return r, out


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """Every stage's dry run, started together (PARALLEL at a time): {stage: future of (result, out folder)}."""
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        yield {stage: pool.submit(_dry_run, stage, tmp_path_factory.mktemp(f"runbook-{stage}")) for stage in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_runbook_dry_run(stage, dry_runs):
    r, out = dry_runs[stage].result()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    returns = RETURNS.get(stage, [])  # the stage's own big files, beside its two
    assert files == sorted([f"{stage}.tar.gz", f"{stage}-summary.md", *returns]), files
    assert len(files) <= 8 and all(p.stat().st_size < 16 << 20 for p in out.iterdir())
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


def test_gpu_carry_moves_the_model_folders_out_and_back(tmp_path):
    """tools/gpu_carry.sh (making room for a carried GGUF part): `b` keeps only smollm2-drafter in the tree, `a`
    none, `restore` puts every folder back; the files are unchanged."""
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "gpu_carry.sh", root / "tools" / "gpu_carry.sh")
    models = root / "sbd_ext" / "demo" / "models"
    names = ["ntp-arith", "sbd-arith", "smollm2-drafter", "smollm2-sbd"]
    for n in names:
        (models / n).mkdir(parents=True)
        (models / n / "w.bin").write_bytes(n.encode())
    (models / "__init__.py").write_text("")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    env = dict(os.environ, SBD_CARRY_ASIDE=str(tmp_path / "aside"))

    def carry(arg):
        r = subprocess.run(["bash", "tools/gpu_carry.sh", arg], cwd=root, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return sorted(p.name for p in models.iterdir() if p.is_dir())

    assert carry("b") == ["smollm2-drafter"]
    assert carry("a-arith") == ["ntp-arith", "sbd-arith"]
    assert carry("a") == []
    assert carry("restore") == sorted(names)
    assert all((models / n / "w.bin").read_bytes() == n.encode() for n in names)
    assert (models / "__init__.py").exists()
    bad = subprocess.run(["bash", "tools/gpu_carry.sh", "x"], cwd=root, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
