"""One call of each sbd_ext op at a named shape: the program that profilers and sanitizers wrap.

    python3 bench/gpu_cases.py attn-4k attn-32k entropy          # what `bash bench/run_gpu.sh ncu` profiles
    python3 bench/gpu_cases.py all --small                       # what compute-sanitizer runs (small shapes)
    python3 bench/gpu_cases.py all --small --device cpu          # the CPU dry run of both

Under ncu every kernel launch is replayed with the caches flushed, so a case makes exactly one call of its op (no
warm-up): each kernel of the op appears once in the profile. Shapes: Llama-3.1-8B (32 q / 8 KV heads, D 128,
vocab 128256), bf16, batch 1, 16 set-block rows; --small shrinks the cache to 300 rows and the vocabulary to 4099
(compute-sanitizer's racecheck runs kernels ~100x slower) but keeps several cache splits and the merge.
"""

from __future__ import annotations

import argparse
import sys

import torch

import sbd_ext


def attention(device: str, cache_len: int, small: bool) -> None:
    Hq, Hkv, D, T, c = 32, 8, 128, 16, 0
    L = 300 if small else cache_len
    dt = torch.bfloat16
    q = torch.randn(1, Hq, T, D, device=device, dtype=dt)
    k, v = torch.randn(2, 1, Hkv, T, D, device=device, dtype=dt)
    kc, vc = torch.randn(2, 1, Hkv, L + T, D, device=device, dtype=dt)
    lens, commit, valid = (torch.tensor([x], device=device, dtype=torch.int32) for x in (L, c, T))
    sbd_ext.block_attention(q, k, v, kc, vc, lens, commit, valid, D**-0.5)


def entropy(device: str, small: bool) -> None:
    x = torch.randn(16, 4099 if small else 128256, device=device, dtype=torch.bfloat16) * 3
    sbd_ext.entropy_sample(x, 0.0)
    sbd_ext.entropy_sample(x, 0.8, 1, 2)


def mask_replace(device: str) -> None:
    tokens = torch.zeros(16, 16, dtype=torch.int64, device=device)
    proposals = torch.randint(1, 1000, (16, 16), device=device)
    ent, conf = torch.rand(2, 16, 16, device=device)
    sbd_ext.mask_replace(tokens, proposals, ent, conf, 0, "eb", 0.35)


CASES = {
    "attn-4k": lambda dev, small: attention(dev, 4096, small),
    "attn-32k": lambda dev, small: attention(dev, 32768, small),
    "entropy": entropy,
    "mask_replace": lambda dev, small: mask_replace(dev),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+", choices=[*CASES, "all"])
    ap.add_argument("--small", action="store_true", help="small shapes (for compute-sanitizer)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (the runbook's dry run)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not (torch.cuda.is_available() and sbd_ext.build_info()["cuda"]):
        print("gpu_cases: needs a GPU and sbd_ext built with CUDA (or --device cpu)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    for name in CASES if "all" in args.cases else args.cases:
        CASES[name](args.device, args.small)
        if args.device == "cuda":
            sbd_ext.ops.check_cuda_errors()  # synchronises; raises a length error a kernel recorded
        print(f"gpu_cases: {name} ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
