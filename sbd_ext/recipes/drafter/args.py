"""The drafter recipe's command line checks (:mod:`.cli`, behind :mod:`sbd_ext.recipes.drafter` and
:mod:`sbd_ext.recipes.smollm2.drafter`): arguments checked before anything is loaded, and errors as one line, as
the ``sbd-ext`` CLI does.

Exit codes: 2 a bad argument (argparse's one-line usage error: a count below 1, ``--threads`` below 1, a ``--base``
folder without a model config or tokenizer files, ``--block-size-range`` MIN > MAX); 1 a request the run cannot
serve (fewer samples than ``--batch-size``, a run folder of other settings, ...), one line on stderr.
``SBD_EXT_TRACEBACK=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys
from pathlib import Path

from ...demo.argtypes import finite_number as number  # noqa: F401  (re-exported: the recipe's parsers)
from ...demo.argtypes import int_in as count

__all__ = [
    "TRAIN_INTS",
    "auto_precision",
    "base_path",
    "check_args",
    "check_batches",
    "count",
    "guarded",
    "number",
    "reported",
    "until",
]

PRECISIONS = ("fp32", "bf16", "auto")  # train --precision


def auto_precision(device) -> str:
    """ "bf16" on a GPU or on a CPU with bf16 products in hardware that the OS lets a process use (AMX-BF16:
    ``build_info()["cpu_bf16_matmul_units"]``; AVX512-BF16: ``build_info()["cpu_avx512_bf16"]``, where bf16
    autocast trained 1.56x fp32's answer tokens per second on an AMD EPYC Zen 4), else "fp32": on AVX2 bf16
    products are emulated, slower than fp32."""
    from ... import build_info

    info = build_info()
    cpu_bf16 = info["cpu_bf16_matmul_units"] or info["cpu_avx512_bf16"]
    return "bf16" if str(device).startswith("cuda") or cpu_bf16 else "fp32"


def until(batches, deadline: float):
    """``batches`` over and over (a one-shot iterator) until ``time.time()`` passes ``deadline`` (the first batch
    always: a call makes progress): train_loop then stops at that step and checkpoints it."""
    import time

    first = True
    while True:
        for b in batches:
            if not first and time.time() >= deadline:
                return
            first = False
            yield b


# the files AutoTokenizer builds a tokenizer from (sbd_ext.demo.export checks the same)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


# train's integer settings (DrafterConfig's fields)
TRAIN_INTS = {
    "steps": count(1),
    "batch_size": count(1),
    "max_len": count(2),
    "rank": count(1),
    "warmup": count(0),
    "seed": count(0),
    "checkpoint_every": count(1),
    "log_every": count(1),
}


def base_path(base: str | Path | None) -> str:
    """``--base``: the absolute path of a local HF model folder ("" for SmolLM2); ValueError for a folder without a
    model config or without tokenizer files (the tokenizer's loader would say "sentencepiece or tiktoken")."""
    if not base:
        return ""
    p = Path(base).expanduser().resolve()
    if not (p / "config.json").is_file():
        raise ValueError(f"--base {base}: not a local HF model folder (no config.json)")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(
            f"--base {base}: no tokenizer files ({' / '.join(TOKENIZER_FILES)}): copy the model's tokenizer into it"
        )
    return str(p)


def check_args(ap: argparse.ArgumentParser, args) -> None:
    """What the argument types cannot see, as usage errors (exit code 2) before anything is loaded."""
    if getattr(args, "base", None):
        try:
            base_path(args.base)
        except ValueError as e:
            ap.error(str(e))
        if (getattr(args, "task", None) or "general") != "general":
            ap.error(f"--base drafts for a model of your own: --task general, not {args.task!r}")
    device = getattr(args, "device", None)
    if device is not None:
        import torch

        try:
            dev = torch.device(device)
        except RuntimeError as e:
            ap.error(f"--device {device!r}: {e}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            ap.error(f"--device {device}: no CUDA GPU here (torch {torch.__version__})")
        if dev.type not in ("cpu", "cuda"):
            ap.error(f"--device {device}: cpu or cuda")
    bounds = getattr(args, "block_size_range", None)
    if bounds is not None and bounds[0] > bounds[1]:
        ap.error(f"--block-size-range MIN MAX: MIN {bounds[0]} is above MAX {bounds[1]}")


def check_batches(path: Path, n_samples: int, batch_size: int) -> None:
    """A training batch takes ``batch_size`` samples: fewer in the run folder is refused, naming both settings."""
    if n_samples < batch_size:
        raise ValueError(
            f"{path} holds {n_samples} samples, fewer than --batch-size {batch_size} (one training batch): make more "
            f"with `data --n {batch_size}` or more, or train with --batch-size {max(n_samples, 1)} or less"
        )


def reported(prog: str, argv: list[str] | None, e: BaseException) -> int:
    """``e`` as one line on stderr (``PROG CMD: error: ...``); exit code 1."""
    cmd = (argv if argv is not None else sys.argv[1:])[:1]
    one_line = " ".join(line.strip() for line in str(e).splitlines())
    print(f"{' '.join([prog, *cmd])}: error: {one_line}", file=sys.stderr)
    return 1


def guarded(main):
    """``main(argv, prog=...)`` whose errors a user can cause (ValueError, OSError: a run folder of other settings,
    a missing file) end as one line on stderr and exit code 1, no traceback (``SBD_EXT_TRACEBACK=1``: raised)."""
    default_prog = inspect.signature(main).parameters["prog"].default

    @functools.wraps(main)
    def run(argv: list[str] | None = None, prog: str = default_prog, **kw) -> int:
        try:
            return main(argv, prog=prog, **kw)
        except (ValueError, OSError) as e:
            if os.environ.get("SBD_EXT_TRACEBACK"):
                raise
            return reported(prog, argv, e)

    return run
