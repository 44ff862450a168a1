"""The plots of the README and the docs, drawn from the committed benchmark results (nothing is re-measured here).

    python bench/plots.py            # writes bench/results/plots/*.png (needs matplotlib: pip install ".[docs]")

* ``tokens_per_s.png``: tokens/s per decoding mode against HF ``generate``, two panels: the embedded arithmetic
  model (``bench/results/e2e_cpu.csv``, rows of the newest commit) and SmolLM2-135M-Instruct with its gated drafter on
  held-out general prompts (the newest ``bench/results/drafter/bench_*.json``).
  A third panel, from the newest peer-bench run with generate rows (``bench/results/cpu_peers/bench_w8a8.json``,
  else ``bench_int8_compiled.json``, ``bench_int8.json``, ``bench.json``): SmolLM2 greedy tokens/s of llama.cpp F32
  and Q8_0, vLLM, HF ``generate``, sbd_ext NTP (compiled; fp32, int8, w8a8) and verify in one run
  (``bench/bench_cpu_peers.py``).
* ``forward_cost.png``: the cost of one SmolLM2-135M forward against its number of new rows (the per-forward cost
  curve that decides what tokens/forward buy): from ``bench/results/cpu_peers/bench_w8a8.json`` (or
  ``bench_int8.json``, ``bench.json``: llama.cpp F32 / Q8_0, sbd_ext eager and compiled, fp32 / int8 / w8a8, HF, one
  run, 256-token cache) when it exists, else
  ``bench/results/smollm2_cpu.csv`` (sbd_ext and HF per cache length, ``test_forward_rows`` rows of the newest
  commit).
* ``drafter_data.png``: the SmolLM2 drafter's tokens per forward (verify k=2, with and without lookup, on the held-out
  chat prompts) against the answer tokens it was trained on, from ``bench/results/drafter/data_curve.json`` (one
  point per trained drafter; the GPU stage's run adds its own).

Each plot's title names its machine, threads and commit (read from the result file).
"""

from __future__ import annotations

import csv
import json
import re
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "plots"


def _newest(rows: list[dict], pred) -> list[dict]:
    rows = [r for r in rows if pred(r)]
    if not rows:
        return []
    last = max(r["date"] for r in rows)
    commit = next(r["commit"] for r in rows if r["date"] == last)
    return [r for r in rows if r["commit"] == commit]


def e2e_rows() -> tuple[list[tuple[str, float]], str]:
    """(label, tokens/s) of the embedded arithmetic e2e bench and a caption."""
    rows = _newest(list(csv.DictReader((RESULTS / "e2e_cpu.csv").open())), lambda r: "e2e arith" in r["group"])
    out = []
    for r in rows:
        m = re.match(r"([\d.]+) tok/s", r["note"])
        if m:
            out.append((r["name"].removeprefix("test_"), float(m.group(1))))
    r0 = rows[0]
    return out, f"embedded arithmetic model, {r0['cpu']} {r0['cpu_isa']}, {r0['threads']} thread, {r0['commit']}"


def drafter_rows() -> tuple[list[tuple[str, float]], str]:
    runs = [json.loads(f.read_text()) for f in (RESULTS / "drafter").glob("bench_*.json")]
    runs = [r for r in runs if isinstance(r, dict) and "benchmarks" in r]  # pytest-benchmark files only
    for r in runs:  # the 1-thread rows (a run may also hold 2-thread rows)
        r["benchmarks"] = [b for b in r["benchmarks"] if b["name"].endswith("-1]")]
    # the newest run with its 1-thread baseline and more than a spot check (a second run of two rows)
    runs = [r for r in runs if any("hf_generate" in b["name"] for b in r["benchmarks"]) and len(r["benchmarks"]) >= 4]
    d = max(runs, key=lambda r: r["datetime"])
    out = [(b["name"].split("[")[1].rsplit("-", 1)[0], b["extra_info"]["tokens_per_s"]) for b in d["benchmarks"]]
    cpu = d["machine_info"].get("cpu", {}).get("brand_raw", "CPU")
    commit = d["commit_info"].get("id", "")[:7]
    return out, f"SmolLM2-135M + gated drafter, general prompts, {cpu}, 1 thread, {commit}"


def _peers(*names: str) -> dict | None:
    """The first of ``bench/results/cpu_peers/<name>`` that exists (the newest run that has the rows wanted)."""
    for name in (*names, "bench.json"):
        f = RESULTS / "cpu_peers" / name
        if f.exists():
            return json.loads(f.read_text())
    return None


def _caption(d: dict, what: str) -> str:
    cpu = d["machine_info"].get("cpu", {}).get("brand_raw", "CPU")
    commit = d["commit_info"].get("id", "")[:7]
    machine = d["benchmarks"][0]["extra_info"].get("machine", "")
    return f"{what}, {cpu}, {machine.split('(')[1].split(')')[0] if '(' in machine else ''}, {commit}"


def peers_generate_rows() -> tuple[list[tuple[str, float]], str] | None:
    d = _peers("bench_w8a8.json", "bench_int8_compiled.json", "bench_int8.json")
    if d is None:
        return None
    rows = [
        (b["name"].split("[")[1].rstrip("]"), b["extra_info"]["tokens_per_s"])
        for b in d["benchmarks"]
        if b["name"].startswith("test_generate")
    ]
    return rows, _caption(d, "SmolLM2-135M greedy, general prompts, vs llama.cpp")


