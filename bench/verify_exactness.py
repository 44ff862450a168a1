"""Verify decoding == next-token decoding, token for token, under every weight scheme (issue 61): the shipped
SmolLM2 gated drafter (its recommended settings: verify k=2 + lookup + sampler head) against ``mode="ntp"`` on the
same quantised model, on held-out chat prompts the drafter never saw, greedy, 1 thread, eager. Writes one JSON per
run (per scheme: prompts equal, the first differing token of each prompt that differs, tokens per forward).

    python bench/verify_exactness.py --out bench/results/invariance/verify_exactness_zen3.json --prompts 20 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from forward_cost import cpu_class  # bench/

import sbd_ext
from sbd_ext.demo import models
from sbd_ext.recipes.drafter.prompts import eval_prompts
from sbd_ext.recipes.smollm2 import chat_prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--schemes", default="plain,packed,int8,w8a8,bf16")
    a = ap.parse_args()
    torch.set_num_threads(1)
    prompts = eval_prompts()
    step = max(1, len(prompts) // a.prompts)
    chosen = [p["text"] for p in prompts[::step]][: a.prompts]  # spread over the kinds
    result = {
        "cpu": cpu_class(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "prompts": len(chosen),
        "new_tokens": a.tokens,
        "schemes": {},
    }
    for scheme in a.schemes.split(","):
        dtype = torch.bfloat16 if scheme == "bf16" else torch.float32
        quant = None if scheme in ("plain", "bf16") else scheme
        model, tok = models.load("smollm2-drafter", dtype=dtype, quantize=quant)
        equal, diffs, tpf, t0 = 0, [], [], time.perf_counter()
        tokens = forwards = 0
        for i, text in enumerate(chosen):
            ids = torch.tensor([chat_prompt(tok, text)])
            ntp = sbd_ext.generate(model, ids, mode="ntp", verify=False, max_new_tokens=a.tokens)
            ver = sbd_ext.generate(model, ids, max_new_tokens=a.tokens)
            n, v = ntp.sequences[0].tolist(), ver.sequences[0].tolist()
            if n == v:
                equal += 1
            else:
                at = next((j for j, (x, y) in enumerate(zip(n, v, strict=False)) if x != y), min(len(n), len(v)))
                diffs.append({"prompt": i, "first_difference_at": at - ids.shape[1]})
            tpf.append(float(ver.tokens_per_forward.item()))
            tokens, forwards = tokens + int(ver.num_generated.sum()), forwards + int(ver.nfe.sum())
            print(f"{scheme} prompt {i}: {'equal' if n == v else 'DIFFERENT'}", flush=True)
        result["schemes"][scheme] = {
            "equal": equal,
            "of": len(chosen),
            "differences": diffs,
            # all prompts' tokens over all their forwards (what generate and the drafter
            # eval report), and the mean of each prompt's own ratio (short answers weigh
            # as much as long ones)
            "verify_tokens": tokens,
            "verify_forwards": forwards,
            "verify_tokens_per_forward": tokens / max(forwards, 1),
            "verify_tokens_per_forward_mean_over_prompts": sum(tpf) / len(tpf),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(scheme, result["schemes"][scheme], flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
