"""Where a decoding forward's time goes with the gated SmolLM2 drafter: compiled NTP against compiled verify (the
adapters merged, and with the LoRA products), per forward.

    python bench/profile_drafter.py [--device cuda] [--prompts 4] [--max-new 64] [--no-compile] [--json PATH]
                                    [--quantize packed|bf16|w8a8]

For each row: the wall time of ``--prompts`` held-out chat prompts (greedy, batch 1, fp32; the step compiled unless
``--no-compile``: CUDA graphs on a GPU), milliseconds per forward and tokens per forward; then one prompt again
under ``torch.profiler``: the device's kernels per forward and their time per forward (CUDA: kernel time from
CUPTI, the graph replays included), the host's time per forward, and the ten costliest kernels. On a GPU the
difference between the rows' kernel time and their wall time is the host's share (Python, dispatch, the
device-to-host reads of each step's choices). The GPU runbook runs it in its ``drafter-cuda`` stage
(``bench/run_gpu.sh``); on the CPU it runs the same rows with CPU operators in place of kernels.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import sbd_ext
from sbd_ext.demo import models
from sbd_ext.recipes import smollm2
from sbd_ext.recipes.drafter.prompts import eval_prompts
from sbd_ext.recipes.smollm2 import checkpoint

ROWS = {
    "ntp": dict(mode="ntp", verify=False, merge=None),
    "verify_merged": dict(verify=True, branch=False, merge=True),
    "verify_products": dict(verify=True, branch=False, merge=False),
    "verify_branch_merged": dict(verify=True, branch=True, merge=True),  # + the branch's k rows and attention call
    "verify_branch_products": dict(verify=True, branch=True, merge=False),
}
# a quantized base (--quantize) cannot merge the adapters: its rows run the LoRA products; with a plain base the
# merged branch row says what the branch costs
PRODUCTS_ONLY = ("verify_branch_products",)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kernels(prof, device: torch.device) -> dict[str, tuple[int, float]]:
    """name -> (count, total microseconds) of the device's kernels (CUDA) or the CPU's operators (self time)."""
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if device.type == "cuda":
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()  # the kernel's own interval (graph replays' kernels included)
        else:
            if e.device_type != torch.autograd.DeviceType.CPU or not e.name.startswith(("aten::", "sbd_ext::")):
                continue
            us = e.self_cpu_time_total
        out[e.name][0] += 1
        out[e.name][1] += us
    return {k: (int(v[0]), float(v[1])) for k, v in out.items()}


def run(device: torch.device, n_prompts: int, max_new: int, compiled: bool, quantize: str | None = None) -> dict:
    model, tok = models.load("smollm2-drafter", device=device, quantize=quantize)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [torch.tensor([checkpoint.chat_prompt(tok, p["text"])], device=device) for p in eval_prompts()]
    prompts = prompts[:n_prompts]
    report = {"device": str(device), "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    report.update(prompts=len(prompts), max_new=max_new, compiled=compiled, quantize=quantize, rows={})
    for name, row in ROWS.items():
        if row["merge"] if quantize else name in PRODUCTS_ONLY:
            continue
        kw = {k: v for k, v in row.items() if k != "merge"}
        kw.update(max_new_tokens=max_new, eos_token_id=eos, compile=compiled)
        model.sbd_drafter.merge = row["merge"]
        for p in prompts:  # warm: graphs recorded, caches sized
            sbd_ext.generate(model, p, **kw)
        _sync(device)
        t0 = time.perf_counter()
        outs = [sbd_ext.generate(model, p, **kw) for p in prompts]
        _sync(device)
        wall = time.perf_counter() - t0
        fwd = sum(int(o.nfe.sum()) for o in outs)
        tokens = sum(o.sequences.shape[1] - p.shape[1] for o, p in zip(outs, prompts, strict=True))
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            t1 = time.perf_counter()
            one = sbd_ext.generate(model, prompts[0], **kw)
            _sync(device)
            prof_wall = time.perf_counter() - t1
        n1 = int(one.nfe.sum())
        kern = _kernels(prof, device)
        count = sum(c for c, _ in kern.values())
        busy = sum(us for _, us in kern.values())
        top = sorted(kern.items(), key=lambda kv: -kv[1][1])[:10]
        report["rows"][name] = dict(
            merged=bool(row.get("verify") and compiled and model.sbd_drafter.merges(model, device)),
            wall_s=round(wall, 4),
            forwards=fwd,
            tokens=tokens,
            tokens_per_s=round(tokens / wall, 2),
            tokens_per_forward=round(tokens / fwd, 3),
            ms_per_forward=round(1000 * wall / fwd, 3),
            profiled_forwards=n1,
            profiled_ms_per_forward=round(1000 * prof_wall / n1, 3),
            kernels_per_forward=round(count / n1, 1),
            kernel_ms_per_forward=round(busy / 1000 / n1, 3),
            top=[(k, c, round(us / 1000, 3)) for k, (c, us) in top],
        )
    return report


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--quantize", default=None, help="a weight scheme (packed: the CPU's fastest fp32 layout; w8a8, bf16)"
    )
    args = ap.parse_args(argv)
    if not smollm2.is_available():
        raise SystemExit(f"SmolLM2 is not available ({smollm2.INSTALL_HINT})")
    device = torch.device(args.device)
    rep = run(device, args.prompts, args.max_new, not args.no_compile, args.quantize)
    unit = "kernels" if device.type == "cuda" else "operators"
    print(f"== {rep['name']}: {rep['prompts']} prompts x {rep['max_new']}, compiled {rep['compiled']}, {args.quantize}")
    print(f"| row | merged | tok/s | tok/fwd | ms/fwd | {unit}/fwd | {unit} ms/fwd |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rep["rows"].items():
        print(
            f"| {name} | {r['merged']} | {r['tokens_per_s']} | {r['tokens_per_forward']} | {r['ms_per_forward']} | "
            f"{r['kernels_per_forward']} | {r['kernel_ms_per_forward']} |"
        )
    for name, r in rep["rows"].items():
        print(f"\n{name}: the costliest {unit} of one prompt ({r['profiled_forwards']} forwards): count, ms")
        for k, c, ms in r["top"]:
            print(f"  {ms:9.3f} ms  {c:6d}  {k[:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return rep


if __name__ == "__main__":
    main()
