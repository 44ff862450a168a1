"""The drafter's training data: the base model's own greedy answers (sbd_ext's NTP decoding, batched, left-padded)
to the recipe's template prompts (:func:`.prompts.training_prompts`, or the arithmetic task's problems) or to
instructions the base writes itself (:func:`make_self_prompts`), kept in ``<out>/samples.pt`` batch by batch so an
interrupted run continues."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .args import base_path
from .bases import PROMPT_SOURCES, SAMPLES_FILE, SELF_PROMPTS_FILE, load_task_base, prompt_ids, task_prompts
from .prompts import clean_instruction, held_out_texts, self_instruct_requests


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
    refused). ``device``: where the base answers (a GPU: large batches; on the CPU an fp32 base answers in
    row_linear's packed layout, the same values); ``deadline`` (``time.time()`` seconds):
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
    base = base_path(base)
    if any(d.get("base", "") != base for d in done):
        raise ValueError(f"{path} holds another base model's answers than {base or 'SmolLM2'!r}: use another --out")
    have = sum(d.get("source", "templates") == prompts for d in done)
    if have >= n:
        return path
    model, tok, eos = load_task_base(task, base=base)
    model.to(device).eval()
    if device == "cpu" and next(model.parameters()).dtype == torch.float32:
        # The same fp32 values in row_linear's panels: a batch of 32 answers ~1.4x faster than the plain layout on a
        # 2-core AVX2 EPYC (the greedy answers of sbd_ext's packed NTP decoding, its recommended CPU forward).
        import sbd_ext

        sbd_ext.quantize(model, "packed")
    if prompts == "self":
        chosen = [(t, prompt_ids(tok, t)) for t in make_self_prompts(model, tok, eos, out, n, seed, batch_size)]
    else:
        chosen = task_prompts(tok, task, "train", n, seed=seed)
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
            [prompt_ids(tok, r) for _, r in chunk],
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
    _, answers = generate_padded(
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


def generate_padded(model, prompts: list[list[int]], pad: int, **kw):
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
