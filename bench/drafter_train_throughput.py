"""The drafter's training throughput on this machine (issue 62): answer tokens trained per second (and per core) by
``python -m sbd_ext.recipes.smollm2.drafter train`` on SmolLM2-135M, with and without length buckets, in fp32 and
(where asked) bf16 autocast, the settings interleaved round by round.

    python bench/drafter_train_throughput.py [--samples RUN/samples.pt] [--steps 6] [--rounds 2] [--threads 2]
        [--precisions fp32 bf16] [--json bench/results/drafter-train/throughput_<class>.json]

Without ``--samples`` the samples are synthetic with the length profile of the base's answers (prompts of 33-50
tokens; answers of 4-128, 57 % at the 128 cap: what ``data --max-new-tokens 128`` gives): the throughput depends on
the lengths, not on the tokens. Each row trains ``--steps`` steps (the first one, warm-up, left out by the rate).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch
from forward_cost import cpu_class  # bench/

import sbd_ext
from sbd_ext.recipes.drafter.args import auto_precision
from sbd_ext.recipes.smollm2 import drafter as recipe


def synthetic(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        answer = 128 if rng.random() < 0.57 else rng.randint(4, 127)
        rows.append(
            {
                "prompt": "synthetic",
                "prompt_ids": [rng.randrange(1000, 40000) for _ in range(rng.randint(33, 50))],
                "answer_ids": [rng.randrange(1000, 40000) for _ in range(answer)],
                "task": "general",
                "source": "templates",
            }
        )
    return rows


def one(samples: list[dict], steps: int, batch: int, bucket: bool, precision: str, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        torch.save(samples, out / recipe.SAMPLES_FILE)
        cfg = recipe.DrafterConfig(
            steps=steps,
            batch_size=batch,
            lr=1e-3,
            warmup=1,
            block_size_range=(2, 5),
            full_block_prob=1.0,
            first_slot_loss=False,
            checkpoint_every=10**6,
            log_every=1,
            bucket=bucket,
        )
        rec = recipe.train(out, cfg, threads=threads, precision=precision)
    hist = [h for h in rec["history"] if "elapsed_s" in h]
    # rate over steps 2..N (the first carries one-time costs); answer tokens per step from the whole call's mean
    per_step = rec["answer_tokens_this_call"] / steps
    secs = hist[-1]["elapsed_s"] - hist[0]["elapsed_s"]
    rate = per_step * (steps - 1) / max(secs, 1e-9)
    return {
        "bucket": bucket,
        "precision": precision,
        "threads": threads,
        "steps": steps,
        "s_per_step": round(secs / (steps - 1), 3),
        "answer_tokens_per_step": round(per_step, 1),
        "answer_tokens_per_s": round(rate, 1),
        "answer_tokens_per_s_per_core": round(rate / threads, 1),
        "padding_fraction": rec["padding_fraction"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", help="a samples.pt of `data` (default: synthetic lengths)")
    ap.add_argument("--n", type=int, default=512, help="synthetic samples (the buckets' pool)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    ap.add_argument("--json")
    a = ap.parse_args()
    samples = torch.load(a.samples, weights_only=True) if a.samples else synthetic(a.n)
    rows = []
    for r in range(a.rounds):
        for precision in a.precisions:
            for bucket in (False, True):
                row = one(samples, a.steps, a.batch_size, bucket, precision, a.threads) | {"round": r}
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "cpu_class": cpu_class(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_matmul": sbd_ext.build_info()["cpu_bf16_matmul_units"],
        "auto_precision": auto_precision("cpu"),
        "samples": a.samples or f"synthetic ({a.n})",
        "rows": rows,
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
