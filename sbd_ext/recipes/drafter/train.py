"""The drafter's training: the rank-r gated LoRA and the mask row (:func:`sbd_ext.drafter.attach`) distilled from
the frozen base on its own answers (:func:`sbd_ext.drafter.distill_loss`, fully masked blocks drawn per step) by
:func:`sbd_ext.training.train_loop` (AdamW, warm-up + cosine, checkpointed; ``resume`` continues exactly), over
length-bucketed batches (:func:`make_batches`)."""

from __future__ import annotations

import json
import platform
import random
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ... import drafter as drafter_mod
from ...training import train_loop
from ...training.common import draw_block_size
from . import args as args_mod
from .args import check_batches
from .bases import BASE_NAMES, CHECKPOINT_FILE, SAMPLES_FILE, TASKS, DrafterConfig, load_task_base, sbd_fields


def make_batches(
    samples: list[dict], batch_size: int, max_len: int, pad_id: int, seed: int, bucket: bool = False
) -> list[dict]:
    """Right-padded batches of prompt + answer (truncated to ``max_len``); ``loss_mask`` marks the answer tokens.
    Shuffled once (``seed``). ``bucket``: each window of :data:`BUCKET_WINDOW` batches' samples (in the shuffled
    order) sorted by length before it is cut into batches, and the batches shuffled again: each batch holds samples
    of about one length, so little of a batch is padding (every row of a batch costs the longest row's forward)."""
    order = list(range(len(samples)))
    rng = random.Random(seed)
    rng.shuffle(order)
    if bucket:
        span = BUCKET_WINDOW * batch_size
        key = [min(len(s["prompt_ids"]) + len(s["answer_ids"]), max_len) for s in samples]
        order = [i for lo in range(0, len(order), span) for i in sorted(order[lo : lo + span], key=key.__getitem__)]
    batches = []
    for lo in range(0, len(order) - batch_size + 1, batch_size):
        items = [samples[i] for i in order[lo : lo + batch_size]]
        seqs = [(list(s["prompt_ids"]) + list(s["answer_ids"]))[:max_len] for s in items]
        L = max(len(s) for s in seqs)
        ids = torch.full((batch_size, L), pad_id, dtype=torch.long)
        att = torch.zeros((batch_size, L), dtype=torch.long)
        lm = torch.zeros((batch_size, L), dtype=torch.bool)
        for i, (s, it) in enumerate(zip(seqs, items, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            att[i, : len(s)] = 1
            lm[i, len(it["prompt_ids"]) : len(s)] = True
        batches.append({"input_ids": ids, "attention_mask": att, "loss_mask": lm})
    if bucket:
        rng.shuffle(batches)
    return batches


BUCKET_WINDOW = 32  # batches per length-sorted window of make_batches(bucket=True)


def padding_fraction(batches: list[dict]) -> float:
    """The share of a batch list's positions that are padding (what a forward computes for nothing)."""
    total = sum(b["attention_mask"].numel() for b in batches)
    return 1.0 - sum(int(b["attention_mask"].sum()) for b in batches) / max(total, 1)


def train(
    out: Path,
    cfg: DrafterConfig,
    resume: bool = False,
    threads: int | None = None,
    device: str = "cpu",
    precision: str = "fp32",
    deadline: float | None = None,
) -> dict:
    """Train the drafter on ``out/samples.pt``; checkpoint in ``out/checkpoint.pt``; the record in
    ``out/train_log.json`` and the artifact in ``out/artifact``. ``device``: where it trains; ``precision``
    "fp32", "bf16" (the forward under bf16 autocast, the adapter and optimizer in fp32) or "auto" (bf16 on a GPU
    or a CPU with bf16 matrix instructions: :func:`.args.auto_precision`); ``deadline`` (``time.time()``
    seconds): stop at the first step past it, checkpointed (``resume=True`` continues the same schedule)."""
    if cfg.task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {cfg.task!r}")
    if cfg.base and cfg.task != "general":
        raise ValueError(f"--base drafts for a model of your own: task 'general', not {cfg.task!r}")
    if not (out / SAMPLES_FILE).is_file():
        raise FileNotFoundError(f"{out / SAMPLES_FILE}: no samples; run `data --out {out}` first")
    if threads:
        torch.set_num_threads(threads)
    ck = out / CHECKPOINT_FILE
    cfg_file = out / "drafter_config.json"
    if resume:
        if not ck.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {ck}")
        on_file = json.loads(cfg_file.read_text())
        if "bucket" not in on_file:  # a run from before length buckets: it continues with its random batches
            cfg = replace(cfg, bucket=False)
        saved = {"task": "general", "first_slot_loss": True, "divergence": "kl", "base": "", "bucket": False} | on_file
        saved["block_size_range"] = tuple(saved["block_size_range"])
        if saved != asdict(cfg) | {"block_size_range": tuple(cfg.block_size_range)}:
            raise ValueError(f"--resume with other settings than {cfg_file}: {saved} vs {asdict(cfg)}")
    elif ck.exists():
        raise FileExistsError(f"{ck} exists: pass --resume to continue that run, or use another --out")
    samples = torch.load(out / SAMPLES_FILE, weights_only=True)
    if any(d.get("task", "general") != cfg.task for d in samples):
        raise ValueError(f"{out / SAMPLES_FILE} holds samples of another task than {cfg.task!r}")
    if any(d.get("base", "") != cfg.base for d in samples):
        raise ValueError(f"{out / SAMPLES_FILE} holds another base model's answers than {cfg.base or 'SmolLM2'!r}")
    check_batches(out / SAMPLES_FILE, len(samples), cfg.batch_size)
    cfg_file.write_text(json.dumps(asdict(cfg), indent=1) + "\n")
    torch.manual_seed(cfg.seed)
    precision = args_mod.auto_precision(device) if precision == "auto" else precision
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'auto', got {precision!r}")
    model, tok, _ = load_task_base(cfg.task, attn_implementation="sdpa", base=cfg.base)
    mask_id = int(tok.mask_token_id)  # every base loader adds it with add_mask_token (<|mask|> for SmolLM2)
    if cfg.init_from:
        drafter_mod.load_weights(model, cfg.init_from)
        if drafter_mod.get_drafter(model).rank > cfg.rank:
            raise ValueError(f"--init-from {cfg.init_from}: rank {drafter_mod.get_drafter(model).rank} > {cfg.rank}")
        params = drafter_mod.grow_rank(model, cfg.rank)  # the same drafter at a rank >= its own
    else:
        params = drafter_mod.attach(model, mask_id, rank=cfg.rank)
    model.to(device).train()
    batches = make_batches(samples, cfg.batch_size, cfg.max_len, tok.pad_token_id or 0, cfg.seed, cfg.bucket)
    gen = torch.Generator().manual_seed(cfg.seed)

    seen = {"answer_tokens": 0}  # this call's, for its throughput

    def loss_fn(model, b):
        seen["answer_tokens"] += int(b["loss_mask"].sum())
        b = {key: v.to(device) for key, v in b.items()}
        k = draw_block_size(cfg.block_size_range, gen)
        loss, parts = drafter_mod.distill_loss(
            model,
            b["input_ids"],
            b["loss_mask"],
            k,
            attention_mask=b["attention_mask"],
            generator=gen,
            full_block_prob=cfg.full_block_prob,
            first_slot_loss=cfg.first_slot_loss,
            divergence=cfg.divergence,
            return_parts=True,
        )
        by_offset = parts.pop("offset_accuracy")
        parts.pop("offset_count")
        if len(by_offset) > 1 and by_offset[1] == by_offset[1]:  # the 2-ahead drafts verify can accept (not NaN)
            parts["ahead2_accuracy"] = by_offset[1]
        return loss, parts

    t0 = time.time()
    curve = out / "curve.jsonl"

    def log(rec):
        with open(curve, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if rec["step"] % (4 * cfg.log_every) == 0:  # an artifact to evaluate while the run goes on
            fields = sbd_fields(cfg, samples) | {"steps_done": rec["step"]}
            drafter_mod.save_drafter(model, out / "artifact", fields, cfg.base or BASE_NAMES[cfg.task])

    history = train_loop(
        model,
        batches if deadline is None else args_mod.until(batches, deadline),
        loss_fn,
        cfg.steps,
        lr=cfg.lr,
        warmup_steps=cfg.warmup,
        params=params,
        log_every=cfg.log_every,
        progress="lines",
        name="drafter",
        callback=log,
        checkpoint=ck,
        checkpoint_every=cfg.checkpoint_every,
        rngs=(gen,),
        autocast_dtype=torch.bfloat16 if precision == "bf16" else None,
    )
    steps_done = int(torch.load(ck, weights_only=True)["step"]) if ck.is_file() else cfg.steps
    seconds = time.time() - t0
    record = {
        "config": asdict(cfg),
        "samples": len(samples),
        "history": history,
        "seconds_this_call": round(seconds, 1),
        "answer_tokens_this_call": seen["answer_tokens"],
        "answer_tokens_per_s": round(seen["answer_tokens"] / max(seconds, 1e-9), 1),
        "padding_fraction": round(padding_fraction(batches), 4),
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "device": str(device),
        "precision": precision,
        "steps_done": steps_done,
    }
    (out / "train_log.json").write_text(json.dumps(record, indent=1) + "\n")
    fields = sbd_fields(cfg, samples) | {"steps_done": steps_done}
    drafter_mod.save_drafter(model, out / "artifact", fields, cfg.base or BASE_NAMES[cfg.task])
    return record
