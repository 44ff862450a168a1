"""The gated-drafter recipe: a drafter for a model of your own, over any local HF model folder (a Llama-family
causal LM with its tokenizer), offline. The model stays as it is: verify decoding with the drafter returns exactly
its own answers, in fewer forwards.

    python -m sbd_ext.recipes.drafter data  --base DIR --out RUN [--n 1024 --max-new-tokens 128 --batch-size 16]
    python -m sbd_ext.recipes.drafter data  --base DIR --out RUN --prompts self [--n 1024]
    python -m sbd_ext.recipes.drafter train --base DIR --out RUN [--steps 2000 --threads 2]   # --resume continues
    python -m sbd_ext.recipes.drafter head  --artifact RUN/artifact --samples RUN/samples.pt --out HEAD
    python -m sbd_ext.recipes.drafter store --artifact HEAD/artifact --samples RUN/samples.pt --out HEAD
    python -m sbd_ext.recipes.drafter eval  --artifact HEAD/artifact [--n 16 --block-sizes 2 --thresholds 100]
    python -m sbd_ext.recipes.drafter ship  --out HEAD --dest DRAFTER --block-size 2 --threshold 100 --lookup 16 \\
        --branch

* ``data``: the model's greedy answers (sbd_ext's NTP decoding) to the recipe's generated prompts in its chat
  template (plain text for a model without one), or to instructions it writes itself (``--prompts self``);
* ``train``: rank-16 gated LoRA + the mask token's row, self-distilled on those answers, with the settings the
  shipped SmolLM2 drafter ended on unless given: fully masked blocks of 2-5 (how verify drafts), no loss on a
  block's first slot (the commit row supplies it);
* ``head`` (optional): the sampler head (slot 1 rescored given slot 0's token);
* ``store`` (optional): the draft store (n-gram -> the token that most often followed it in the answers: verify's
  lookup drafts where the context has none);
* ``eval``: tokens per forward on the 56 held-out general prompts, and equality with the model's NTP decoding;
* ``ship``: the drafter with its recommended settings in ``--dest``, its record in ``ship_check.json``.

Load it with ``sbd_ext.demo.models.load(DRAFTER)`` (the base is the folder the drafter names in
``base_model_name_or_path``; ``sbd_ext.drafter.load_drafter(DRAFTER, base=DIR)`` points elsewhere) or
``sbd-ext generate --model DRAFTER "a question"``.

The recipe's modules, one per stage: :mod:`.prompts` (the training prompt generator and the held-out prompts, data
files beside it), :mod:`.bases` (what a drafter drafts for; :class:`DrafterConfig`), :mod:`.data`, :mod:`.train`,
:mod:`.head`, :mod:`.store`, :mod:`.evaluate`, :mod:`.ship`, :mod:`.cli` (the command line; :mod:`.args` its
checks). SmolLM2 is one configuration of it (:mod:`sbd_ext.recipes.smollm2.drafter`: the embedded base and its
arithmetic control, no ``--base``).
"""

from __future__ import annotations

import sys

from .bases import CHECKPOINT_FILE, SAMPLES_FILE, TASKS, DrafterConfig, artifact_base, artifact_task
from .cli import main as _cli_main
from .data import greedy_answers, make_samples, make_self_prompts
from .evaluate import evaluate, slot_accuracy, verify_settings
from .head import train_head
from .ship import ship
from .store import build_store
from .train import BUCKET_WINDOW, make_batches, padding_fraction, train

__all__ = [
    "BUCKET_WINDOW",
    "CHECKPOINT_FILE",
    "SAMPLES_FILE",
    "TASKS",
    "DrafterConfig",
    "artifact_base",
    "artifact_task",
    "build_store",
    "evaluate",
    "greedy_answers",
    "main",
    "make_batches",
    "make_samples",
    "make_self_prompts",
    "padding_fraction",
    "ship",
    "slot_accuracy",
    "train",
    "train_head",
    "verify_settings",
]

PROG = "python -m sbd_ext.recipes.drafter"
# verify's drafting settings (docs/drafter.md): where train is not told otherwise
TRAIN_DEFAULTS = {"--block-size-range": ["2", "5"], "--full-block-prob": ["1.0"], "--no-first-slot-loss": []}


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cmd = argv[0] if argv else ""
    if cmd in ("data", "train") and not _given(argv, "--base"):
        print(f"{PROG} {cmd}: --base DIR (your model's local HF folder) is required", file=sys.stderr)
        return 2
    if cmd == "head" and not _given(argv, "--artifact"):
        print(f"{PROG} head: --artifact RUN/artifact (the drafter to give a head) is required", file=sys.stderr)
        return 2
    if cmd == "train":  # the same on --resume (which checks the run's settings)
        argv = argv + [a for flag, vals in TRAIN_DEFAULTS.items() if not _given(argv, flag) for a in (flag, *vals)]
    return _cli_main(argv, prog=PROG, description=__doc__.split("\n\n")[0])
