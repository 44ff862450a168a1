"""Train the embedded demo models: NTP pre-training, then an SBD fine-tune and an NTP control fine-tune.

One command (CPU, fp32; reproducible from ``--seed`` for a given thread count; ~55 min at the default 1 thread on a
2-core AMD EPYC)::

    python -m sbd_ext.demo.train --out runs/demo

1. builds the project's BPE tokenizer (:mod:`sbd_ext.demo.tokenizer`, vocabulary 238; ``--tokenizer char`` for
   the character one) and a small GQA ``LlamaConfig`` (hidden 128, 4 layers, 4 query / 2 key-value heads,
   ~0.8 M parameters);
2. **pre-trains** it for 2500 steps with next-token prediction on arithmetic word problems (:mod:`sbd_ext.demo.tasks`,
   training split; loss on the answers, ``--pretrain-loss all`` for every token) -> ``OUT/pretrain``;
3. from that checkpoint, two fine-tunes with the same budget (8000 steps each; same batches in the same order, same
   optimiser and schedule; loss on the answer only):

   * **SBD**: the Set Block Decoding objective :func:`sbd_ext.training.sbd_loss` (NTP + masked-block loss, block
     size drawn per step in ``--block-sizes``, default [2, 16]) -> ``OUT/sbd``;
   * **NTP control**: plain next-token cross-entropy -> ``OUT/ntp``;
4. checks greedy next-token accuracy on held-out problems after each phase, and writes ``OUT/train_log.json``
   (all losses) next to the checkpoints (safetensors + config + generation config + tokenizer).

``--install`` then copies ``OUT/sbd`` and ``OUT/ntp`` to ``sbd_ext/demo/models/sbd-arith`` and ``.../ntp-arith``, the
embedded models that ``sbd_ext.demo.models.load_default()`` returns. Phases whose output folder already exists are
reused with ``--resume``.

Sequences are ``<bos> prompt completion <eos>`` followed by more ``<eos>`` up to the batch's longest sequence
(the first 16 of them carry a loss): an SBD block that runs past the end of the answer is then cheap to decode,
since the model has learnt that EOS follows EOS.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from ..training import IGNORE_INDEX, add_mask_token, objective_loss_fn, train_loop
from . import tasks
from .evaluate import decode
from .tokenizer import build_bpe_tokenizer, build_char_tokenizer

EOS_LOSS_TOKENS = 16  # trailing EOS positions with a loss (>= the largest block size)


# --------------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------------
def encode_problem(tok, p: tasks.Problem) -> tuple[list[int], int]:
    """Token ids of ``<bos> prompt completion <eos>`` and the number of prompt tokens (with ``<bos>``)."""
    prompt = tok(p.prompt, add_special_tokens=True).input_ids
    completion = tok(p.completion, add_special_tokens=False).input_ids
    return prompt + completion + [tok.eos_token_id], len(prompt)


def collate(tok, items: list[tuple[list[int], int]], answer_only: bool) -> dict:
    """Batch of EOS-filled sequences: input_ids [B, L] and labels [B, L] (IGNORE_INDEX = no loss)."""
    L = max(len(ids) for ids, _ in items)
    eos = tok.eos_token_id
    input_ids = torch.full((len(items), L), eos, dtype=torch.long)
    labels = torch.full((len(items), L), IGNORE_INDEX, dtype=torch.long)
    for b, (ids, n_prompt) in enumerate(items):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        end = min(L, len(ids) + EOS_LOSS_TOKENS - 1)
        labels[b, :end] = input_ids[b, :end]
        if answer_only:
            labels[b, :n_prompt] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels}


def batches(tok, seed: int, batch_size: int, answer_only: bool, group: int = 8, task: str = "arith") -> Iterator[dict]:
    """Unbounded deterministic stream of training batches from the training split of seed ``seed`` of ``task``.

    ``group`` batches' worth of problems are sorted by length and cut into batches (less EOS filling), whose order
    is then shuffled with a generator seeded by ``seed``.
    """
    rng = random.Random(seed)
    stream = tasks.problems("train", seed=seed, task=task)
    while True:
        chunk = [encode_problem(tok, next(stream)) for _ in range(group * batch_size)]
        chunk.sort(key=lambda x: len(x[0]))
        bs = [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(bs)
        for items in bs:
            yield collate(tok, items, answer_only)


# --------------------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------------------
def make_config(tok, hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        attn_implementation="sdpa",
    )


def generation_config(tok) -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=160,
        do_sample=False,
    )


def save(model, tok, folder: Path, log: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model.generation_config = generation_config(tok)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    (folder / "train_log.json").write_text(json.dumps(log, indent=1))


def load(folder: Path):
    model = LlamaForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32)
    return model


# --------------------------------------------------------------------------------------------------------
# quick held-out check (HF generate, greedy, next-token decoding)
# --------------------------------------------------------------------------------------------------------
@torch.no_grad()
def quick_accuracy(
    model, tok, n: int = 64, batch_size: int = 64, max_new_tokens: int = 160, task: str = "arith"
) -> float:
    """Greedy next-token (HF ``generate``) accuracy on the first ``n`` held-out problems."""
    model.eval()
    probs = list(tasks.problems("test", n, task=task))
    outs = []
    for i in range(0, n, batch_size):
        chunk = probs[i : i + batch_size]
        enc = tok([p.prompt for p in chunk], return_tensors="pt", padding=True, padding_side="left")
        gen = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        outs += tok.batch_decode(gen[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
    return tasks.accuracy(outs, probs)


def quick_sbd_check(
    model, tok, n: int, gamma: float = 0.1, block_size: int = 16, sampler: str = "eb", task: str = "arith"
) -> float | None:
    """Print (and return) held-out accuracy and tokens/forward of SBD decoding (None if the decoder cannot run)."""
    try:
        probs = list(tasks.problems("test", n, task=task))
        res = decode(model, tok, [p.prompt for p in probs], block_size=block_size, sampler=sampler, threshold=gamma)
    except Exception as e:  # the decoder or its kernels are not available in this build
        print(f"[sbd] (no SBD decoding check: {type(e).__name__}: {e})")
        return None
    acc = tasks.accuracy(res["completions"], probs)
    tpf = sum(res["num_generated"]) / sum(res["nfe"])
    print(f"[sbd] held-out SBD ({sampler} k={block_size}, gamma={gamma}) accuracy {acc:.3f}, {tpf:.2f} tokens/forward")
    return acc


# --------------------------------------------------------------------------------------------------------
# training loop
# --------------------------------------------------------------------------------------------------------
def train_phase(
    name: str,
    model,
    data: Iterator[dict],
    steps: int,
    lr: float,
    objective: str,
    seed: int,
    block_sizes: tuple[int, int] = (2, 16),
    warmup: int | None = None,
    log_every: int = 25,
    check=None,
    check_every: int = 0,
) -> list[dict]:
    """One phase through :func:`sbd_ext.training.train_loop`: AdamW (betas 0.9/0.95, wd 0.1), linear warm-up
    (default steps // 20) + cosine decay to 10% of ``lr``, grad clip 1.0.

    objective: "ntp" (:func:`sbd_ext.training.ntp_loss`, the HF causal-LM loss) or "sbd"
    (:func:`sbd_ext.training.sbd_loss`, k drawn per step uniformly in ``block_sizes`` from ``random.Random(seed)`` and
    the masks from a generator seeded by ``seed``); the closure is :func:`sbd_ext.training.objective_loss_fn`'s.
    ``check(model)`` every ``check_every`` steps records the held-out accuracy in the history.
    """

    gen = torch.Generator().manual_seed(seed)
    krng = random.Random(seed)
    return train_loop(
        model,
        data,
        objective_loss_fn(objective, generator=gen, k_rng=krng, block_size_range=block_sizes),
        steps,
        lr=lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        warmup_steps=max(1, steps // 20) if warmup is None else warmup,
        min_lr_ratio=0.1,
        max_grad_norm=1.0,
        log_every=log_every,
        progress="lines",
        name=name,
        eval_fn=(lambda m, step: {f"heldout_{objective}_accuracy": check(m)}) if check is not None else None,
        eval_every=check_every,
        rngs=(gen, krng),
    )


# --------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m sbd_ext.demo.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/demo", help="output folder (pretrain/, sbd/, ntp/, train_log.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: reproducible, best on a busy machine)")
    ap.add_argument(
        "--task",
        choices=("arith", "sort"),
        default="arith",
        help="training task (sbd_ext.demo.tasks): arith word problems (the embedded default) or list sort/reverse",
    )
    ap.add_argument("--tokenizer", choices=("bpe", "char"), default="bpe", help="see sbd_ext.demo.tokenizer")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--pretrain-steps", type=int, default=2500)
    ap.add_argument("--pretrain-lr", type=float, default=3e-3)
    ap.add_argument(
        "--pretrain-loss",
        choices=("answer", "all"),
        default="answer",
        help="tokens with a pre-training loss: the answers (default), or every token (questions too)",
    )
    ap.add_argument(
        "--check-every", type=int, default=250, help="held-out check every N pre-training steps (2N when fine-tuning)"
    )
    ap.add_argument("--finetune-steps", type=int, default=8000)
    ap.add_argument("--finetune-lr", type=float, default=1e-3)
    ap.add_argument("--block-sizes", type=int, nargs=2, default=[2, 16], metavar=("K_MIN", "K_MAX"))
    ap.add_argument("--eval-problems", type=int, default=64, help="held-out problems for the quick check (0: none)")
    ap.add_argument("--resume", action="store_true", help="reuse phases whose output folder exists")
    ap.add_argument("--install", action="store_true", help="copy the results into sbd_ext/demo/models/")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_bpe_tokenizer() if args.tokenizer == "bpe" else build_char_tokenizer()
    log: dict = {"args": vars(args), "phases": {}}
    t_all = time.perf_counter()

    def check(name, model):
        if args.eval_problems:
            t = time.perf_counter()
            a = quick_accuracy(model, tok, args.eval_problems, task=args.task)
            dt = time.perf_counter() - t
            print(f"[{name}] held-out greedy NTP accuracy {a:.3f} on {args.eval_problems} ({dt:.0f} s)")
            if name == "sbd":
                quick_sbd_check(model, tok, args.eval_problems, task=args.task)  # the paper's defaults (eb, k = 16)
                d = DEMO_INFO
                quick_sbd_check(
                    model, tok, args.eval_problems, d["gamma_low"], d["block_size"], d["sampler"], args.task
                )
            return a
        return None

    # 1. NTP pre-training
    pre_dir = out / "pretrain"
    if args.resume and (pre_dir / "model.safetensors").exists():
        print(f"[pretrain] reusing {pre_dir}")
        log["phases"]["pretrain"] = json.loads((pre_dir / "train_log.json").read_text())
    else:
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(make_config(tok, args.hidden, args.layers, args.heads, args.kv_heads))
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model: {n_params / 1e6:.2f} M parameters, vocab {len(tok)}")
        t = time.perf_counter()
        data = batches(tok, args.seed, args.batch_size, answer_only=args.pretrain_loss == "answer", task=args.task)
        hist = train_phase(
            "pretrain",
            model,
            data,
            args.pretrain_steps,
            args.pretrain_lr,
            "ntp",
            args.seed,
            check=lambda m: quick_accuracy(m, tok, args.eval_problems, task=args.task) if args.eval_problems else None,
            check_every=args.check_every,
        )
        rec = {"history": hist, "seconds": round(time.perf_counter() - t, 1), "params": n_params}
        rec["heldout_ntp_accuracy"] = check("pretrain", model)
        save(model, tok, pre_dir, rec)
        log["phases"]["pretrain"] = rec

    # 2. the two fine-tunes from the same checkpoint, same batches
    ft_seed = args.seed + 1_000  # a part of the training stream the pre-training did not use
    for kind in ("sbd", "ntp"):
        d = out / kind
        if args.resume and (d / "model.safetensors").exists():
            print(f"[{kind}] reusing {d}")
            log["phases"][kind] = json.loads((d / "train_log.json").read_text())
            continue
        model = load(pre_dir)
        if kind == "sbd":
            add_mask_token(model, tok, block_size_range=tuple(args.block_sizes))
        t = time.perf_counter()
        data = batches(tok, ft_seed, args.batch_size, answer_only=True, task=args.task)
        if kind == "sbd":
            periodic = lambda m: (
                quick_sbd_check(m, tok, args.eval_problems, task=args.task) if args.eval_problems else None
            )
        else:
            periodic = lambda m: (
                quick_accuracy(m, tok, args.eval_problems, task=args.task) if args.eval_problems else None
            )
        hist = train_phase(
            kind,
            model,
            data,
            args.finetune_steps,
            args.finetune_lr,
            kind,
            ft_seed,
            tuple(args.block_sizes),
            check=periodic,
            check_every=args.check_every * 2,
        )
        rec = {"history": hist, "seconds": round(time.perf_counter() - t, 1)}
        rec["heldout_ntp_accuracy"] = check(kind, model)
        save(model, tok, d, rec)
        log["phases"][kind] = rec

    log["total_seconds"] = round(time.perf_counter() - t_all, 1)
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(f"done in {log['total_seconds'] / 60:.1f} min -> {out}")
    if args.install:
        install(out, args.task)
    return log


# The demo settings stored next to each embedded model (sbd_demo.json): how to prompt it, and the decoding settings
# chosen from `sbd-ext eval` (README, "The embedded model"): block size 8 and the paper's entropy-bounded sampler at
# its reasoning gammas (gamma_low = 0.1, gamma_high = 0.35). k = 16 is in the same table (weaker on this model).
DEMO_INFO = {
    "task": "arith",
    "prompt_template": "Q: {prompt}\nA: ",
    "block_size": 8,
    "sampler": "eb",
    "gamma_low": 0.1,
    "gamma_high": 0.35,
}


def install(out: str | os.PathLike, task: str = "arith", dst_root: str | os.PathLike | None = None) -> None:
    """Copy ``out/sbd`` and ``out/ntp`` into the package (``sbd_ext/demo/models/{sbd,ntp}-<task>``), with
    sbd_demo.json."""
    dst_root = Path(dst_root) if dst_root is not None else Path(__file__).parent / "models"
    for kind in ("sbd", "ntp"):
        name = f"{kind}-{task}"
        src, dst = Path(out) / kind, dst_root / name
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst)
        info = dict(DEMO_INFO, task=task, objective=kind)
        (dst / "sbd_demo.json").write_text(json.dumps(info, indent=1) + "\n")
        for f in dst.iterdir():
            f.chmod(0o644)  # save_pretrained writes the weights 0600: package data must be world-readable
        print(f"installed {src} -> {dst}")


if __name__ == "__main__":
    main()
