"""What the device-resident decoding cycle (``generate(..., cycle="device")``) changes against the host cycle, both
compiled, paired prompt by prompt on the same weights (greedy, batch 1):

    python bench/bench_device_cycle.py                 # arith + chat on this machine (~15 min cold on 2 cores)
    python bench/bench_device_cycle.py --device cuda   # on a GPU (the runbook's e2e stage)
    python bench/bench_device_cycle.py --quick --out D # a tiny eager dry run (CI)

- ``arith``: the embedded SBD model (sbd-arith) on held-out problems: NTP, SBD and verify, each with the host cycle
  and the device cycle.
- ``chat``: SmolLM2-135M-Instruct + its gated drafter (smollm2-drafter) on held-out chat prompts: NTP, and verify
  k=2 without lookup (what the device cycle runs), each both ways; verify with the recommended lookup (host) beside
  them for reference.

Each row: tokens/s, tokens per forward, the device cycle's speed against the host cycle of the same mode
(``vs_host_cycle``) and every row against the host cycle's compiled NTP (``vs_own_ntp``); answers equal between
the cycles. Writes ``bench/results/device_cycle/<class>.json`` and its table ``<class>.md`` (included on the
benchmarks page); ``--render FILE.json`` rewrites the table from a results file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from sbd_ext.demo import models, tasks
from sbd_ext.demo.evaluate import format_prompt

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/'s helpers, also under PYTHONSAFEPATH (the runbook)
from report import _chat_prompts, commit, machine, paired, sbd_decoder  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "device_cycle"


def _rows(runs: dict, pairs: dict, own_ntp: str) -> list[dict]:
    out = []
    for name, r in runs.items():
        toks = sum(len(a) for a in r["answers"])
        row = {
            "decoder": name,
            "tokens": toks,
            "seconds": round(r["seconds"], 3),
            "tokens_per_s": round(toks / r["seconds"], 2),
            "tokens_per_forward": round(toks / max(r["forwards"], 1), 3),
            "vs_own_ntp": round(runs[own_ntp]["seconds"] / r["seconds"], 3),
        }
        if name in pairs:  # the device cycle against the host cycle of the same mode
            host = runs[pairs[name]]
            row["vs_host_cycle"] = round(host["seconds"] / r["seconds"], 3)
            row["answers_equal_host_cycle"] = host["answers"] == r["answers"]
        out.append(row)
    return out


def _both_cycles(model, max_new, eos, compiled: bool, modes: dict) -> tuple[dict, dict]:
    decoders, pairs = {}, {}
    for label, kw in modes.items():
        decoders[f"{label}, host cycle"] = sbd_decoder(model, max_new, eos, compile=compiled, **kw)
        decoders[f"{label}, device cycle"] = sbd_decoder(model, max_new, eos, compile=compiled, cycle="device", **kw)
        pairs[f"{label}, device cycle"] = f"{label}, host cycle"
    return decoders, pairs


def suite_arith(device, n: int, max_new: int, compiled: bool) -> dict:
    model, tok = models.load(models.DEFAULT_MODEL, device=device)
    info = models.demo_info(models.DEFAULT_MODEL)
    probs = list(tasks.problems("test", n))
    prompts = [
        tok(format_prompt(p.prompt, info.get("prompt_template")), return_tensors="pt").input_ids.to(device)
        for p in probs
    ]
    sbd = dict(block_size=info["block_size"], sampler=info["sampler"], threshold=info["gamma_low"])
    modes = {
        "NTP": dict(mode="ntp", verify=False),
        "SBD": dict(verify=False, **sbd),
        "verify": dict(verify=True, **sbd),
    }
    decoders, pairs = _both_cycles(model, max_new, tok.eos_token_id, compiled, modes)
    runs = paired(decoders, prompts)
    return {
        "what": f"embedded sbd-arith, {n} held-out problems, up to {max_new} new tokens, fp32; SBD k="
        f"{info['block_size']}, entropy bound {info['gamma_low']}",
        "rows": _rows(runs, pairs, "NTP, host cycle"),
    }


def suite_chat(device, n: int, max_new: int, compiled: bool) -> dict:
    packed = device.type == "cpu"
    model, tok = models.load("smollm2-drafter", device=device, quantize="packed" if packed else None)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    modes = {"NTP": dict(mode="ntp", verify=False), "verify k=2": dict(verify=True, lookup=0, branch=False)}
    decoders, pairs = _both_cycles(model, max_new, eos, compiled, modes)
    decoders["verify k=2 + lookup 16 (recommended), host cycle"] = sbd_decoder(
        model, max_new, eos, compile=compiled, verify=True
    )
    runs = paired(decoders, _chat_prompts(tok, n, device))
    return {
        "what": f"SmolLM2-135M-Instruct + smollm2-drafter, {n} held-out chat prompts x {max_new} new tokens, "
        f"{'packed fp32' if packed else 'fp32'} weights",
        "rows": _rows(runs, pairs, "NTP, host cycle"),
    }


def markdown(res: dict) -> str:
    """The results as a Markdown table (what docs/benchmarks.md includes)."""
    m = res["machine"]
    lines = [
        f"{m['name']} ({m['isa']}), {m['threads']} thread(s), torch {m['torch']}, commit {m['commit']}, {m['date']}; "
        "greedy, batch 1, compiled, paired prompt by prompt",
        "",
        "| workload, decoder | tok/s | tokens per forward | × host cycle | × own compiled NTP | answers = host cycle |",
        "|---|---|---|---|---|---|",
    ]
    for name, suite in res["suites"].items():
        for r in suite["rows"]:
            host = f"{r['vs_host_cycle']:.2f}×" if "vs_host_cycle" in r else "—"
            same = {True: "yes", False: "**no**"}.get(r.get("answers_equal_host_cycle"), "—")
            lines.append(
                f"| {name}: {r['decoder']} | {r['tokens_per_s']:.1f} | {r['tokens_per_forward']:.2f} | {host} | "
                f"{r['vs_own_ntp']:.2f}× | {same} |"
            )
    lines += [""] + [f"- {name}: {suite['what']}" for name, suite in res["suites"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--suites", default="arith,chat")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny and eager: a dry run (numbers meaningless)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--render", type=Path, help="rewrite the Markdown table of this results file, run nothing")
    args = ap.parse_args(argv)
    if args.render:
        args.render.with_suffix(".md").write_text(markdown(json.loads(args.render.read_text())))
        return 0
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64
    sizes = {"arith": (30, 64), "chat": (8, 96)} if not args.quick else {"arith": (2, 8), "chat": (1, 6)}
    suites = {"arith": suite_arith, "chat": suite_chat}
    meta = machine(device) | {
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "threads": args.threads,
        "torch": torch.__version__,
        "compiled": not args.quick,
    }
    res = {"machine": meta, "suites": {}}
    for name in args.suites.split(","):
        res["suites"][name] = suites[name](device, *sizes[name], compiled=not args.quick)
        for row in res["suites"][name]["rows"]:
            print(name, json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{meta['class']}{'-quick' if args.quick else ''}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(res))
    print("wrote", path, "and its table")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
