"""The manual's numbers come from results files, not from hand-edited tables: the README's table and the benchmarks
page are what ``bench/render_results.py`` draws from ``bench/results/report/``, every results table of those pages
lies inside the generated block, the README stays short with one table, the guides carry no dated entries (history
lives in CHANGELOG.md and docs/notes/), and ``bench/report.py`` runs end to end (a tiny eager dry run)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sbd_ext.quantization import PackedLinear

ROOT = Path(__file__).resolve().parents[2]
if not (ROOT / "bench" / "render_results.py").is_file():
    pytest.skip("not a source checkout", allow_module_level=True)


def _load_bench(name: str):
    """``bench/<name>.py`` as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


render = _load_bench("render_results")


def _tables_outside_blocks(text: str) -> list[str]:
    """Markdown table rows with a measured figure (a ratio or a rate) outside the generated and included blocks."""
    head, _, rest = text.partition(render.BEGIN)
    _, _, tail = rest.partition(render.END)
    text = render.INCLUDE.sub("", head + tail)
    rows = [ln for ln in text.splitlines() if ln.startswith("|")]
    return [ln for ln in rows if re.search(r"\d×|tok/s|tokens/s|\d ms\b", ln)]


GUIDES = ["README.md"] + sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("page", render.pages())
def test_results_blocks_are_what_the_files_give(page):
    text = (ROOT / page).read_text()
    assert render.rendered(page, text, render.load_reports()) == text, (
        f"{page}: run `python bench/render_results.py` (a results block is not what its files give)"
    )


@pytest.mark.parametrize("page", GUIDES)
def test_every_results_table_is_generated(page):
    """Outside docs/notes/ (history), a table of measured speed comes from a results file."""
    bad = _tables_outside_blocks((ROOT / page).read_text())
    assert not bad, f"{page}: results tables written by hand (generate them, or move them to docs/notes/): {bad}"


def test_readme_is_short_with_one_table_of_current_numbers():
    text = (ROOT / "README.md").read_text()
    assert text.count("\n") <= 150, "README.md over 150 lines: the manual belongs in docs/"
    head, _, rest = text.partition(render.BEGIN)
    block, _, tail = rest.partition(render.END)
    assert not [ln for ln in (head + tail).splitlines() if ln.startswith("|")], "README: a table outside the block"
    rows = [ln for ln in block.splitlines() if ln.startswith("|")]
    assert len(rows) <= 2 + 8, "README's table: at most ~8 rows"
    if render.load_reports():
        assert "× HF `generate`" in rows[0] and "× own NTP" in rows[0], "both speed-ups, every class"


def test_guides_carry_no_dated_entries():
    guides = [p for p in (ROOT / "docs").glob("*.md")]  # docs/notes/ is where history goes
    assert guides
    dated = [
        f"{p.name}: {ln}"
        for p in guides
        for ln in p.read_text().splitlines()
        if ln.startswith("#") and re.search(r"20\d\d-\d\d-\d\d", ln)
    ]
    assert not dated, f"dated headings in guide pages (move them to docs/notes/ or CHANGELOG.md): {dated}"


def _report(cls: str, tps: float, quick: bool = False) -> dict:
    rows = [
        {
            "decoder": "HF generate",
            "tokens_per_s": 10.0,
            "tokens_per_forward": 1.0,
            "vs_peer": 1.0,
            "vs_own_ntp": 0.5,
            "accuracy": 1.0,
        },
        {
            "decoder": "NTP, compiled",
            "tokens_per_s": 20.0,
            "tokens_per_forward": 1.0,
            "vs_peer": 2.0,
            "vs_own_ntp": 1.0,
            "accuracy": 1.0,
        },
        {
            "decoder": "SBD, compiled",
            "tokens_per_s": tps,
            "tokens_per_forward": 7.0,
            "vs_peer": tps / 10,
            "vs_own_ntp": tps / 20,
            "accuracy": 0.98,
        },
    ]
    suite = {"what": "w", "rows": rows, "date": "2026-01-02", "commit": "abc1234", "seconds": 1.0}
    return {
        "class": cls,
        "machine": "M",
        "isa": "AVX2",
        "threads": 1,
        "torch": "t",
        "quick": quick,
        "suites": {"arith": suite},
    }


