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
import shutil
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ... import adapters
from ...demo import evaluate as demo_eval
from ...demo import models as demo_models
from ...demo import tasks
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


def table1(
    sbd: str | Path | None,
    control: str | Path | None,
    n: int = 500,
    batch_size: int = 50,
    samplers=SAMPLERS,
    block_sizes=BLOCK_SIZES,
    gammas=GAMMAS,
    verify_block_sizes=VERIFY_BLOCK_SIZES,
    sbd_model_ntp_row: bool = True,
) -> dict:
    """Table 1 rows for the SBD model folder ``sbd`` and the NTP control ``control`` (either may be None); the
    sweep can be cut into parts (samplers x block sizes x gammas, verify block sizes) run by separate processes."""
    result = demo_eval.run_eval(
        sbd_model=None if sbd is None else str(sbd),
        ntp_model=None if control is None else str(control),
        n=n,
        gammas=gammas,
        block_sizes=block_sizes,
        samplers=samplers,
        batch_size=batch_size,
        max_new_tokens=MAX_NEW_TOKENS,
        verify_block_sizes=verify_block_sizes,
        sbd_model_ntp_row=sbd_model_ntp_row,
    )
    result["meta"].update(title="SmolLM2-135M converted to SBD", model="SmolLM2-135M-Instruct", dtype="float32")
    return result


def merge_tables(control: dict, *sbd: dict) -> dict:
    """One table from a control-only and SBD-only :func:`table1` parts (NFE reductions relative to the control;
    the SBD model's NTP row first)."""
    sbd_rows = [r for part in sbd for r in part["rows"]]
    rows = list(control["rows"]) + sorted(sbd_rows, key=lambda r: r["decoding"] != "ntp")
    base = rows[0]["mean_nfe"]
    for r in rows:
        r["nfe_reduction"] = base / r["mean_nfe"]
    meta = {**sbd[0]["meta"], "baseline": rows[0]["name"], "parts": len(sbd)}
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


def ship(
    artifact: str | Path, dest: str | Path, block_size: int, sampler: str, threshold: float, check: dict, verify: bool
) -> Path:
    """Copy a trained artifact into ``dest`` (the package's ``demo/models/smollm2-sbd``) with its recommended SBD
    settings (in ``sbd_config.json``'s ``generation``, which :func:`sbd_ext.adapters.load_artifact` puts on the
    model's generation config), the demo's ``sbd_demo.json`` (prompt template and settings for ``sbd-ext``) and
    ``check`` (accuracy / NFE on the first held-out problems, which the shipped-model test re-measures)."""
    artifact, dest = Path(artifact), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in (adapters.ADAPTER_FILE, adapters.MASK_ROW_FILE):
        shutil.copyfile(artifact / name, dest / name)
    meta = adapters.read_artifact_config(artifact)
    meta["generation"] = {
        "sbd_block_size": block_size,
        "sbd_sampler": sampler,
        "sbd_threshold": threshold,
        "sbd_verify": verify,
    }
    (dest / adapters.CONFIG_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    demo = {
        "task": "arith",
        "prompt_template": "Q: {prompt}\nA: ",
        "block_size": block_size,
        "sampler": sampler,
        "gamma_low": threshold,
        "gamma_high": GAMMAS[1],
        "objective": "sbd",
        "verify": verify,
        "max_new_tokens": MAX_NEW_TOKENS,
    }
    (dest / "sbd_demo.json").write_text(json.dumps(demo, indent=1) + "\n")
    (dest / "ship_check.json").write_text(json.dumps(check, indent=1) + "\n")
    return dest


def ship_control(artifact: str | Path, dest: str | Path, check: dict) -> Path:
    """Copy the NTP control's artifact into ``dest`` (the package's ``demo/models/smollm2-ntp``: the frozen base of
    the arithmetic drafter, :func:`.checkpoint.load_control`), recommending NTP decoding (``sbd_mode="ntp"``; its
    mask token was never trained), with ``check`` (its NTP accuracy on the first held-out problems)."""
    artifact, dest = Path(artifact), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in (adapters.ADAPTER_FILE, adapters.MASK_ROW_FILE):
        shutil.copyfile(artifact / name, dest / name)
    meta = adapters.read_artifact_config(artifact)
    meta["generation"] = {"sbd_mode": "ntp"}
    (dest / adapters.CONFIG_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    demo = {"task": "arith", "prompt_template": "Q: {prompt}\nA: ", "objective": "ntp", "mode": "ntp"}
    demo["max_new_tokens"] = MAX_NEW_TOKENS
    (dest / "sbd_demo.json").write_text(json.dumps(demo, indent=1) + "\n")
    (dest / "ship_check.json").write_text(json.dumps(check, indent=1) + "\n")
    return dest


def check_record_ntp(model_name: str | Path, n: int) -> dict:
    """Accuracy and mean NFE of NTP decoding on the first ``n`` held-out problems (the control's record)."""
    model, tok = demo_models.load(model_name)
    probs = list(tasks.problems("test", n))
    res = demo_eval.decode(
        model, tok, [p.prompt for p in probs], batch_size=50, mode="ntp", max_new_tokens=MAX_NEW_TOKENS
    )
    return {
        "mode": "ntp",
        "n": n,
        "accuracy": tasks.accuracy(res["completions"], probs),
        "mean_nfe": sum(res["nfe"]) / n,
        "mean_tokens": sum(res["num_generated"]) / n,
    }


def check_record(
    model_name: str | Path, n: int, block_size: int, sampler: str, threshold: float, verify: bool = False
) -> dict:
    """Accuracy and mean NFE of SBD decoding (the recommended settings) on the first ``n`` held-out problems."""
    model, tok = demo_models.load(model_name)
    probs = list(tasks.problems("test", n))
    res = demo_eval.decode(
        model,
        tok,
        [p.prompt for p in probs],
        batch_size=50,
        mode="sbd",
        block_size=block_size,
        sampler=sampler,
        threshold=threshold,
        verify=verify,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    return {
        "verify": verify,
        "n": n,
        "block_size": block_size,
        "sampler": sampler,
        "threshold": threshold,
        "accuracy": tasks.accuracy(res["completions"], probs),
        "mean_nfe": sum(res["nfe"]) / n,
        "mean_tokens": sum(res["num_generated"]) / n,
    }


def plot_curves(run: str | Path, path: str | Path) -> bool:
    """The training curves of both objectives (NTP loss, masked loss, mask accuracy per logged step) from
    ``<run>/{sbd,ntp}/train_log.json``; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), dpi=110)
    for objective, style in (("sbd", "-"), ("ntp", "--")):
        log_file = Path(run) / objective / "train_log.json"
        if not log_file.is_file():
            continue
        hist = [h for h in json.loads(log_file.read_text())["history"] if "loss" in h]
        steps = [h["step"] for h in hist]
        for ax, key in zip(axes, ("ntp_loss", "mask_loss", "mask_accuracy"), strict=True):
            if key in hist[0]:
                ax.plot(steps, [h[key] for h in hist], style, label=f"{objective} run")
    for ax, title in zip(axes, ("NTP loss (clean half)", "masked loss", "mask accuracy"), strict=True):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    fig.suptitle("SmolLM2-135M SBD conversion (LoRA r=16 + mask row, batch 8) and its NTP control", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
