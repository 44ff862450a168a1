"""Held-out evaluation of SBD against next-token decoding: the paper's Table 1 at small scale.

:func:`run_eval` decodes the same held-out problems with

(a) the NTP control model, next-token decoding;
(b) the SBD model, next-token decoding;
(c) the SBD model, SBD decoding (greedy) for each sampler, block size and gamma of a sweep: the paper's
    entropy-bounded rule ("eb", Eq. 8: reveal the lowest-entropy positions while the entropies of all but the last
    revealed sum to <= gamma) and the entropy-threshold rule ("entropy": reveal every position with H < gamma);

and records accuracy, mean NFE (model forwards per problem, prefill included), tokens per forward, the NFE
reduction relative to (a) and the wall-clock. :func:`markdown_table` renders it in the paper's format
("accuracy (NFE reduction)"), :func:`plot` draws accuracy against tokens per forward (needs matplotlib).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..decoding import GenerationSettings, generate
from . import models, tasks

__all__ = [
    "decode",
    "run_eval",
    "markdown_table",
    "plot",
    "DEFAULT_GAMMAS",
    "DEFAULT_BLOCK_SIZES",
    "DEFAULT_SAMPLERS",
    "DEFAULT_VERIFY_BLOCK_SIZES",
]

DEFAULT_VERIFY_BLOCK_SIZES = (8,)
DEFAULT_GAMMAS = (0.0, 0.005, 0.01, 0.05, 0.1, 0.35, 0.6, 1.0, 2.0)
DEFAULT_BLOCK_SIZES = (8, 16)
DEFAULT_SAMPLERS = ("eb", "entropy")
LABELLED_GAMMAS = (0.0, 0.1, 0.35, 1.0)


def format_prompt(question: str, template: str | None) -> str:
    """Apply a model's prompt template (``"Q: {prompt}\\nA: "``) unless the text is already a full prompt."""
    if not template or question.lstrip().startswith(template.split("{prompt}")[0].strip() or "\0"):
        return question
    return template.format(prompt=question.strip())


