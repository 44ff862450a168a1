"""The drafter recipe's command line: ``data``, ``train``, ``head``, ``store``, ``eval`` and ``ship`` over one run
folder (:mod:`sbd_ext.recipes.drafter` for a model of your own, :mod:`sbd_ext.recipes.smollm2.drafter` for SmolLM2).
Arguments are checked before anything is loaded; errors are one line (:mod:`.args`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ... import drafter as drafter_mod
from .args import PRECISIONS, TRAIN_INTS, base_path, check_args, count, guarded, number
from .bases import MODELS, PROMPT_SOURCES, TASKS, DrafterConfig, artifact_base, artifact_task
from .data import make_samples
from .evaluate import evaluate
from .head import train_head
from .ship import ship
from .store import build_store
from .train import train

BASE_HELP = (
    "a local HF model folder (a Llama-family causal LM with its tokenizer) to draft for instead of SmolLM2: its "
    "own answers, its chat template (plain text without one), its EOS; the drafter loads over that folder"
)


@guarded  # errors: one line on stderr, exit code 1 (.args)
def main(argv: list[str] | None = None, prog: str = "python -m sbd_ext.recipes.drafter", description: str = "") -> int:
    """Parse ``argv`` and run its stage; 0 on success."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("--out", required=True)
    d.add_argument("--n", type=count(1), default=1024)
    d.add_argument("--max-new-tokens", type=count(1), default=128)
    d.add_argument("--batch-size", type=count(1), default=16)
    d.add_argument("--threads", type=count(1))
    d.add_argument("--task", choices=sorted(TASKS), default="general")
    d.add_argument(
        "--prompts",
        choices=PROMPT_SOURCES,
        default="templates",
        help="templates: the prompt generator; self: instructions the base writes itself (general task)",
    )
    d.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    d.add_argument("--base", help=BASE_HELP)
    d.add_argument("--device", default="cpu", help="where the base answers (cuda: larger --batch-size)")
    t = sub.add_parser("train")
    t.add_argument("--out", required=True)
    t.add_argument("--resume", action="store_true")
    t.add_argument("--threads", type=count(1))
    for f in ("steps", "batch_size", "max_len", "rank", "warmup", "seed", "checkpoint_every", "log_every"):
        t.add_argument("--" + f.replace("_", "-"), type=TRAIN_INTS[f])
    t.add_argument("--lr", type=number(0.0, above=True))
    t.add_argument("--full-block-prob", type=number(0.0, 1.0))
    t.add_argument("--block-size-range", type=count(1), nargs=2, metavar=("MIN", "MAX"))
    t.add_argument(
        "--no-first-slot-loss",
        dest="first_slot_loss",
        action="store_false",
        default=None,
        help="leave a fully masked block's first slot out of the loss (verify takes that token from the commit row)",
    )
    t.add_argument(
        "--divergence", choices=list(drafter_mod.DIVERGENCES), help="distill_loss's per-position term (default: kl)"
    )
    t.add_argument(
        "--init-from", help="a drafter folder of --rank or a lower rank (grown) to continue (fresh optimizer)"
    )
    t.add_argument(
        "--no-bucket",
        dest="bucket",
        action="store_false",
        default=None,
        help="random batches instead of batches of samples of about one length (more padding)",
    )
    t.add_argument("--task", choices=sorted(TASKS), help="default: general")
    t.add_argument("--base", help=BASE_HELP)
    t.add_argument("--device", default="cpu")
    t.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="bf16: the forward under bf16 autocast; auto: bf16 on a GPU or a CPU with AMX / AVX512-BF16",
    )
    e = sub.add_parser("eval")
    e.add_argument("--artifact", required=True)
    e.add_argument("--n", type=count(1), default=16)
    e.add_argument("--max-new-tokens", type=count(1), default=64)
    e.add_argument("--block-sizes", type=count(1), nargs="*", default=[4, 8])
    e.add_argument("--thresholds", type=number(), nargs="*", default=[0.35, 1.0], help="entropy bounds of verify rows")
    e.add_argument("--plain-thresholds", type=number(), nargs="*", default=[0.35], help="entropy bounds of SBD rows")
    e.add_argument("--lookups", type=count(0), nargs="*", default=[0], help="verify rows' lookup (drafts per cycle)")
    e.add_argument("--branches", type=int, nargs="*", choices=[0, 1], default=[0], help="verify rows' branch (1: on)")
    e.add_argument(
        "--alternates", type=count(0), nargs="*", default=[0], help="verify + branch rows' alternates (0: off)"
    )
    e.add_argument(
        "--slot-accuracy",
        type=count(0),
        default=0,
        metavar="K",
        help="also the drafter's teacher-forced accuracy per slot of fully masked blocks of K on the base's answers",
    )
    e.add_argument(
        "--sampler-heads",
        type=int,
        nargs="*",
        choices=[0, 1],
        default=[1],
        help="verify rows with (1) and without (0) the drafter's sampler head, where it has one",
    )
    e.add_argument("--threads", type=count(1))
    e.add_argument("--json", help="write the rows here")
    e.add_argument("--device", default="cpu")
    hd = sub.add_parser("head", help="train a sampler head for a drafter (slot 1 given slot 0's token)")
    hd.add_argument("--out", required=True)
    hd.add_argument("--artifact", default=str(MODELS / "smollm2-drafter"))
    hd.add_argument("--samples", nargs="+", required=True, help="samples.pt files of `data` (the base's answers)")
    hd.add_argument("--limit", type=count(1), help="the first N samples of each file")
    hd.add_argument("--epochs", type=count(1), default=5)
    hd.add_argument("--hidden", type=count(1), default=512)
    hd.add_argument("--topk", type=count(1), default=64)
    hd.add_argument("--seed", type=int, default=0)
    hd.add_argument("--threads", type=count(1))
    st = sub.add_parser("store", help="a draft store for a drafter (n-gram -> next token over the base's answers)")
    st.add_argument("--out", required=True)
    st.add_argument("--artifact", default=str(MODELS / "smollm2-drafter"))
    st.add_argument("--samples", nargs="+", required=True, help="samples.pt files of `data` (the base's answers)")
    st.add_argument("--limit", type=count(1), help="the first N samples of each file")
    st.add_argument("--n-max", type=count(1, 64), default=4, help="the longest n-gram matched")
    st.add_argument("--n-min", type=count(1), default=2, help="the shortest n-gram matched")
    st.add_argument("--min-count", type=count(1), default=3, help="times the follower followed the n-gram, at least")
    st.add_argument("--min-share", type=number(0.0, 1.0), default=0.6, help="its share of the n-gram's followers")
    s = sub.add_parser("ship")
    s.add_argument("--out", required=True)
    s.add_argument("--dest", help="default: the embedded folder of the run's task (smollm2-drafter, ...)")
    s.add_argument("--block-size", type=count(1), default=8)
    s.add_argument("--sampler", default="eb")
    s.add_argument("--threshold", type=number(), default=0.35)
    s.add_argument("--lookup", type=count(0), default=0, help="drafts from the context per cycle (0: off)")
    s.add_argument("--branch", action="store_true", help="recommend verify's branch (behind the verified token)")
    s.add_argument("--alternates", type=count(0), default=0, help="recommend verify's alternates (with --branch)")
    s.add_argument("--check-n", type=count(1), default=8)
    s.add_argument("--max-new-tokens", type=count(1), help="default: 96 for arith (its answers), else 64")
    s.add_argument("--threads", type=count(1))
    args = ap.parse_args(argv)
    check_args(ap, args)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    out = Path(getattr(args, "out", "") or ".")
    if args.cmd == "data":
        make_samples(
            out,
            args.n,
            args.max_new_tokens,
            args.batch_size,
            args.seed,
            args.task,
            args.prompts,
            args.base,
            device=args.device,
        )
    elif args.cmd == "eval":
        settings = [
            # lookup 0 / branch 0: off, whatever the artifact recommends
            dict(block_size=k, verify=True, sampler="eb", threshold=g, lookup=n, branch=bool(br))
            | ({"alternates": a} if a else {})
            for k in args.block_sizes
            for g in args.thresholds
            for n in args.lookups
            for br in args.branches
            for a in args.alternates
            if br or not a  # alternates sit beside the branch
        ]
        settings += [
            dict(block_size=k, verify=False, sampler="eb", threshold=g)
            for k in args.block_sizes
            for g in args.plain_thresholds
        ]
        if args.sampler_heads != [1]:
            settings = [
                s | {"sampler_head": bool(h)} if s["verify"] else s for s in settings for h in args.sampler_heads
            ]
            settings = list({json.dumps(s, sort_keys=True): s for s in settings}.values())
        rows = evaluate(
            Path(args.artifact), args.n, args.max_new_tokens, settings, slots=args.slot_accuracy, device=args.device
        )
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    elif args.cmd == "store":
        if args.n_min > args.n_max:
            ap.error(f"store: --n-min ({args.n_min}) must be at most --n-max ({args.n_max})")
        print(
            build_store(
                out,
                Path(args.artifact),
                [Path(p) for p in args.samples],
                args.limit,
                args.n_max,
                args.n_min,
                args.min_count,
                args.min_share,
            )
        )
    elif args.cmd == "head":
        print(
            train_head(
                out,
                Path(args.artifact),
                [Path(p) for p in args.samples],
                args.limit,
                args.epochs,
                args.hidden,
                args.topk,
                args.seed,
            )
        )
    elif args.cmd == "train":
        over = {k: v for k, v in vars(args).items() if k in DrafterConfig.__dataclass_fields__ and v is not None}
        if "block_size_range" in over:
            over["block_size_range"] = tuple(over["block_size_range"])
        if "base" in over:
            over["base"] = base_path(over["base"])
        train(out, DrafterConfig(**over), args.resume, args.threads, device=args.device, precision=args.precision)
    else:
        gen = (
            {
                "sbd_mode": "sbd",  # over the NTP control, whose own settings say "ntp"
                "sbd_block_size": args.block_size,
                "sbd_sampler": args.sampler,
                "sbd_threshold": args.threshold,
                "sbd_verify": True,
            }
            | ({"sbd_lookup": args.lookup} if args.lookup else {})
            | ({"sbd_branch": True} if args.branch else {})
            | ({"sbd_alternates": args.alternates} if args.alternates else {})
        )
        task = artifact_task(out / "artifact")
        if not args.dest and artifact_base(out / "artifact"):
            ap.error("ship: a drafter over a model of your own (--base) needs --dest (a folder of your own)")
        dest = args.dest or MODELS / TASKS[task][2]
        max_new = args.max_new_tokens or (96 if task == "arith" else 64)
        print(ship(out, Path(dest), gen, args.check_n, max_new))
    return 0
