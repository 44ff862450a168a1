"""Where one SmolLM2-135M forward's time goes (issue 36 item 2), with the roofline arithmetic.

    python bench/profile_forward.py [--rows 1 16] [--threads 1] [--quantize int8] [--json PATH]

One eager sbd_ext forward (the ``"sbd"`` backend over an :class:`SBDCache` of 256 tokens, row_linear, logits for
every new row) is run under ``torch.profiler``; each operator's self time goes to a phase: linears (the 210
projections), head (the 49153-row output layer), attention (``block_attention``), norms / RoPE / activations
(elementwise), sampling is not part of a forward. What the operators do not account for is Python and dispatch
(the wall time of the un-profiled forward minus the operators' self time measured under the profiler, scaled).

Roofline: bytes = the fp32 weights streamed once (every linear + head) + the KV cache read; FLOPs = 2 x parameters x
rows (+ attention). The bandwidth floor is bytes / the core's streaming rate (measured here by a copy of a 256 MB
buffer), with ``--quantize int8`` the int8 weights (1 byte each, plus a 4-byte scale per output row) instead; the
FMA floor FLOPs / the peak (8 fp32 lanes x 2 FMA units x 2 flops x clock for AVX2; printed, not
measured).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from sbd_forward import block_forward, prefilled_cache  # bench/
from torch.profiler import ProfilerActivity, profile

from sbd_ext.linear import use_row_linear
from sbd_ext.quantization import SCHEMES, Int8Linear, quantize
from sbd_ext.recipes.smollm2 import checkpoint

CACHE = 256
PHASES = {
    "linears": ("sbd_ext::row_linear", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm"),
    "attention": ("sbd_ext::block_attention",),
    "norms/rope/act": (
        "aten::pow",
        "aten::mean",
        "aten::rsqrt",
        "aten::mul",
        "aten::add",
        "aten::silu",
        "aten::neg",
        "aten::cat",
        "aten::to",
        "aten::_to_copy",
        "aten::copy_",
        "aten::div",
        "aten::add_",
        "aten::sum",
        "aten::div_",
    ),
}


def stream_rate_gbs() -> float:
    a = torch.empty(64 * 1024 * 1024, dtype=torch.float32).fill_(1.0)
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = max(best, 2 * a.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantize", choices=SCHEMES, default=None, help="weight format (sbd_ext.quantize)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = checkpoint.load_smollm2(attn_implementation="sbd")
    use_row_linear(model, True)
    n_params = sum(p.numel() for p in model.parameters())  # tied: the embedding is the head
    weight_bytes = n_params * 4
    if args.quantize:
        quantize(model, args.quantize)
    if args.quantize in ("int8", "w8a8"):
        q8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
        weight_bytes = sum(m.int8_weight().numel() + 4 * m.weight_scale.numel() for m in q8)
    out_layer = model.get_output_embeddings()
    # the tensor the head passes to row_linear (its shape tells the head's calls apart): packed, int8 or fp32
    head = next(
        b
        for b in (out_layer._buffers.get(n) for n in ("weight_packed", "weight_int8_packed", "weight_int8"))
        if b is not None
    ) if args.quantize else out_layer.weight
    gbs = stream_rate_gbs()
    out = {"threads": args.threads, "quantize": args.quantize, "stream_gbs": round(gbs, 1), "rows": {}}
    g = torch.Generator().manual_seed(0)
    cache = prefilled_cache(model, torch.randint(0, 49152, (1, CACHE), generator=g))
    for rows in args.rows:
        fwd = block_forward(model, cache, torch.randint(0, 49152, (1, rows), generator=g))
        for _ in range(3):
            fwd()
        times = []
        for _ in range(9):
            t = time.perf_counter()
            fwd()
            times.append(time.perf_counter() - t)
        wall = sorted(times)[len(times) // 2] * 1e3
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(3):
                fwd()
        phase = {k: 0.0 for k in (*PHASES, "head", "other ops")}
        head_ms = 0.0
        for e in prof.key_averages(group_by_input_shape=True):
            ms = e.self_cpu_time_total / 1e3 / 3
            shapes = str(e.input_shapes)
            if e.key in ("sbd_ext::row_linear", "aten::mm", "aten::linear") and str(list(head.shape)) in shapes:
                head_ms += ms
                continue
            for name, keys in PHASES.items():
                if e.key in keys:
                    phase[name] += ms
                    break
            else:
                if e.key.startswith(("aten::", "sbd_ext::")) and e.key not in ("aten::empty", "aten::view"):
                    phase["other ops"] += ms
        phase["head"] = head_ms
        profiled = sum(phase.values())
        phase["python/dispatch"] = max(wall - profiled, 0.0)
        kv_bytes = (
            2
            * model.config.num_hidden_layers
            * model.config.num_key_value_heads
            * (model.config.hidden_size // model.config.num_attention_heads)
            * CACHE
            * 4
        )
        flops = 2 * n_params * rows
        row = {
            "wall_ms": round(wall, 1),
            "phases_ms": {k: round(v, 2) for k, v in phase.items()},
            "bytes_mb": round((weight_bytes + kv_bytes) / 1e6, 1),
            "bandwidth_floor_ms": round((weight_bytes + kv_bytes) / gbs / 1e6, 1),
            "gflop": round(flops / 1e9, 2),
            "achieved_gbs": round((weight_bytes + kv_bytes) / wall / 1e6, 1),
            "achieved_gflops": round(flops / wall / 1e6, 1),
        }
        out["rows"][rows] = row
        print(f"\n{rows} new row(s) over a {CACHE}-token cache, {args.threads} thread(s): {wall:.1f} ms per forward")
        for k, v in row["phases_ms"].items():
            print(f"  {k:16s} {v:7.2f} ms  {100 * v / wall:5.1f} %")
        print(
            f"  roofline: {row['bytes_mb']} MB at {gbs:.1f} GB/s (copy rate) = {row['bandwidth_floor_ms']} ms floor; "
            f"{row['gflop']} GFLOP; achieved {row['achieved_gbs']} GB/s, {row['achieved_gflops']} GFLOP/s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
