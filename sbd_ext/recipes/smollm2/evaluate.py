"""What the conversion buys and what it costs.

* :func:`table1`: the paper's Table 1 on held-out problems of the arithmetic task, greedy -- the NTP control with
  NTP decoding, the SBD model with NTP decoding, SBD decoding for k in {8, 16} x gamma in {0.1, 0.35} with the
  entropy-bounded (EB) and the entropy-threshold samplers, and verify mode (lossless); accuracy and NFE reduction
  (:func:`sbd_ext.demo.evaluate.run_eval`, batched).
* :func:`perplexity`: next-token perplexity on natural-language text that is on every machine and that nobody here
  wrote: the docstrings of a fixed list of Python standard-library modules (:func:`stdlib_text`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import platform
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ...demo import evaluate as demo_eval
from . import checkpoint

__all__ = ["GAMMAS", "BLOCK_SIZES", "SAMPLERS", "STDLIB_MODULES", "table1", "stdlib_text", "perplexity"]

GAMMAS = (0.1, 0.35)  # the paper's reasoning gamma_low / gamma_high
BLOCK_SIZES = (8, 16)
SAMPLERS = ("eb", "entropy")
VERIFY_BLOCK_SIZES = (8,)
MAX_NEW_TOKENS = 96  # answers are ~50-60 SmolLM2 tokens

# Pure-Python modules present in every CPython 3.10-3.13, chosen for their prose (long docstrings).
STDLIB_MODULES = (
    "argparse.py",
    "calendar.py",
    "contextlib.py",
    "dataclasses.py",
    "difflib.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "inspect.py",
    "json/__init__.py",
    "pathlib.py",
    "random.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tempfile.py",
    "textwrap.py",
    "threading.py",
    "typing.py",
)


def table1(sbd: str | Path | None, control: str | Path | None, n: int = 500, batch_size: int = 50) -> dict:
    """Table 1 rows for the SBD model folder ``sbd`` and the NTP control ``control`` (either may be None)."""
    result = demo_eval.run_eval(
        sbd_model=None if sbd is None else str(sbd),
        ntp_model=None if control is None else str(control),
        n=n,
        gammas=GAMMAS,
        block_sizes=BLOCK_SIZES,
        samplers=SAMPLERS,
        batch_size=batch_size,
        max_new_tokens=MAX_NEW_TOKENS,
        verify_block_sizes=VERIFY_BLOCK_SIZES,
    )
    result["meta"].update(title="SmolLM2-135M converted to SBD", model="SmolLM2-135M-Instruct", dtype="float32")
    return result


def merge_tables(control: dict, sbd: dict) -> dict:
    """One table from a control-only and an SBD-only :func:`table1` (NFE reductions relative to the control)."""
    rows = list(control["rows"]) + list(sbd["rows"])
    base = rows[0]["mean_nfe"]
    for r in rows:
        r["nfe_reduction"] = base / r["mean_nfe"]
    meta = {**sbd["meta"], "baseline": rows[0]["name"]}
    return {"rows": rows, "meta": meta}


def stdlib_text(modules=STDLIB_MODULES) -> tuple[str, dict]:
    """The docstrings (module, class, function; in file order) of ``modules`` of this interpreter's standard
    library, joined by blank lines; and a record of where they came from (Python version, SHA-256)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, used = [], []
    for rel in modules:
        path = root / rel
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) >= 80:  # prose, not one-line labels
                    parts.append(doc)
        used.append(rel)
    text = "\n\n".join(parts)
    meta = {
        "python": platform.python_version(),
        "modules": used,
        "docstrings": len(parts),
        "chars": len(text),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
    }
    return text, meta


@torch.no_grad()
def perplexity(model, token_ids: list[int], window: int = 512, exclude_ids=()) -> dict:
    """Next-token perplexity over ``token_ids`` in non-overlapping windows of ``window`` tokens (each window's
    first token is context only). ``exclude_ids`` (the mask token) get no probability mass."""
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        ids = torch.tensor([token_ids[start : start + window]])
        if ids.shape[1] < 2:
            break
        logits = model(input_ids=ids, use_cache=False).logits.float()
        for i in exclude_ids:
            logits[..., i] = float("-inf")
        nll += float(F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return {"tokens": count, "nll_per_token": nll / count, "perplexity": math.exp(nll / count)}


def perplexity_table(models: dict, max_tokens: int = 16384, window: int = 512) -> dict:
    """Perplexity of each ``{name: folder or None}`` (None = the base SmolLM2) on :func:`stdlib_text`, cut at
    ``max_tokens`` tokens of SmolLM2's tokenizer."""
    from ...demo import models as demo_models

    text, meta = stdlib_text()
    rows = {}
    ids = None
    for name, folder in models.items():
        t0 = time.perf_counter()
        if folder is None:
            model, tok = checkpoint.load_base(attn_implementation="sdpa")
        else:
            model, tok = demo_models.load(folder, attn_implementation="sdpa")
        if ids is None:
            ids = tok(text, add_special_tokens=False)["input_ids"][:max_tokens]
        rows[name] = {**perplexity(model, ids, window, exclude_ids=(tok.mask_token_id,)), "folder": str(folder)}
        rows[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"  {name:<12} perplexity {rows[name]['perplexity']:.3f} over {rows[name]['tokens']} tokens", flush=True)
        del model
    return {"text": meta, "window": window, "max_tokens": max_tokens, "rows": rows}


def save_json(obj: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1) + "\n")
