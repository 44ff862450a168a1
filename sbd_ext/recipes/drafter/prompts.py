"""Training prompts for the self-distilled drafter: templates x subjects, made here, nothing downloaded.

The drafter (:mod:`sbd_ext.drafter`) learns to predict what the *base* model says, so its training data are the base
model's own answers (:func:`sbd_ext.recipes.drafter.make_samples`) to these prompts. They cover the kinds of
request a chat model gets -- explanations, how-to, lists, short creative writing, code, rewriting, advice, facts,
arithmetic and small talk -- from templates filled with subjects, so the set is large, varied and reproducible
(:func:`training_prompts` is deterministic for a seed). For more variety than templates give, the base model also
writes its own instructions (:func:`self_instruct_requests`: requests such as "Write one question a curious person
might ask about tides.", sampled; :func:`clean_instruction` keeps one clean line), which it then answers like the
template prompts (``python -m sbd_ext.recipes.drafter data --prompts self``).

The held-out evaluation prompts (``general_prompts.json`` beside this module, package data) were written by hand apart
from this generator; :func:`training_prompts` never returns one of them (checked by the tests, and filtered here).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

__all__ = [
    "KINDS",
    "training_prompts",
    "eval_prompts",
    "EVAL_PROMPTS_FILE",
    "held_out_texts",
    "self_instruct_requests",
    "clean_instruction",
]

# Package data (installed with the wheel), so the held-out check and the benchmark work from any install.
EVAL_PROMPTS_FILE = Path(__file__).resolve().parent / "general_prompts.json"
# The generator's subjects, tasks and sentences (data, not code; their order is part of a seed's prompts).
VOCAB_FILE = Path(__file__).resolve().parent / "prompt_vocab.json"

_VOCAB = json.loads(VOCAB_FILE.read_text())
_SCIENCE = _VOCAB["science"]
_TASKS = _VOCAB["tasks"]
_THINGS = _VOCAB["things"]
_CREATIVE_SUBJECTS = _VOCAB["creative_subjects"]
_CODE_TASKS = _VOCAB["code_tasks"]
_LANGS = _VOCAB["langs"]
_SENTENCES = _VOCAB["sentences"]
_SITUATIONS = _VOCAB["situations"]
_FACT_QUESTIONS = _VOCAB["fact_questions"]
_COUNTRIES = _VOCAB["countries"]
_CHAT = _VOCAB["chat"]

KINDS = ("explanation", "how-to", "list", "creative", "code", "rewriting", "advice", "fact", "arithmetic", "chat")


def _kind_prompts(kind: str, rng: random.Random) -> str:
    c = rng.choice
    if kind == "explanation":
        return c(
            [
                "Explain {s}.",
                "How does {s} work?",
                "Can you explain {s} simply?",
                "What is {s}?",
                "Explain {s} to a ten year old.",
                "Why is {s} important?",
                "Tell me about {s}.",
            ]
        ).format(s=c(_SCIENCE))
    if kind == "how-to":
        return c(
            [
                "How do I {t}?",
                "How can I {t}?",
                "What are the steps to {t}?",
                "Teach me how to {t}.",
                "Give me instructions to {t}.",
                "What's the easiest way to {t}?",
            ]
        ).format(t=c(_TASKS))
    if kind == "list":
        return c(
            [
                "List {n} {x}.",
                "Name {n} {x}.",
                "Give me a list of {n} {x}.",
                "What are some {x}?",
                "Can you list a few {x}?",
            ]
        ).format(n=c(["three", "four", "five", "six", "seven"]), x=c(_THINGS))
    if kind == "creative":
        return c(
            [
                "Write a short poem about {s}.",
                "Write a haiku about {s}.",
                "Write a short story about {s}.",
                "Describe {s} in a few sentences.",
                "Write a limerick about {s}.",
                "Write a song verse about {s}.",
            ]
        ).format(s=c(_CREATIVE_SUBJECTS))
    if kind == "code":
        return c(
            [
                "Write a {l} function that {t}.",
                "In {l}, how do I write a function that {t}?",
                "Show me {l} code that {t}.",
            ]
        ).format(l=c(_LANGS), t=c(_CODE_TASKS))
    if kind == "rewriting":
        return c(
            [
                "Correct the grammar: {x}",
                "Rewrite this more formally: {x}",
                "Make this sentence friendlier: {x}",
                "Rewrite in the future tense: {x}",
                "Translate into simple English: {x}",
                "Rephrase this sentence: {x}",
                "Summarize: {x}",
            ]
        ).format(x=c(_SENTENCES))
    if kind == "advice":
        return c(["{s}. What should I do?", "{s}. Any advice?", "Can you help? {s}.", "{s}. Do you have tips?"]).format(
            s=c(_SITUATIONS)
        )
    if kind == "fact":
        return c(_FACT_QUESTIONS).format(c=c(_COUNTRIES))
    if kind == "arithmetic":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return c(
            [
                "What is {a} plus {b}?",
                "What is {a} times {b}?",
                "Compute {a} - {b}.",
                "If I have {a} apples and buy {b} more, how many do I have?",
                "A box holds {a} pencils. How many pencils are in {b} boxes?",
            ]
        ).format(a=a, b=b)
    return c(_CHAT)


def eval_prompts(path: str | Path = EVAL_PROMPTS_FILE) -> list[dict]:
    """The held-out prompts ``[{"kind", "text"}, ...]`` of ``sbd_ext/recipes/drafter/general_prompts.json``."""
    return json.loads(Path(path).read_text())["prompts"]


def held_out_texts() -> set[str]:
    """The held-out prompts' texts, stripped and lower-cased: what no training prompt may equal."""
    return {p["text"].strip().lower() for p in eval_prompts()}


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct training prompts, the kinds in turn (a kind whose templates are used up is skipped),
    deterministic for ``seed``; none equals a held-out evaluation prompt."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    held_out = held_out_texts() if EVAL_PROMPTS_FILE.is_file() else set()
    rng = random.Random(seed)
    out, seen, tries = [], set(held_out), 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n + 1000:
            raise ValueError(f"the templates give fewer than {n} distinct prompts ({len(out)})")
        p = _kind_prompts(KINDS[tries % len(KINDS)], rng)
        if p.lower() not in seen:
            seen.add(p.lower())
            out.append(p)
    return out