def forward_rows() -> tuple[dict[tuple[str, int], list[tuple[int, float]]], str]:
    d = _peers("bench_w8a8.json", "bench_int8.json")
    if d is not None:
        curves: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
        for b in d["benchmarks"]:
            m = re.match(r"test_forward\[(\w+)-(\d+)\]", b["name"])
            if m:
                curves[(m.group(1), 256)].append((int(m.group(2)), b["stats"]["median"] * 1e3))
        return curves, _caption(d, "SmolLM2-135M forward over a 256-token cache, logits for every row")
    rows = _newest(
        list(csv.DictReader((RESULTS / "smollm2_cpu.csv").open())), lambda r: "test_forward_rows" in r["name"]
    )
    curves: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        m = re.search(r"C(\d+)-T(\d+)-(\w+)", r["name"])
        cache, t, path = int(m.group(1)), int(m.group(2)), m.group(3)
        curves[(path, cache)].append((t, float(r["median_ms"])))
    r0 = rows[0]
    return curves, f"SmolLM2-135M forward, fp32, {r0['cpu']} {r0['cpu_isa']}, {r0['threads']} thread, {r0['commit']}"


def main() -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install matplotlib (or the docs extra)", file=sys.stderr)
        return 1
    OUT.mkdir(parents=True, exist_ok=True)

    panels = [e2e_rows(), drafter_rows()]
    if (peers := peers_generate_rows()) is not None:
        panels.append(peers)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2))
    for ax, (rows, caption) in zip(axes, panels, strict=True):
        base = next(v for n, v in rows if "hf_generate" in n)
        names = [n for n, _ in rows]
        vals = [v for _, v in rows]
        colors = [
            "#999999"
            if n.startswith("hf")
            else "#d98c1f"
            if n.startswith("llama")
            else "#3a9a4a"
            if n == "vllm"
            else "#2a6fbb"
            for n in names
        ]
        ax.barh(names, vals, color=colors)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.0f} ({v / base:.2f}x)", va="center", fontsize=8)
        ax.set_xlabel("tokens/s (grey: HF transformers; orange: llama.cpp; green: vLLM; blue: sbd_ext)")
        ax.set_title(caption, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(vals) * 1.35)
    fig.tight_layout()
    fig.savefig(OUT / "tokens_per_s.png", dpi=110)
    plt.close(fig)

    curves, caption = forward_rows()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    names = {"ours": "sbd_ext", "sbd_ext": "sbd_ext", "baseline": "HF (sdpa, torch linears)", "hf": "HF (sdpa)"}
    names.update(llama_f32="llama.cpp F32", llama_q8_0="llama.cpp Q8_0", sbd_ext_int8="sbd_ext, int8 weights")
    names.update(sbd_ext_compiled="sbd_ext, compiled", sbd_ext_int8_compiled="sbd_ext, int8, compiled")
    names.update(sbd_ext_w8a8="sbd_ext, w8a8")
    for (path, cache), pts in sorted(curves.items()):
        pts.sort()
        style = "-" if path.startswith(("ours", "sbd_ext")) else "--"
        label = f"{names.get(path, path)}, cache {cache}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
    ax.set_xlabel("new rows in the forward (1 = NTP; 1 + k or 2k = an SBD forward)")
    ax.set_ylabel("ms per forward")
    ax.set_title(caption, fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(OUT / "forward_cost.png", dpi=110)
    plt.close(fig)
    if DATA_CURVE.exists():
        _drafter_data_plot(plt)
    print(f"wrote the plots under {OUT}")
    return 0


DATA_CURVE = RESULTS / "drafter" / "data_curve.json"


def _drafter_data_plot(plt) -> None:
    d = json.loads(DATA_CURVE.read_text())
    pts = sorted(d["points"], key=lambda p: p["answer_tokens"])
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for key, label in (("verify", "verify k=2"), ("verify_lookup", "verify k=2 + lookup 16")):
        xs = [p["answer_tokens"] for p in pts if key in p]
        ax.plot(xs, [p[key] for p in pts if key in p], "-", marker="o", label=label)
    for p in pts:
        ax.annotate(
            p["label"],
            (p["answer_tokens"], p.get("verify_lookup", p.get("verify"))),
            fontsize=7,
            xytext=(0, 6),
            textcoords="offset points",
            ha="center",
        )
    for y, what in ((1.75, "issue 62's bar, CPU path"), (2.2, "issue 62's bar")):
        ax.axhline(y, color="#999999", ls="--", lw=0.8)
        ax.text(pts[0]["answer_tokens"], y, f" {what}", fontsize=7, va="bottom", color="#666666")
    ax.set_ylim(1.0, 2.4)
    ax.set_xlim(pts[0]["answer_tokens"] / 1.6, pts[-1]["answer_tokens"] * 1.6)
    ax.set_xscale("log")
    ax.set_xlabel("answer tokens the drafter was trained on (self-distilled)")
    ax.set_ylabel("tokens per forward")
    ax.set_title("\n".join(textwrap.wrap(d["caption"], 90)), fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(OUT / "drafter_data.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
