"""Generated tasks with verifiable answers, for the embedded demo model and its evaluation.

The main task, :func:`arith_problem`, is a GSM8K-shaped multi-step arithmetic word problem: a question, a worked
solution in predictable template text around the "hard" digits, and a final ``#### <answer>`` line::

    Q: Mia has 23 pens. She buys 5 more. She gives 8 to Sam. How many pens does Mia have now?
    A: Mia had 23 pens. She bought 5, so 23+5=28. She gave 8 to Sam, so 28-8=20.
    #### 20

Sized for a sub-million-parameter model trained in minutes on a CPU: the running value always has two digits
(10..99) and each step adds or subtracts a one-digit number (1..9), so every number has a fixed width. The digits
of each result are still "hard" (they need the carry/borrow), the words around them are predictable.

Problems are a pure function of an integer seed (``random.Random(seed)``, stable across Python versions), so the
stream is unbounded and reproducible. The train/test split is by construction, twice over:

* seed spaces are disjoint: training problems come from seeds ``[0, TEST_SEED_BASE)``, test problems from
  ``[TEST_SEED_BASE, ...)``;
* and, since two seeds may draw the same problem, every problem also has a *bucket* from a hash of its question
  text: test problems are exactly those whose bucket is 0 (1 in :data:`TEST_BUCKETS`), and the training stream
  skips them. A held-out question therefore never occurs in any training sample, however long training runs.

Also: :func:`extract_answer` (the last ``#### n``, or ``Answer: n``), :func:`accuracy`, and a second task,
:func:`sort_problem` (sort / reverse a list of numbers), on which parallel decoding is known to be harder.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "Problem",
    "TEST_BUCKETS",
    "TEST_SEED_BASE",
    "accuracy",
    "arith_problem",
    "extract_answer",
    "is_test_question",
    "problems",
    "solve",
    "sort_problem",
]

TEST_SEED_BASE = 1 << 40
TEST_BUCKETS = 20  # 1 question in 20 belongs to the test split

NAMES = [
    ("Mia", "She", "her"),
    ("Tom", "He", "him"),
    ("Ana", "She", "her"),
    ("Ben", "He", "him"),
    ("Lily", "She", "her"),
    ("Sam", "He", "him"),
    ("Zoe", "She", "her"),
    ("Leo", "He", "him"),
]
OBJECTS = ["pens", "apples", "coins", "books", "cards", "shells", "eggs", "stamps"]

# (question sentence, solution sentence, sign). {P}: pronoun, {n}: the number, {F}: a friend's name.
OPS = [
    ("{P} buys {n} more.", "{P} bought {n}, so {a}+{n}={b}.", +1),
    ("{P} finds {n} more.", "{P} found {n}, so {a}+{n}={b}.", +1),
    ("{F} gives {O} {n} more.", "{F} gave {O} {n}, so {a}+{n}={b}.", +1),
    ("{P} gives {n} to {F}.", "{P} gave {n} to {F}, so {a}-{n}={b}.", -1),
    ("{P} loses {n}.", "{P} lost {n}, so {a}-{n}={b}.", -1),
    ("{P} sells {n}.", "{P} sold {n}, so {a}-{n}={b}.", -1),
]
MIN_VALUE, MAX_VALUE = 10, 99  # the running value (two digits)
MAX_OPERAND = 9  # the number added or subtracted at each step (one digit)


@dataclass(frozen=True)
class Problem:
    """One generated problem. ``prompt + completion`` is the full training text (no special tokens)."""

    prompt: str
    completion: str
    answer: int
    seed: int
    task: str = "arith"

    @property
    def text(self) -> str:
        return self.prompt + self.completion

    @property
    def question(self) -> str:
        return self.prompt

    @property
    def message(self) -> str:
        """The question as a user types it (a chat message): the prompt without its ``Q: `` / ``\nA: `` frame."""
        return self.prompt.removeprefix("Q: ").removesuffix("\nA: ")


def _bucket(question: str) -> int:
    return int.from_bytes(hashlib.sha1(question.encode()).digest()[:8], "little") % TEST_BUCKETS


def is_test_question(question: str) -> bool:
    """Whether a question (a problem's prompt) belongs to the held-out split."""
    return _bucket(question) == 0


def arith_problem(seed: int, min_steps: int = 2, max_steps: int = 3) -> Problem:
    """The arithmetic word problem of ``seed``: ``min_steps``..``max_steps`` additions/subtractions.

    The running value starts in 20..80 and stays in [10, 99]; each step adds or subtracts 1..9. Deterministic in
    all arguments.
    """
    rng = random.Random(seed)
    name, pron, obj_pron = rng.choice(NAMES)
    friend = rng.choice([n for n, _, _ in NAMES if n != name])
    obj = rng.choice(OBJECTS)
    steps = rng.randint(min_steps, max_steps)
    value = rng.randint(20, 80)
    q = [f"{name} has {value} {obj}."]
    s = [f"{name} had {value} {obj}."]
    for _ in range(steps):
        qt, st, sign = rng.choice(OPS)
        room = MAX_VALUE - value if sign > 0 else value - MIN_VALUE
        if room < 1:  # at a bound: take the other direction
            qt, st, sign = rng.choice([op for op in OPS if op[2] == -sign])
            room = MAX_VALUE - value if sign > 0 else value - MIN_VALUE
        n = rng.randint(1, min(MAX_OPERAND, room))
        new = value + sign * n
        fields = dict(P=pron, O=obj_pron, F=friend, n=n, a=value, b=new)
        q.append(qt.format(**fields))
        s.append(st.format(**fields))
        value = new
    q.append(f"How many {obj} does {name} have now?")
    prompt = "Q: " + " ".join(q) + "\nA: "
    completion = " ".join(s) + f"\n#### {value}"
    return Problem(prompt=prompt, completion=completion, answer=value, seed=seed, task="arith")


def sort_problem(seed: int, min_len: int = 4, max_len: int = 8, kind: str | None = None) -> Problem:
    """A list task: sort (ascending) or reverse ``min_len``..``max_len`` numbers in 0..99.

    The answer is the output list as a string ("3 7 12"); parallel decoding has no easy tokens to fill in here
    beyond the separators, so it shows the gamma trade-off from the other side.
    """
    rng = random.Random(seed)
    kind = kind or rng.choice(["sort", "reverse"])
    xs = [rng.randint(0, 99) for _ in range(rng.randint(min_len, max_len))]
    ys = sorted(xs) if kind == "sort" else xs[::-1]
    prompt = f"Q: {kind.capitalize()} the list: {' '.join(map(str, xs))}\nA: "
    out = " ".join(map(str, ys))
    return Problem(prompt=prompt, completion=f"{out}\n#### {out}", answer=out, seed=seed, task="sort")  # type: ignore[arg-type]


_MAKERS = {"arith": arith_problem, "sort": sort_problem}


def problems(split: str = "train", n: int | None = None, seed: int = 0, task: str = "arith") -> Iterator[Problem]:
    """The problem stream of a split: ``n`` problems (unbounded when None), deterministic in ``seed``.

    ``seed`` offsets the seed range of the split (two training runs with different seeds see different streams);
    the split property holds for every seed: test problems come from seeds >= TEST_SEED_BASE and have a test
    bucket, training problems come from seeds < TEST_SEED_BASE and never have one.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    make = _MAKERS[task]
    base = (TEST_SEED_BASE if split == "test" else 0) + int(seed) * 1_000_003
    want_test = split == "test"
    i = count = 0
    while n is None or count < n:
        p = make(base + i)
        i += 1
        if is_test_question(p.prompt) == want_test:
            count += 1
            yield p


_ANSWER_RES = (re.compile(r"####\s*(-?\d[\d ]*)"), re.compile(r"Answer:\s*(-?\d[\d ]*)"))


def extract_answer(text: str) -> int | str | None:
    """The final answer of a completion: the number(s) after the last ``####`` (or ``Answer:``), else None.

    One number gives an int; several space-separated numbers (the list task) give their normalised string.
    """
    for rx in _ANSWER_RES:
        found = rx.findall(text)
        if found:
            parts = found[-1].split()
            try:
                return int(parts[0]) if len(parts) == 1 else " ".join(str(int(x)) for x in parts)
            except ValueError:
                return None
    return None


_STEP_RES = (
    (re.compile(r"\b(?:buys|finds) (\d+) more"), +1),
    (re.compile(r"\bgives (?:him|her) (\d+) more"), +1),
    (re.compile(r"\bgives (\d+) to\b"), -1),
    (re.compile(r"\b(?:loses|sells) (\d+)\b"), -1),
)


def solve(question: str) -> int | None:
    """The answer of an arithmetic question written with this module's templates, or None if it is not one.

    Reads "X has N ..." and then each sentence's operation in order; used to check answers to user prompts.
    """
    start = re.search(r"\bhas (\d+) ", question)
    if start is None:
        return None
    value = int(start.group(1))
    for sentence in re.split(r"(?<=[.?!])\s+", question[start.end() :]):
        for rx, sign in _STEP_RES:
            m = rx.search(sentence)
            if m:
                value += sign * int(m.group(1))
                break
    return value


def accuracy(completions: Sequence[str], probs: Sequence[Problem]) -> float:
    """Fraction of completions whose extracted answer equals the problem's answer."""
    if len(completions) != len(probs):
        raise ValueError(f"{len(completions)} completions for {len(probs)} problems")
    if not probs:
        return 0.0
    return sum(extract_answer(c) == p.answer for c, p in zip(completions, probs, strict=True)) / len(probs)
