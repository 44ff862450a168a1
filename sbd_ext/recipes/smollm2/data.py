"""The conversion's training and evaluation data: the project's GSM8K-shaped arithmetic task
(:mod:`sbd_ext.demo.tasks`, disjoint train/test splits) in SmolLM2's tokenizer.

A sample is ``prompt + completion + EOS``; the prompt carries no loss (label ``IGNORE_INDEX``) in either objective.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ...demo import tasks
from ...training import IGNORE_INDEX

__all__ = ["task_problems", "encode", "collate", "make_batches", "prompt_ids", "extract_answer"]

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
