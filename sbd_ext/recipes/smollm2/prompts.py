"""Training prompts for the self-distilled drafter: templates x subjects, made here, nothing downloaded.

The drafter (:mod:`sbd_ext.drafter`) learns to predict what the *base* model says, so its training data are the base
model's own answers (:func:`sbd_ext.recipes.smollm2.drafter.make_samples`) to these prompts. They cover the kinds of
request a chat model gets -- explanations, how-to, lists, short creative writing, code, rewriting, advice, facts,
arithmetic and small talk -- from templates filled with subjects, so the set is large, varied and reproducible
(:func:`training_prompts` is deterministic for a seed). For more variety than templates give, the base model also
writes its own instructions (:func:`self_instruct_requests`: requests such as "Write one question a curious person
might ask about tides.", sampled; :func:`clean_instruction` keeps one clean line), which it then answers like the
template prompts (``python -m sbd_ext.recipes.smollm2.drafter data --prompts self``).

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

_SCIENCE = [
    "gravity",
    "magnetism",
    "electricity",
    "volcanoes",
    "earthquakes",
    "tides",
    "clouds",
    "thunder",
    "snowflakes",
    "the water cycle",
    "black holes",
    "the Moon's phases",
    "static electricity",
    "sound waves",
    "light",
    "friction",
    "evaporation",
    "glaciers",
    "photosynthesis in algae",
    "the human heart",
    "the lungs",
    "digestion",
    "sleep",
    "dreams",
    "memory",
    "muscles",
    "bones",
    "the immune system",
    "bacteria",
    "viruses",
    "DNA",
    "evolution",
    "fossils",
    "dinosaurs",
    "bees",
    "ants",
    "bird migration",
    "whales",
    "octopuses",
    "coral reefs",
    "rainforests",
    "deserts",
    "the ozone layer",
    "climate change",
    "solar panels",
    "wind turbines",
    "batteries",
    "magnets",
    "microwaves",
    "airplanes",
    "rockets",
    "satellites",
    "the internet",
    "computers",
    "smartphones",
    "GPS",
    "3D printers",
    "electric cars",
    "engines",
    "bridges",
    "skyscrapers",
    "money",
    "banks",
    "interest rates",
    "supply and demand",
    "taxes",
    "democracy",
    "elections",
    "the Roman Empire",
    "the printing press",
    "the pyramids",
    "the Silk Road",
]
_TASKS = [
    "bake bread",
    "make pancakes",
    "brew tea",
    "cook rice",
    "make a salad",
    "knit a scarf",
    "paint a room",
    "fix a leaky faucet",
    "wash a wool sweater",
    "start a compost pile",
    "grow basil indoors",
    "care for a cactus",
    "train a puppy to sit",
    "teach a child to ride a bike",
    "write a resume",
    "give a short speech",
    "organize a closet",
    "plan a birthday party",
    "learn a new language",
    "study for an exam",
    "take better photos",
    "back up my computer",
    "create a strong password",
    "set up a budget",
    "start a journal",
    "meditate",
    "stretch after running",
    "tie a tie",
    "fold a fitted sheet",
    "sharpen a kitchen knife",
    "hang a picture",
    "remove a coffee stain",
    "pack a suitcase",
    "jump start a car",
    "make a smoothie",
    "write a thank you note",
]
_THINGS = [
    "vegetables",
    "board games",
    "birds",
    "rivers",
    "countries in Europe",
    "musical instruments",
    "hobbies",
    "kitchen tools",
    "programming languages",
    "types of clouds",
    "sports",
    "desserts",
    "flowers",
    "books for children",
    "ways to exercise at home",
    "renewable energy sources",
    "mammals that live in the ocean",
    "breakfast ideas",
    "things to do on a rainy day",
    "tips for public speaking",
    "uses for baking soda",
    "healthy snacks",
    "spices",
    "famous scientists",
    "ancient civilizations",
    "types of rock",
    "weather instruments",
    "winter clothes",
    "ways to reduce waste",
    "questions to ask a doctor",
    "indoor plants",
    "car maintenance tasks",
    "fruits",
]
_CREATIVE_SUBJECTS = [
    "the moon",
    "a lost key",
    "a rainy city",
    "a lighthouse",
    "friendship",
    "a cup of coffee",
    "a old library",
    "a dragon who is afraid of fire",
    "the first day of spring",
    "a cat on a windowsill",
    "a train journey",
    "the desert at night",
    "a snowman",
    "a forgotten toy",
    "the ocean waves",
    "a busy market",
    "a mountain lake",
    "a clock that runs backwards",
    "a garden",
    "a storm",
    "a star",
    "a small boat",
    "a bakery at dawn",
    "the wind",
]
_CODE_TASKS = [
    "adds two numbers",
    "checks if a string is a palindrome",
    "counts the vowels in a string",
    "returns the sum of a list",
    "finds the smallest element of a list",
    "sorts a list of numbers",
    "converts Celsius to Fahrenheit",
    "returns the nth Fibonacci number",
    "removes duplicates from a list",
    "checks whether a year is a leap year",
    "counts words in a sentence",
    "returns the average of a list",
    "merges two dictionaries",
    "capitalizes every word in a sentence",
    "computes the greatest common divisor",
    "checks if a number is even",
    "flattens a nested list",
    "returns the length of the longest word",
]
_LANGS = ["Python", "JavaScript", "C", "Java", "Rust", "Go"]
_SENTENCES = [
    "I goes to the store yesterday.",
    "The cat sat on the mat and it was happy.",
    "We need to finish this quickly.",
    "Please send me the file.",
    "The weather is bad today.",
    "He runs every morning before work.",
    "The results of the experiment were not what we expected.",
    "Can you help me?",
    "This movie was really boring.",
    "They has finished their homework.",
    "Our team won the game last night.",
    "I am very tired after the trip.",
    "The new phone is expensive but it is fast.",
    "She reads a book every week.",
    "The train was late again.",
]
_SITUATIONS = [
    "I feel nervous before exams",
    "I procrastinate a lot",
    "I want to eat healthier",
    "my plants keep dying",
    "I have trouble focusing",
    "I want to learn to cook",
    "I spend too much time on my phone",
    "I feel lonely",
    "I want to get better at math",
    "my room is always messy",
    "I want to start a small business",
    "I have an argument with a friend",
    "I want to read more books",
    "I am moving to a new country",
]
_FACT_QUESTIONS = [
    "What is the capital of {c}?",
    "What language is spoken in {c}?",
    "What is {c} famous for?",
    "What currency does {c} use?",
]
_COUNTRIES = [
    "France",
    "Japan",
    "Brazil",
    "Canada",
    "Egypt",
    "India",
    "Italy",
    "Kenya",
    "Mexico",
    "Norway",
    "Spain",
    "Germany",
    "Peru",
    "Vietnam",
    "Greece",
    "Turkey",
    "Chile",
    "Sweden",
    "Thailand",
    "Argentina",
]
_CHAT = [
    "Hi! How are you today?",
    "Tell me a joke.",
    "What is your favorite color and why?",
    "Good morning!",
    "Can you tell me something interesting?",
    "What should I have for dinner tonight?",
    "Tell me a fun fact.",
    "I just finished a marathon!",
    "What do you like to talk about?",
    "Recommend a good book.",
    "What is a good name for a goldfish?",
    "Say something encouraging.",
    "What is the meaning of life?",
]

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
    """The held-out prompts ``[{"kind", "text"}, ...]`` of ``sbd_ext/recipes/smollm2/general_prompts.json``."""
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
    ("how-to", "Write one question someone might ask a helpful assistant about how to {s}. Write only the question.",
     _TASKS),
    ("list", "Write one request asking an assistant to list some {s}. Write only the request.", _THINGS),
    ("creative", "Write one request asking an assistant to write a poem, story or description about {s}. Write only "
     "the request.", _CREATIVE_SUBJECTS),
    ("code", "Write one programming question about {s}. Write only the question.", _LANGS),
    ("rewriting", "Write one request asking an assistant to rewrite, summarize or correct this sentence: {s} Write "
     "only the request, including the sentence.", _SENTENCES),
    ("advice", "Someone says: \"{s}.\" Write the question they might ask an assistant. Write only the question.",
     _SITUATIONS),
    ("fact", "Write one question about the history, geography or culture of {s}. Write only the question.",
     _COUNTRIES),
    ("chat", "Write one friendly message a person might send to a chatbot about {s}. Write only the message.",
     _CREATIVE_SUBJECTS),
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
