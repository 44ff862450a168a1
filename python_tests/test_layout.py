"""The package's layering: the core (ops, reference, hf, cache, decoding, training, metadata) never imports the
demo (sbd_ext.demo) or the recipes (sbd_ext.recipes), and ``import sbd_ext`` loads neither."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import sbd_ext

PKG = Path(sbd_ext.__file__).resolve().parent
UPPER = ("demo", "recipes")


def _imported_modules(path: Path, package: str) -> set[str]:
    """Absolute names of every sbd_ext module ``path`` imports (top level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return {m for m in out if m.startswith("sbd_ext")}


def test_core_never_imports_demo_or_recipes():
    core = [p for p in PKG.glob("*.py")]
    assert {p.stem for p in core} >= {"ops", "reference", "hf", "cache", "decoding", "training", "metadata"}
    bad = {}
    for p in core:
        hits = {m for m in _imported_modules(p, "sbd_ext") if any(m.startswith(f"sbd_ext.{u}") for u in UPPER)}
        if hits:
            bad[p.name] = sorted(hits)
    assert not bad, f"core modules import the demo/recipes: {bad}"


def _run_python(code: str, cwd) -> subprocess.CompletedProcess:
    """`python -c code` in a fresh interpreter, outside the checkout, importing this sbd_ext."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(cwd),
        env={**os.environ, "PYTHONPATH": str(PKG.parent)},
    )


def test_import_sbd_ext_loads_no_demo_module(tmp_path):
    code = (
        "import sys, sbd_ext; "
        "print(','.join(sorted(m for m in sys.modules if m.startswith(('sbd_ext.demo', 'sbd_ext.recipes')))))"
    )
    r = _run_python(code, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "", f"import sbd_ext loaded: {r.stdout.strip()}"


def test_recipes_do_not_import_each_other_upwards():
    """The demo never imports the recipes (the recipes may use the demo's tasks)."""
    for p in (PKG / "demo").rglob("*.py"):
        pkg = "sbd_ext.demo" if p.parent == PKG / "demo" else "sbd_ext.demo.models"
        hits = {m for m in _imported_modules(p, pkg) if m.startswith("sbd_ext.recipes")}
        assert not hits, f"{p} imports {hits}"


def test_ops_stay_importable_when_the_hf_layer_cannot_load(tmp_path):
    # A transformers release whose internals moved (simulated: a name sbd_ext.hf imports is gone) must not take the
    # ops down with the attention backend; the HF names then raise an error that says why.
    code = (
        "import torch, transformers.utils.import_utils as iu; del iu.is_tracing\n"
        "import sbd_ext\n"
        "t = torch.tensor([[5, 1, 5]]); p = torch.tensor([[7, 8, 9]]); e = torch.zeros(1, 3)\n"
        "rev, rem = sbd_ext.mask_replace(t, p, e, e, 5, 'eb', 0.1)\n"
        "assert t.tolist() == [[7, 1, 9]] and rem.tolist() == [0], t\n"
        "try:\n"
        "    sbd_ext.generate\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    r = _run_python(code, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "sbd_ext.generate could not be loaded with transformers" in r.stdout, r.stdout
    assert "is_tracing" in r.stdout and "The ops (sbd_ext.block_attention" in r.stdout, r.stdout