def test_render_states_both_ratios_per_class_and_ignores_dry_runs(tmp_path):
    (tmp_path / "cpu-avx512.json").write_text(json.dumps(_report("cpu-avx512", 160.0)))
    (tmp_path / "cpu-avx2.json").write_text(json.dumps(_report("cpu-avx2", 120.0)))
    (tmp_path / "cpu-amx.json").write_text(json.dumps(_report("cpu-amx", 999.0, quick=True)))
    reps = render.load_reports(tmp_path)
    assert [r["class"] for r in reps] == ["cpu-avx2", "cpu-avx512"]  # ISA order; a dry run is never shown
    table = render.readme_block(reps)
    sbd = next(ln for ln in table.splitlines() if ln.startswith("| arithmetic, embedded SBD model (0.8 M): SBD |"))
    assert "120 | 12.00× | 6.00× |" in sbd and "160 | 16.00× | 8.00× |" in sbd, sbd
    verify = next(ln for ln in table.splitlines() if "embedded SBD model (0.8 M): verify" in ln)
    assert verify.count("–") == 6  # a row a class did not measure is marked, not invented
    page = render.page_block(reps)
    assert (
        "### cpu-avx2: M, AVX2, 1 thread" in page and "| SBD, compiled | 120 | 7.00 | 12.00× | 6.00× | 98.0 % |" in page
    )


def test_splice_needs_one_pair_of_markers():
    with pytest.raises(ValueError, match="markers"):
        render.splice("no markers", "x", "page")
    text = f"a\n{render.BEGIN}\nold\n{render.END}\nb"
    assert render.splice(text, "new", "p") == f"a\n{render.BEGIN}\nnew\n{render.END}\nb"


# CI's time: these three cover the suites' code (smollm2_sbd is arith's on another model; the runbook's report stage
# dry-runs forward)
SUITES = ("arith", "chat", "arith_drafter")


