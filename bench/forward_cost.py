"""The forward-cost curve of SmolLM2-135M on this CPU: one eager forward of T = 1 / 4 / 16 new rows over a cache of
256 rows, per weight scheme (packed fp32, w8a8), 1 thread, median of interleaved rounds. What batch invariance costs
is this curve on the invariant build against the build before it (issue 61), each run with
``PYTHONPATH=<checkout> python bench/forward_cost.py --label NAME --out FILE.csv`` and the two files compared (a
row is appended per (scheme, rows)); the CPU class and ISA go into every row.

    python bench/forward_cost.py --label invariant --out bench/results/invariance/zen3.csv --rounds 15
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from pathlib import Path

import torch
from sbd_forward import block_forward, prefilled_cache  # bench/ (run from the repository root)

import sbd_ext
from sbd_ext.recipes.smollm2 import checkpoint as smollm2

ISA_NAMES = {"amx": "AMX", "avx512": "AVX-512", "avx2": "AVX2"}


def amd_core(family: int, model: int) -> str | None:
    """The AMD core generation of a CPUID family / model (a VM's model name, "AMD EPYC", often names none)."""
    if family == 0x1A:
        return "Zen 5"
    if family == 0x19:
        return "Zen 4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF else "Zen 3"
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen / Zen+"
    return None


def cpu_model_and_isa() -> tuple[str, str]:
    """This CPU's model name (with the core generation where an AMD name lacks it) and its widest ISA class: "amx",
    "avx512", "avx2" or "?" (from /proc/cpuinfo)."""
    fields = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first processor's
    flags, name = set(fields.get("flags", "").split()), fields.get("model name", "?")
    isa = "amx" if "amx_tile" in flags else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "?"
    if fields.get("vendor_id") == "AuthenticAMD" and "Zen" not in name:
        try:
            core = amd_core(int(fields["cpu family"]), int(fields["model"]))
        except (KeyError, ValueError):
            core = None
        if core:
            name = f"{name} ({core}: family {fields['cpu family']}, model {fields['model']})"
    return name, isa


def cpu_class() -> str:
    name, isa = cpu_model_and_isa()
    return f"{name} ({ISA_NAMES.get(isa, isa)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--schemes", default="packed,w8a8")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = [int(r) for r in a.rows.split(",")]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists()
    with out.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["label", "cpu", "scheme", "rows", "cache", "median_ms", "min_ms", "rounds", "sbd_ext"])
        for scheme in a.schemes.split(","):
            model, _ = smollm2.load_smollm2(dtype=torch.float32, attn_implementation="sbd")
            sbd_ext.quantize(model, scheme)
            gen = torch.Generator().manual_seed(0)
            prefix = torch.randint(0, model.config.vocab_size, (1, 256), generator=gen)
            cache = prefilled_cache(model, prefix, spare=max(rows) + 1)
            runs = {t: block_forward(model, cache, torch.randint(0, 1000, (1, t), generator=gen)) for t in rows}
            times: dict[int, list[float]] = {t: [] for t in rows}
            for t in rows:
                runs[t]()  # warm
            for _ in range(a.rounds):
                for t in rows:  # interleaved: drift of the machine hits every row count alike
                    t0 = time.perf_counter()
                    runs[t]()
                    times[t].append((time.perf_counter() - t0) * 1e3)
            for t in rows:
                med = statistics.median(times[t])
                w.writerow([a.label, cpu_class(), scheme, t, 256, f"{med:.2f}", f"{min(times[t]):.2f}", a.rounds,
                            os.path.dirname(sbd_ext.__file__)])
                print(f"{a.label} {scheme} T={t}: median {med:.2f} ms, min {min(times[t]):.2f}", flush=True)


if __name__ == "__main__":
    main()
