"""Shipping a drafter: its folder with the recommended decoding settings and the record the tests re-measure
(``ship_check.json``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ... import drafter as drafter_mod
from .bases import artifact_task
from .evaluate import evaluate, verify_settings


def ship(out: Path, dest: Path, generation: dict, check_n: int = 8, max_new_tokens: int = 64) -> Path:
    """Copy ``out/artifact`` to ``dest`` with the recommended ``generation`` settings, then measure its record
    (``ship_check.json``: tokens per forward of verify at those settings on the first ``check_n`` held-out prompts,
    and how many answers equal the base's NTP decoding), which the tests re-measure."""
    src = out / "artifact"
    cfg = drafter_mod.read_drafter_config(src)
    cfg["sbd"]["generation"] = generation
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / drafter_mod.WEIGHTS_FILE, dest / drafter_mod.WEIGHTS_FILE)
    (dest / drafter_mod.CONFIG_FILE).write_text(json.dumps(cfg, indent=1) + "\n")
    ntp, row = evaluate(dest, check_n, max_new_tokens, [verify_settings(generation)])
    record = {
        "task": artifact_task(dest),
        "n": check_n,
        "max_new_tokens": max_new_tokens,
        **generation,
        "ntp_tokens": ntp["tokens"],
        "verify_nfe": row["nfe"],
        "verify_tokens_per_forward": row["tokens_per_forward"],
        "verify_equal_to_ntp": row["equal_to_ntp"],
        "threads": torch.get_num_threads(),
    } | ({"ntp_accuracy": ntp["accuracy"], "verify_accuracy": row["accuracy"]} if "accuracy" in ntp else {})
    (dest / "ship_check.json").write_text(json.dumps(record, indent=1) + "\n")
    return dest
