"""The conversion's training and evaluation data: the project's GSM8K-shaped arithmetic task
(:mod:`sbd_ext.demo.tasks`, disjoint train/test splits) in SmolLM2's tokenizer, and the base model's own samples
for rehearsal (:func:`rehearsal_samples`).

A sample is ``prompt + completion + EOS``; the prompt carries no loss (label ``IGNORE_INDEX``) in either objective.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ...demo import tasks
from ...training import IGNORE_INDEX

__all__ = [
    "task_problems",
    "encode",
    "collate",
    "make_batches",
    "prompt_ids",
    "extract_answer",
    "rehearsal_samples",
    "attach_rehearsal",
]

extract_answer = tasks.extract_answer


def task_problems(split: str, n: int | None, seed: int = 0) -> Iterator[tasks.Problem]:
    """Problems of the arithmetic task (``prompt``, ``completion``, ``answer``)."""
    return tasks.problems(split, n=n, seed=seed)


def prompt_ids(tokenizer, problem) -> list[int]:
    return tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]


def encode(tokenizer, problem) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one sample: prompt + completion + EOS; the prompt carries no loss."""
    p = prompt_ids(tokenizer, problem)
    c = tokenizer(problem.completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p + c, [IGNORE_INDEX] * len(p) + c


def make_batches(tokenizer, problems, batch_size: int, max_len: int, pad_id: int) -> list[dict]:
    """Right-padded batches {input_ids, attention_mask, labels} (sequences cut at ``max_len``)."""
    out, cur = [], []
    for prob in problems:
        ids, lab = encode(tokenizer, prob)
        cur.append((ids[:max_len], lab[:max_len]))
        if len(cur) == batch_size:
            out.append(collate(cur, pad_id))
            cur = []
    if cur:
        out.append(collate(cur, pad_id))
    return out


def collate(items, pad_id: int) -> dict:
    """Right-pad ``(input_ids, labels)`` pairs into a batch {input_ids, attention_mask, labels}."""
    L = max(len(i) for i, _ in items)
    ids = torch.full((len(items), L), pad_id, dtype=torch.long)
    lab = torch.full((len(items), L), IGNORE_INDEX, dtype=torch.long)
    am = torch.zeros((len(items), L), dtype=torch.long)
    for b, (i, l_) in enumerate(items):
        ids[b, : len(i)] = torch.tensor(i)
        lab[b, : len(l_)] = torch.tensor(l_)
        am[b, : len(i)] = 1
    return {"input_ids": ids, "attention_mask": am, "labels": lab}


# The pretraining corpus' document separator of SmolLM2 (id 0): sampling after it draws general text.
DOCUMENT_START = "<|endoftext|>"


@torch.no_grad()
def rehearsal_samples(
    model, tokenizer, n: int, length: int, seed: int, exclude_ids=(), batch_size: int = 64
) -> torch.Tensor:
    """``n`` sequences of ``length`` tokens sampled from ``model`` (temperature 1, no top-k / top-p) after the
    document separator: the model's own distribution over general text. Training the next-token loss on them while
    fine-tuning (rehearsal) pulls the fine-tuned model's next-token distribution back towards the sampling model's,
    with no data anybody wrote (self-distillation at the sequence level). ``exclude_ids`` (the mask token) are never
    sampled. Returns [n, length] token ids, the first the separator; deterministic for a seed and thread count."""
    if n < 1 or length < 2:
        raise ValueError(f"rehearsal needs n >= 1 and length >= 2, got n={n}, length={length}")
    start = tokenizer.convert_tokens_to_ids(DOCUMENT_START)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        out = []
        for lo in range(0, n, batch_size):
            b = min(batch_size, n - lo)
            ids = torch.full((b, 1), start, dtype=torch.long, device=model.device)
            seq = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=length - 1,
                min_new_tokens=length - 1,
                suppress_tokens=list(exclude_ids) or None,
                pad_token_id=tokenizer.pad_token_id,
            )
            out.append(seq[:, :length].cpu())
    finally:
        torch.random.set_rng_state(gen_state)
    return torch.cat(out)


def attach_rehearsal(batches: list[dict], samples: torch.Tensor, per_step: int) -> list[dict]:
    """Each batch gets ``per_step`` rehearsal sequences (``rehearsal_input_ids``; cycling over ``samples``), whose
    every next token is labelled: batch i always carries the same ones, so a resumed run sees what an uninterrupted
    one would."""
    n = samples.shape[0]
    out = []
    for i, batch in enumerate(batches):
        rows = [(i * per_step + j) % n for j in range(per_step)]
        out.append({**batch, "rehearsal_input_ids": samples[rows]})
    return out