# The base writes its own instructions: (kind, request template, subject pool). Kinds as KINDS, written apart from the
# held-out list; the subjects are the template generator's, the wording of the resulting prompt is the model's.
_SELF_REQUESTS = (
    ("explanation", "Write one question that a curious person might ask about {s}. Write only the question.", _SCIENCE),
    (
        "how-to",
        "Write one question someone might ask a helpful assistant about how to {s}. Write only the question.",
        _TASKS,
    ),
    ("list", "Write one request asking an assistant to list some {s}. Write only the request.", _THINGS),
    (
        "creative",
        "Write one request asking an assistant to write a poem, story or description about {s}. Write only "
        "the request.",
        _CREATIVE_SUBJECTS,
    ),
    ("code", "Write one programming question about {s}. Write only the question.", _LANGS),
    (
        "rewriting",
        "Write one request asking an assistant to rewrite, summarize or correct this sentence: {s} Write "
        "only the request, including the sentence.",
        _SENTENCES,
    ),
    (
        "advice",
        'Someone says: "{s}." Write the question they might ask an assistant. Write only the question.',
        _SITUATIONS,
    ),
    ("fact", "Write one question about the history, geography or culture of {s}. Write only the question.", _COUNTRIES),
    (
        "chat",
        "Write one friendly message a person might send to a chatbot about {s}. Write only the message.",
        _CREATIVE_SUBJECTS,
    ),
)


def self_instruct_requests(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (kind, request) pairs asking the base model to write a user's instruction, the kinds in turn, subjects
    drawn with ``seed`` (repeats allowed: the instructions are sampled)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind, template, pool = _SELF_REQUESTS[i % len(_SELF_REQUESTS)]
        out.append((kind, template.format(s=rng.choice(pool))))
    return out


_LABEL = re.compile(r"^(?:question|request|instruction|message|user|prompt|q)\s*\d*\s*[:\-]\s*", re.IGNORECASE)


def clean_instruction(text: str, min_chars: int = 12, max_chars: int = 240) -> str | None:
    """The instruction in a model's reply to a :func:`self_instruct_requests` request: its first non-empty line,
    without a leading label ("Question:"), list number or quotes; None when that is not a usable prompt (too
    short or long, no final punctuation, or still a request to write one)."""
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    if not lines:
        return None
    s = lines[0]
    s = re.sub(r"^(?:\d+[.)]|[-*\u2022])\s*", "", s)
    s = _LABEL.sub("", s)
    s = s.strip().strip("\"'\u201c\u201d*").strip()
    if not (min_chars <= len(s) <= max_chars) or s[-1] not in "?.!":
        return None
    if s.lower().startswith(("write one", "write only", "sure", "here is", "here's")):
        return None
    return s