@pytest.mark.slow
def test_report_dry_run_writes_a_class_file(tmp_path):
    from sbd_ext.recipes import smollm2

    if not smollm2.is_available():
        pytest.skip(f"SmolLM2 is not available ({smollm2.INSTALL_HINT})")
    env = dict(os.environ)  # the sbd_ext under test: installed, or the in-place build the caller's path names
    r = subprocess.run(
        [sys.executable, "bench/report.py", "--quick", "--device-cycle", "--out", str(tmp_path), "--suites", *SUITES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = tmp_path.glob("cpu-*.json")
    rec = json.loads(path.read_text())
    assert rec["quick"] and set(rec["suites"]) == set(SUITES)
    for name, suite in rec["suites"].items():
        assert suite["commit"] and suite["date"] and suite["rows"], name
        if name != "forward":
            peer = next(r for r in suite["rows"] if r["decoder"] == "HF generate")
            assert peer["vs_peer"] == 1.0 and all(r["tokens"] > 0 for r in suite["rows"])
    chat = {r["decoder"]: r for r in rec["suites"]["chat"]["rows"]}
    assert chat["verify, compiled"]["equal_to_peer"] == "2/2"  # verify: the base's own answers
    # the device cycle's rows (a GPU's report has them; --device-cycle here): the same answers
    assert chat["verify k=2, compiled, device cycle"]["equal_to_peer"] == "2/2"
    arith = {r["decoder"]: r for r in rec["suites"]["arith"]["rows"]}
    assert {"NTP, compiled, device cycle", "SBD, compiled, device cycle", "verify, compiled, device cycle"} <= set(
        arith
    )
    assert render.load_reports(tmp_path) == []  # a dry run never reaches the pages


@pytest.mark.slow
def test_profile_suite_splits_a_forward_and_renders(monkeypatch):
    """The profile suite's dry run (eager, packed fp32): the bytes a one-row greedy forward streams are the linears'
    fp32 weights and the head's bf16 screen, the ops' one-row times are found and inside the step's, and the page
    shows the row."""
    from sbd_ext.recipes import smollm2

    if not smollm2.is_available():
        pytest.skip(f"SmolLM2 is not available ({smollm2.INSTALL_HINT})")
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import report_profile

    res = report_profile.suite_profile(torch.device("cpu"), 1, 6, compiled=False)
    (row,) = res["rows"]
    from sbd_ext.recipes.smollm2 import checkpoint

    base = checkpoint.load_smollm2(attn_implementation="sdpa")[0]
    cfg = base.config
    h, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = h // cfg.num_attention_heads
    per_layer = h * h * 2 + 2 * h * cfg.num_key_value_heads * hd + 3 * h * f
    # fp32 panels; the head's bf16 screen (a greedy forward's head: sbd_ext.greedy_head) and its rows' norms
    expect = 4 * L * per_layer + 2 * h * cfg.vocab_size + 4 * cfg.vocab_size
    assert abs(row["weights_mb"] * 1e6 - expect) / expect < 0.01, (row["weights_mb"], expect)
    assert row["read_gbs"] > 0 and row["linears_ms"] > 0 and row["attention_ms"] > 0
    # the ops' own clock inside the step: eager, each linear its own call, and the head (screened_head)
    assert row["linear_calls"] == 7 * L + 1, row
    # The step, the forward and the ops are timed in separate runs: on a busy or noisy machine their medians cross
    # (a CI run beside other work measured the forward 3 % under the step), so only that each was measured is checked.
    assert row["step_ms"] > 0 and row["forward_ms"] > 0
    # the tiny twin: the same layers, heads and linear modules (so the same op calls), far fewer bytes, a cheaper step
    twin = report_profile.twin_model(cfg, "packed")
    tc = twin.config
    assert (tc.num_hidden_layers, tc.num_attention_heads, tc.num_key_value_heads) == (
        L,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    )
    names = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)]  # each one packed by the scheme
    assert [n for n, m in twin.named_modules() if isinstance(m, PackedLinear)] == names and len(names) > 200
    assert report_profile.weight_bytes(twin) < expect / 100
    assert 0 < row["twin_step_ms"] < row["step_ms"], row
    rep = {
        "class": "cpu-x",
        "machine": "M",
        "isa": "I",
        "threads": 1,
        "torch": "t",
        "suites": {"profile": res | {"date": "d", "commit": "c"}},
    }
    page = render.page_block([rep])
    assert "Where a one-row decoding forward's time goes" in page and "| packed | " in page


def test_drafter_bench_files_are_pytest_benchmark_runs():
    """``bench/results/drafter/bench_*.json`` are pytest-benchmark files (bench/plots.py reads them as such); a study's
    own JSON is named ``study_*`` or ``eval_*``."""
    bad = []
    for f in sorted((ROOT / "bench" / "results" / "drafter").glob("bench_*.json")):
        d = json.loads(f.read_text())
        if not (isinstance(d, dict) and {"benchmarks", "machine_info", "commit_info", "datetime"} <= d.keys()):
            bad.append(f.name)
    assert not bad, f"not pytest-benchmark files (rename them study_*.json): {bad}"


def test_plot_data_readers_run_on_the_committed_results():
    """What the docs build draws (bench/plots.py) reads the committed results without error: every panel has its
    HF ``generate`` baseline and positive rates (matplotlib is not needed for the data)."""
    plots = _load_bench("plots")
    panels = [plots.e2e_rows(), plots.drafter_rows()]
    if (peers := plots.peers_generate_rows()) is not None:
        panels.append(peers)
    for rows, caption in panels:
        assert rows and caption
        assert any("hf_generate" in n for n, _ in rows), caption
        assert all(v > 0 for _, v in rows), caption
    series, caption = plots.forward_rows()
    assert series and caption