@torch.no_grad()
def decode(
    model,
    tok,
    prompts: Sequence[str],
    settings=None,
    *,
    batch_size: int = 32,
    return_trace: bool = False,
    on_final_tokens=None,
    **overrides,
) -> dict:
    """Decode ``prompts`` with :func:`sbd_ext.decoding.generate` in batches.

    ``settings`` / ``**overrides``: a :class:`sbd_ext.decoding.GenerationSettings` and its fields by keyword, as
    for ``generate``; the demo's defaults are ``max_new_tokens=160`` and the tokenizer's EOS and pad ids.
    Returns a dict: completions (text, special tokens and everything after the first EOS removed), nfe and
    num_generated (lists of ints, one per prompt), seconds (total wall-clock), traces (with ``return_trace``),
    prompt_lengths, token_ids (the generated ids), corrections (verify mode: indices into token_ids of the tokens
    verification corrected). ``on_final_tokens(row, ids)``: streaming, as for ``generate`` (row: within a batch).
    """

    demo_defaults = dict(max_new_tokens=160, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if settings is None:
        settings = GenerationSettings(**{**demo_defaults, **overrides})
    else:
        settings = GenerationSettings.of(settings, **overrides)
    dev = next(model.parameters()).device
    out = {
        "completions": [],
        "nfe": [],
        "num_generated": [],
        "traces": [],
        "prompt_lengths": [],
        "token_ids": [],
        "corrections": [],
    }
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = list(prompts[i : i + batch_size])
        enc = tok(chunk, return_tensors="pt", padding=True, padding_side="left")
        res = generate(
            model,
            enc.input_ids.to(dev),
            enc.attention_mask.to(dev),
            settings,
            return_trace=return_trace,
            on_final_tokens=on_final_tokens,
        )
        for b in range(len(chunk)):
            p = int(res.prompt_lengths[b])
            ids = res.sequences[b, p : p + int(res.num_generated[b])].tolist()
            out["token_ids"].append(ids)
            out["completions"].append(tok.decode(ids, skip_special_tokens=True))
            out["nfe"].append(int(res.nfe[b]))
            out["num_generated"].append(int(res.num_generated[b]))
            out["prompt_lengths"].append(p)
            out["corrections"].append([c - p for c in res.corrections[b]])
            if return_trace:
                out["traces"].append(res.trace[b])
    out["seconds"] = time.perf_counter() - t0
    return out


def _row(name, model_name, mode, block_size, gamma, probs, res, sampler=None) -> dict:
    n = len(probs)
    nfe = sum(res["nfe"]) / n
    gen = sum(res["num_generated"]) / n
    return {
        "name": name,
        "model": model_name,
        "decoding": mode,
        "sampler": sampler,
        "block_size": block_size,
        "gamma": gamma,
        "n": n,
        "accuracy": tasks.accuracy(res["completions"], probs),
        "mean_nfe": nfe,
        "mean_tokens": gen,
        "tokens_per_forward": gen / nfe,
        "seconds": res["seconds"],
    }


def run_eval(
    sbd_model: str | None = "sbd-arith",
    ntp_model: str | None = "ntp-arith",
    n: int = 500,
    gammas: Sequence[float] = DEFAULT_GAMMAS,
    block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
    samplers: Sequence[str] = DEFAULT_SAMPLERS,
    batch_size: int = 50,
    max_new_tokens: int = 160,
    task: str = "arith",
    progress: bool = True,
    verify_block_sizes: Sequence[int] = DEFAULT_VERIFY_BLOCK_SIZES,
    sbd_model_ntp_row: bool = True,
) -> dict:
    """Evaluate on the first ``n`` held-out problems of ``task``; returns {"rows": [...], "meta": {...}}.

    ``sbd_model`` / ``ntp_model``: embedded model names or folders (:func:`sbd_ext.demo.models.load`); either may be
    None (only the other is decoded). NFE reductions are relative to the first row. ``sbd_model_ntp_row``: also
    decode with the SBD model in NTP mode (its own baseline)."""
    probs = list(tasks.problems("test", n, task=task))
    rows = []

    def log(r):
        if progress:
            print(
                f"  {r['name']:<34} acc {100 * r['accuracy']:5.1f}  NFE {r['mean_nfe']:6.1f}  "
                f"tok/fwd {r['tokens_per_forward']:5.2f}  {r['seconds']:6.1f} s",
                flush=True,
            )

    def prompts_for(folder):
        tmpl = models.demo_info(folder).get("prompt_template")
        return [format_prompt(p.prompt, tmpl) for p in probs]

    common = dict(batch_size=batch_size, max_new_tokens=max_new_tokens)
    if ntp_model is not None:
        model, tok = models.load(ntp_model)
        res = decode(model, tok, prompts_for(ntp_model), mode="ntp", **common)
        rows.append(_row("NTP control", str(ntp_model), "ntp", None, None, probs, res))
        log(rows[-1])
    if sbd_model is None:
        samplers, verify_block_sizes = (), ()
    else:
        model, tok = models.load(sbd_model)
        prompts = prompts_for(sbd_model)
        if sbd_model_ntp_row:
            res = decode(model, tok, prompts, mode="ntp", **common)
            rows.append(_row("SBD model, NTP decoding", str(sbd_model), "ntp", None, None, probs, res))
            log(rows[-1])
    for sampler in samplers:
        for k in block_sizes:
            for g in gammas:
                res = decode(
                    model, tok, prompts, mode="sbd", block_size=int(k), sampler=sampler, threshold=float(g), **common
                )
                name = f"SBD {sampler} k={k} gamma={g:g}"
                rows.append(_row(name, str(sbd_model), "sbd", int(k), float(g), probs, res, sampler))
                log(rows[-1])
    # Verify mode (lossless: equals the SBD model's NTP decoding): the gamma trade-off is speed only.
    for k in verify_block_sizes:
        for g in gammas:
            res = decode(
                model, tok, prompts, block_size=int(k), sampler="eb", threshold=float(g), verify=True, **common
            )
            name = f"SBD verify eb k={k} gamma={g:g}"
            rows.append(_row(name, str(sbd_model), "sbd+verify", int(k), float(g), probs, res, "eb"))
            log(rows[-1])
    base = rows[0]["mean_nfe"]
    for r in rows:
        r["nfe_reduction"] = base / r["mean_nfe"]
    meta = {
        "task": task,
        "n": n,
        "split": "test",
        "samplers": list(samplers),
        "greedy": True,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "baseline": rows[0]["name"],
    }
    return {"rows": rows, "meta": meta}


def markdown_table(
    result: dict, gamma_low: float | None = None, gamma_high: float | None = None, sampler: str | None = None
) -> str:
    """Two Markdown tables: the paper's Table 1 format (accuracy with NFE reduction), then every row in full.

    ``gamma_low`` / ``gamma_high`` (of ``sampler``) are marked in the first table."""
    rows, meta = result["rows"], result["meta"]
    task = meta.get("task", "arith")
    lines = [
        f"| Method | {task} (held-out, n={meta['n']}) |",
        "|---|---|",
    ]
    for r in rows:
        acc = f"{100 * r['accuracy']:.1f}"
        if r is rows[0]:
            cell = acc
        else:
            cell = f"{acc} ({r['nfe_reduction']:.2f}×)"
        name = r["name"]
        if r["decoding"] in ("sbd", "sbd+verify"):
            tag = ""
            if sampler is None or r.get("sampler") == sampler:
                if gamma_low is not None and r["gamma"] == gamma_low:
                    tag = " = γ_low"
                elif gamma_high is not None and r["gamma"] == gamma_high:
                    tag = " = γ_high"
            kind = "SBD verify" if r["decoding"] == "sbd+verify" else "SBD"
            name = f"{kind} {r.get('sampler') or 'eb'}, k={r['block_size']}, γ={r['gamma']:g}{tag}"
        lines.append(f"| {name} | {cell} |")
    lines += [
        "",
        "| model | decoding | sampler | k | γ | accuracy % | mean NFE | tokens/forward | NFE reduction | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['decoding']} | {r.get('sampler') or ''} | {r['block_size'] or ''} | "
            f"{'' if r['gamma'] is None else format(r['gamma'], 'g')} | {100 * r['accuracy']:.1f} | "
            f"{r['mean_nfe']:.1f} | {r['tokens_per_forward']:.2f} | {r['nfe_reduction']:.2f}× | {r['seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str | Path) -> bool:
    """Accuracy vs tokens per forward (one line per block size, gamma annotated); False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7.2, 4.8), dpi=120)
    markers = iter("os^Dv<>ph")
    key = lambda r: (r["decoding"], r.get("sampler") or "eb", r["block_size"])  # noqa: E731
    curves = sorted({key(r) for r in rows if r["decoding"] in ("sbd", "sbd+verify")})
    for decoding, sampler, k in curves:
        rs = sorted((r for r in rows if key(r) == (decoding, sampler, k)), key=lambda r: r["gamma"])
        xs, ys = [r["tokens_per_forward"] for r in rs], [100 * r["accuracy"] for r in rs]
        ls = ":" if decoding == "sbd+verify" else ("-" if sampler == "eb" else "--")
        label = f"SBD {'verify ' if decoding == 'sbd+verify' else ''}k={k}, {sampler} sampler"
        (line,) = ax.plot(xs, ys, marker=next(markers), ls=ls, label=label)
        for r, x, y in zip(rs, xs, ys, strict=True):
            if r["gamma"] in LABELLED_GAMMAS:  # the paper's gammas and the ends; the rest are in table.md
                ax.annotate(
                    f"γ={r['gamma']:g}",
                    (x, y),
                    textcoords="offset points",
                    xytext=(4, -10),
                    fontsize=6,
                    color=line.get_color(),
                )
    ntp_rows = [r for r in rows if r["decoding"] == "ntp"]
    for r, color, ls in zip(ntp_rows, ("k", "C3"), ("--", ":"), strict=False):
        ax.axhline(100 * r["accuracy"], color=color, ls=ls, lw=1, label=f"{r['name']} (1 token/forward)")
    ax.set_xlabel("tokens per forward (higher = fewer model calls)")
    ax.set_ylabel(f"held-out accuracy % (n={result['meta']['n']})")
    title = result["meta"].get("title", "SBD on the embedded model")
    ax.set_title(f"{title}: accuracy vs parallelism ({result['meta'].get('task', '')})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def save_results(result: dict, out_dir: str | Path, gamma_low=None, gamma_high=None, sampler=None) -> dict:
    """Write results.json, table.md and (when matplotlib is present) accuracy_vs_tpf.png into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    md = markdown_table(result, gamma_low, gamma_high, sampler)
    (out / "table.md").write_text(md)
    files = {"json": out / "results.json", "table": out / "table.md"}
    if plot(result, out / "accuracy_vs_tpf.png"):
        files["plot"] = out / "accuracy_vs_tpf.png"
    return files
