"""The package's layering: the core (ops, reference, samplers, hf, cache, metadata and the decoding and training
sub-packages) never imports the demo (sbd_ext.demo) or the recipes (sbd_ext.recipes), and ``import sbd_ext`` loads
neither; the core's modules stay small, import each other without cycles and never from inside a function."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sbd_ext

PKG = Path(sbd_ext.__file__).resolve().parent
UPPER = ("demo", "recipes")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _package_of(path: Path) -> str:
    """The package a module's relative imports start from."""
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(path: Path, package: str, top_level_only: bool = False) -> set[str]:
    """Absolute names of every sbd_ext module ``path`` imports (top level, or also inside functions)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
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


def _imported_modules(path: Path, package: str) -> set[str]:
    return _imports(path, package)


def _core_files() -> list[Path]:
    """Every module of the core, sub-packages included (everything but the demo and the recipes)."""
    return [p for p in PKG.rglob("*.py") if p.relative_to(PKG).parts[0] not in UPPER]


def test_core_never_imports_demo_or_recipes():
    core = _core_files()
    names = {_module_name(p) for p in core}
    want = {"ops", "reference", "samplers", "hf", "cache", "decoding", "training", "metadata"}
    assert names >= {f"sbd_ext.{n}" for n in want}, sorted(names)
    for sub in ("decoding", "training"):  # sub-packages are walked too
        assert any(n.startswith(f"sbd_ext.{sub}.") for n in names), sorted(names)
    bad = {}
    for p in core:
        hits = {m for m in _imports(p, _package_of(p)) if any(m.startswith(f"sbd_ext.{u}") for u in UPPER)}
        if hits:
            bad[str(p.relative_to(PKG))] = sorted(hits)
    assert not bad, f"core modules import the demo/recipes: {bad}"


MAX_LINES = 420  # a room a newcomer can hold; the kernels (csrc/) are not Python and not counted


def test_core_modules_are_small():
    big = {str(p.relative_to(PKG)): n for p in _core_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"core modules over {MAX_LINES} lines: {big}"


MAX_ROOM = 450  # every module of the package, the demo and the recipes included


def test_every_room_is_small():
    big = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_ROOM}
    assert not big, f"modules over {MAX_ROOM} lines (split them, or move data into data files): {big}"


def test_results_hold_results_and_studies_sit_apart():
    """bench/results/ holds measurements (no scripts); one-off studies live in bench/studies/, not beside the benches
    a user runs."""
    bench = Path(__file__).resolve().parents[2] / "bench"
    if not bench.is_dir():
        pytest.skip("not a source checkout")
    code = [str(p.relative_to(bench)) for p in (bench / "results").rglob("*") if p.suffix in (".py", ".sh")]
    assert not code, f"scripts under bench/results/: {code}"
    assert not list(bench.glob("study_*.py")), "studies belong in bench/studies/"
    assert (bench / "studies").is_dir()


def _module_graph(files: list[Path]) -> dict[str, set[str]]:
    """Top-level imports between sbd_ext modules (``from . import x`` counts as importing ``pkg.x``)."""
    names = {_module_name(p): p for p in files}
    graph = {}
    for name, p in names.items():
        deps = set()
        for m in _imports(p, _package_of(p), top_level_only=True):
            while m and m not in names:
                m = m.rpartition(".")[0]
            if m and m != name and not name.startswith(m + "."):  # a module's own package is loaded first anyway
                deps.add(m)
        graph[name] = deps
    return graph


def test_no_import_cycles():
    graph = _module_graph(_core_files())
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep.startswith(node + "."):
                continue  # a package's __init__ re-exporting its modules
            if state.get(dep) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [dep])}")
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_no_function_local_imports_of_siblings():
    """Inside functions the core imports only optional dependencies, never another sbd_ext module."""
    bad = {}
    for p in _core_files():
        tree = ast.parse(p.read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("sbd_ext")):
                    bad.setdefault(str(p.relative_to(PKG)), []).append(f"{fn.name}: line {node.lineno}")
    assert not bad, f"function-local imports of sbd_ext modules: {bad}"


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


def _hf_layer_refused(tmp_path, setup: str) -> str:
    """Run ``setup`` (a line that breaks the HF layer), then import sbd_ext: the ops still work (mask_replace checked
    against its expected result) and ``sbd_ext.generate`` raises an ImportError, whose text is returned."""
    code = (
        setup + "\n"
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
    return r.stdout


def test_ops_stay_importable_when_the_hf_layer_cannot_load(tmp_path):
    # A transformers release whose internals moved (simulated: a name sbd_ext.hf imports is gone) must not take the
    # ops down with the attention backend; the HF names then raise an error that says why.
    out = _hf_layer_refused(tmp_path, "import torch, transformers.utils.import_utils as iu; del iu.is_tracing")
    assert "sbd_ext.generate could not be loaded with transformers" in out, out
    assert "is_tracing" in out and "The ops (sbd_ext.block_attention" in out, out


def test_a_too_new_transformers_is_named_not_crashed_into(tmp_path):
    # transformers 5.24 renamed past_key_values to cache; with it installed the HF names raise an error naming the
    # supported range and the pip command (simulated by the version string), and the ops still work.
    out = _hf_layer_refused(tmp_path, "import torch, transformers; transformers.__version__ = '5.24.0'")
    assert "transformers 5.24.0 is newer than sbd_ext supports" in out, out
    assert "pip install 'transformers>=5.17,<5.24'" in out, out
