"""Where a compiled decoding step's time goes on a GPU (the H200 run 3 profile, bench/results/gpu-h200/README.md):
time per forward of compiled NTP, verify and verify without lookup with the shipped SmolLM2 drafter on four held-out
prompts x 64 tokens, then a cProfile of each (host time by function).

    python bench/studies/gpu_profile_h200_run3.py        # needs a CUDA GPU
"""

import cProfile
import pstats
import time

import torch

import sbd_ext
from sbd_ext.demo import models
from sbd_ext.recipes.drafter.prompts import eval_prompts
from sbd_ext.recipes.smollm2 import checkpoint

SETTINGS = [
    ("ntp", dict(mode="ntp", verify=False, compile=True)),
    ("verify", dict(verify=True, compile=True)),
    ("verify_nolookup", dict(verify=True, lookup=0, compile=True)),
]


def main() -> None:
    dev = torch.device("cuda")
    model, tok = models.load("smollm2-drafter", device=dev)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ps = [torch.tensor([checkpoint.chat_prompt(tok, p["text"])], device=dev) for p in eval_prompts()[:4]]
    for name, kw in SETTINGS:
        kw = kw | dict(max_new_tokens=64, eos_token_id=eos)
        for p in ps:  # warm-up (compilation)
            sbd_ext.generate(model, p, **kw)
        torch.cuda.synchronize()
        t, nfe, n = time.perf_counter(), 0, 0
        for p in ps:
            o = sbd_ext.generate(model, p, **kw)
            nfe += int(o.nfe.sum())
            n += o.sequences.shape[1] - p.shape[1]
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        print(f"== {name}: {dt:.3f} s, {nfe} fwd, {1000 * dt / nfe:.2f} ms/fwd, {n / dt:.1f} tok/s", flush=True)
        pr = cProfile.Profile()
        pr.enable()
        for p in ps:
            sbd_ext.generate(model, p, **kw)
        torch.cuda.synchronize()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
        pstats.Stats(pr).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
