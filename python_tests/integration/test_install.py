"""`uv pip install .` builds the extension against the target environment's torch and fetches no other torch
(pyproject's [tool.uv.extra-build-dependencies], match-runtime). It compiles the whole extension again (minutes),
so it runs where SBD_TEST_UV_INSTALL=1 is set: CI sets it (.ci/run), once per run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("SBD_TEST_UV_INSTALL") != "1", reason="rebuilds the extension: set SBD_TEST_UV_INSTALL=1"
    ),
]


def _run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=1800, **kw)
    assert r.returncode == 0, f"{cmd}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_uv_pip_install_builds_against_the_installed_torch(tmp_path):
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(uv).exists():
        pytest.skip("uv is not installed (pip install uv)")
    venv = tmp_path / "venv"
    py = venv / "bin" / "python"
    # The local wheel folders pip is configured with (uv reads no pip configuration).
    links = [f"--find-links={d}" for d in os.environ.get("PIP_FIND_LINKS", "").split() if os.path.isdir(d)]
    _run([uv, "venv", "-q", venv, "--python", sys.executable])
    _run([uv, "pip", "install", "-q", "--python", py, *links, f"torch=={torch.__version__}"])
    src = tmp_path / "src"  # the tracked sources only: no in-place build of the checkout is reused
    files = _run(["git", "ls-files"], cwd=ROOT).split()
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    # One CPU kernel variant (SBD_EXT_ISAS): what this test checks is which torch the isolated build compiles
    # against, not the kernels, which the rest of the suite tests in every variant.
    env = {**os.environ, "SBD_EXT_CUDA": "0", "SBD_EXT_ISAS": "DEFAULT"}
    log = _run([uv, "pip", "install", "--python", py, *links, src], env=env)
    check = (
        "import torch, sbd_ext; t = torch.tensor([[5, 1, 5]]); p = torch.tensor([[7, 8, 9]]); e = torch.zeros(1, 3);"
        "sbd_ext.mask_replace(t, p, e, e, 5, 'eb', 0.1); assert t.tolist() == [[7, 1, 9]];"
        "from sbd_ext.integration import CUSTOM_GENERATE_DIR as d;"  # package data: transformers' custom_generate
        "assert all((d / 'custom_generate' / f).is_file() for f in ('generate.py', 'requirements.txt'));"
        "print(torch.__version__, sbd_ext.build_info()['torch_version'], sbd_ext.__file__)"
    )
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package, not a checkout
    out = _run([py, "-c", check], cwd=tmp_path, env=clean).split()
    assert out[0] == torch.__version__ and torch.__version__.startswith(out[1]), out
    assert str(venv) in out[2], f"imported {out[2]}, not the installed package"
    assert " torch==" not in log and "+ torch" not in log, f"uv installed another torch:\n{log}"
