"""Shared benchmark plumbing: a ratio table at the end of the run, and an optional CSV with the conditions.

Every benchmark sets ``benchmark.extra_info["role"]`` to "ours", "reference" (sbd_ext.reference) or "baseline"
(the best existing alternative, e.g. SDPA or the PyTorch composite), and ``benchmark.group`` to the work
measured. At the end, per group, the table gives each entry's median and how many times faster "ours" is than
the others in the same run. ``--sbd-csv PATH`` appends the rows with machine, torch version and git commit.
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
import subprocess

import torch

import sbd_ext


def pytest_addoption(parser):
    parser.addoption("--sbd-csv", default=None, help="append benchmark rows (with machine/versions) to this CSV")


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(__file__)
        ).stdout.strip()
    except OSError:
        commit = ""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "cpu_isa": sbd_ext.build_info()["cpu_isa"],
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "commit": commit,
    }


def _rows(session):
    bs = getattr(session.config, "_benchmarksession", None)
    if bs is None:
        return []
    rows = []
    for b in bs.benchmarks:
        if b.stats is None or not getattr(b.stats, "rounds", 0):
            continue
        info = b.extra_info or {}
        rows.append(
            {
                "group": b.group or "",
                "name": b.name,
                "role": info.get("role", ""),
                "median_ms": b.stats.median * 1e3,
                "min_ms": b.stats.min * 1e3,
                "gbps": info.get("GB/s", ""),
                "note": info.get("note", ""),
            }
        )
    return rows


def pytest_sessionfinish(session, exitstatus):
    rows = _rows(session)
    if not rows:
        return
    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    info = machine_info()
    lines = [
        f"\nsbd_ext benchmark summary — {info['cpu']} ({info['threads']} threads, {info['cpu_isa']}) "
        f"{info['gpu']} torch {info['torch']} commit {info['commit']}",
        "| group | name | role | median ms | GB/s | ours is N× faster |",
        "|---|---|---|---|---|---|",
    ]
    for g, rs in groups.items():
        ours = [r for r in rs if r["role"] == "ours"]
        for r in rs:
            speed = ""
            if r["role"] != "ours" and ours:
                best = min(o["median_ms"] for o in ours)
                speed = f"{r['median_ms'] / best:.2f}"
            gb = f"{r['gbps']:.1f}" if isinstance(r["gbps"], (int, float)) else ""
            lines.append(f"| {g} | {r['name']} | {r['role']} | {r['median_ms']:.3f} | {gb} | {speed} |")
    print("\n".join(lines))
    path = session.config.getoption("--sbd-csv")
    if path:
        new = not os.path.exists(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["date", *info.keys(), *rows[0].keys()])
            if new:
                w.writeheader()
            now = datetime.datetime.now().isoformat(timespec="seconds")
            for r in rows:
                w.writerow({"date": now, **info, **r})
