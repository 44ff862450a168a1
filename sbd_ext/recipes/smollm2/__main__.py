"""``python -m sbd_ext.recipes.smollm2 COMMAND``: the SmolLM2 SBD conversion, its evaluation and shipping.

train --objective sbd|ntp --out DIR [--resume]    fine-tune (resumable); DIR/<objective>/artifact
eval  --out DIR --part control|sbd|table          Table 1 on held-out problems (each part can run alone;
                                                  "table" merges them into --results: JSON, Markdown, plot)
ship  --out DIR --block-size K --threshold G      the SBD artifact -> sbd_ext/demo/models/smollm2-sbd
ship-control --out DIR                           the NTP control -> sbd_ext/demo/models/smollm2-ntp
ppl   --out DIR                                   perplexity of base / control / SBD model on the docstrings
                                                  of Python's standard library -> --results/perplexity.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ...demo import models as demo_models
from ...demo.argtypes import int_in
from ...demo.evaluate import save_results
from . import checkpoint, evaluate
from .finetune import OBJECTIVES, FinetuneConfig, run_dir, train, train_with_trainer


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sbd_ext.recipes.smollm2", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="fine-tune one objective (SBD or the NTP control), resumable")
    t.add_argument("--objective", choices=OBJECTIVES, default="sbd")
    t.add_argument("--out", required=True, help="run folder; the objective's results go to OUT/<objective>/")
    t.add_argument("--resume", action="store_true", help="continue from OUT/<objective>/checkpoint.pt")
    t.add_argument("--smoke", action="store_true", help="a few steps on 4 fixed problems (the loss falls visibly)")
    t.add_argument("--steps", type=int_in(1))
    t.add_argument("--batch-size", type=int_in(1))
    t.add_argument("--max-len", type=int_in(1))
    t.add_argument("--lr", type=float)
    t.add_argument("--warmup", type=int)
    t.add_argument("--method", choices=("lora", "attn", "full"))
    t.add_argument("--lora-rank", type=int_in(1))
    t.add_argument("--seed", type=int)
    t.add_argument("--log-every", type=int_in(1))
    t.add_argument("--checkpoint-every", type=int_in(1))
    t.add_argument("--threads", type=int_in(1), help="torch intra-op threads (default: torch's)")
    t.add_argument(
        "--rehearsal",
        type=int,
        help="per step, the next-token loss on this many of the base model's own samples (keeps general text)",
    )
    t.add_argument("--rehearsal-len", type=int_in(1), help="tokens per rehearsal sample (default 128)")
    t.add_argument("--rehearsal-weight", type=float, help="weight of the rehearsal loss (default 1.0)")
    t.add_argument("--device", default="cpu")
    t.add_argument(
        "--init-from",
        help="continue a conversion: start the trainable tensors from this artifact (a folder, or 'smollm2-sbd')",
    )
    t.add_argument(
        "--hf-trainer",
        action="store_true",
        help="train through SBDTrainer (transformers' Trainer): run it under `accelerate launch` for DDP / FSDP",
    )
    e = sub.add_parser("eval", help="Table 1 on held-out problems")
    e.add_argument("--out", required=True, help="the run folder of `train` (OUT/sbd/artifact, OUT/ntp/artifact)")
    e.add_argument("--part", choices=("control", "sbd", "table"), required=True)
    e.add_argument("--n", type=int_in(1), default=500)
    e.add_argument("--batch-size", type=int_in(1), default=50)
    e.add_argument("--results", default="bench/results/smollm2_sbd", help="where `table` writes its files")
    e.add_argument("--tag", default="", help="name of this SBD part (parts run in parallel processes)")
    e.add_argument("--samplers", nargs="*", default=list(evaluate.SAMPLERS))
    e.add_argument("--block-sizes", nargs="*", type=int_in(1), default=list(evaluate.BLOCK_SIZES))
    e.add_argument("--gammas", nargs="*", type=float, default=list(evaluate.GAMMAS))
    e.add_argument("--verify-block-sizes", nargs="*", type=int_in(1), default=list(evaluate.VERIFY_BLOCK_SIZES))
    e.add_argument("--no-ntp-row", action="store_true", help="skip the SBD model's NTP-decoding row in this part")
    e.add_argument("--threads", type=int_in(1))
    p = sub.add_parser("ppl", help="perplexity on Python standard-library docstrings")
    p.add_argument("--out", required=True)
    p.add_argument("--results", default="bench/results/smollm2_sbd")
    p.add_argument("--max-tokens", type=int_in(1), default=16384)
    p.add_argument("--threads", type=int_in(1))
    s = sub.add_parser("ship", help="copy the SBD artifact into the package as the embedded model smollm2-sbd")
    s.add_argument("--out", required=True)
    s.add_argument("--block-size", type=int_in(1), required=True)
    s.add_argument("--sampler", default="eb")
    s.add_argument("--threshold", type=float, required=True)
    s.add_argument("--check-n", type=int_in(1), default=100)
    s.add_argument("--verify", action="store_true", help="recommend lossless verify mode")
    s.add_argument("--dest", default=str(Path(__file__).resolve().parents[2] / "demo" / "models" / "smollm2-sbd"))
    s.add_argument("--threads", type=int_in(1))
    c = sub.add_parser("ship-control", help="copy the NTP control's artifact into the package as smollm2-ntp")
    c.add_argument("--out", required=True)
    c.add_argument("--check-n", type=int_in(1), default=100)
    c.add_argument("--dest", default=str(checkpoint.CONTROL_ARTIFACT))
    c.add_argument("--threads", type=int_in(1))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if args.command == "train":
        fields = {
            name: getattr(args, name)
            for name in (
                "steps",
                "batch_size",
                "max_len",
                "lr",
                "warmup",
                "method",
                "lora_rank",
                "seed",
                "rehearsal",
                "rehearsal_len",
                "rehearsal_weight",
            )
            if getattr(args, name) is not None
        }
        fields.update({k: getattr(args, k) for k in ("log_every", "checkpoint_every") if getattr(args, k)})
        if args.init_from:
            fields["init_from"] = str(demo_models.path(args.init_from))
        if args.smoke:
            fields = {
                "steps": 8,
                "batch_size": 2,
                "max_len": 96,
                "fixed_data": 4,
                "warmup": 0,
                "log_every": 1,
                "lr": 3e-3 if fields.get("method", "lora") == "lora" else 3e-4,
                **fields,
            }
        cfg = FinetuneConfig(objective=args.objective, **fields)
        if args.hf_trainer:
            train_with_trainer(cfg, args.out)
        else:
            train(cfg, args.out, resume=args.resume, device=args.device)
    elif args.command == "eval":
        _eval(args)
    elif args.command == "ship":
        artifact = run_dir(args.out, "sbd") / "artifact"
        check = evaluate.check_record(
            artifact, args.check_n, args.block_size, args.sampler, args.threshold, args.verify
        )
        print(json.dumps(check))
        evaluate.ship(artifact, args.dest, args.block_size, args.sampler, args.threshold, check, args.verify)
    elif args.command == "ship-control":
        artifact = run_dir(args.out, "ntp") / "artifact"
        check = evaluate.check_record_ntp(artifact, args.check_n)
        print(json.dumps(check))
        evaluate.ship_control(artifact, args.dest, check)
    elif args.command == "ppl":
        result = evaluate.perplexity_table(
            {
                "base": None,
                "ntp_control": run_dir(args.out, "ntp") / "artifact",
                "sbd": run_dir(args.out, "sbd") / "artifact",
            },
            max_tokens=args.max_tokens,
        )
        evaluate.save_json(result, Path(args.results) / "perplexity.json")
    return 0


def _eval(args) -> None:
    control_file = Path(args.out) / "eval_control.json"
    if args.part == "table":
        sbd_files = sorted(Path(args.out).glob("eval_sbd*.json"))
        if not control_file.is_file() or not sbd_files:
            raise SystemExit("run `eval --part control` and at least one `eval --part sbd` first")
        parts = [json.loads(f.read_text()) for f in sbd_files]
        result = evaluate.merge_tables(json.loads(control_file.read_text()), *parts)
        files = save_results(result, args.results, evaluate.GAMMAS[0], evaluate.GAMMAS[1], "eb")
        evaluate.plot_curves(args.out, Path(args.results) / "training_curves.png")
        print(Path(files["table"]).read_text())
        return
    if args.part == "control":
        result = evaluate.table1(None, run_dir(args.out, "ntp") / "artifact", args.n, args.batch_size)
        evaluate.save_json(result, control_file)
        return
    result = evaluate.table1(
        run_dir(args.out, "sbd") / "artifact",
        None,
        args.n,
        args.batch_size,
        samplers=args.samplers,
        block_sizes=args.block_sizes,
        gammas=args.gammas,
        verify_block_sizes=args.verify_block_sizes,
        sbd_model_ntp_row=not args.no_ntp_row,
    )
    evaluate.save_json(result, Path(args.out) / f"eval_sbd{'_' + args.tag if args.tag else ''}.json")


if __name__ == "__main__":
    sys.exit(main())
