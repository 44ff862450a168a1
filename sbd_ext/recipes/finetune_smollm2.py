"""SBD fine-tune of SmolLM2-135M-Instruct on the project's arithmetic reasoning task, with an NTP control.

One command, two scales::

    python -m sbd_ext.recipes.finetune_smollm2 --smoke                 # CPU, ~1-3 min: a few steps, loss printed
    python -m sbd_ext.recipes.finetune_smollm2 --steps 3000 --out DIR  # the real run, for a GPU (tens of minutes)

Recipe (the paper's Alg. 1 on a real pretrained Llama, scaled down):

* model: SmolLM2-135M-Instruct from :mod:`sbd_ext.recipes.smollm2` (the offline GGUF, de-quantized to float32); the mask
  token ``<|mask|>`` is added with :func:`sbd_ext.training.add_mask_token` (new id 49152, embedding row = the
  mean row; the embedding is tied, so the output row too) and recorded in ``config.mask_token_id`` together with
  ``config.sbd_block_size_range`` = [2, 16].
* data: the task of :mod:`sbd_ext.demo.tasks` (GSM8K-shaped multi-step arithmetic word problems, disjoint train/test
  splits); each sample is ``prompt + completion + EOS``, tokenized with the model's tokenizer, right-padded; the
  prompt tokens carry no loss (``labels = -100``), in both objectives.
* SBD run: :func:`sbd_ext.training.sbd_loss` -- one forward over ``cat(x, x_hat)`` with the three-part mask, k ~
  U[2, 16] per step, eta ~ U(0, 1) per sequence; loss = NTP CE on the clean half + CE on the masked positions.
* NTP control: the same model, data order, steps, batch, optimizer, schedule and trainable parameters, with the
  plain next-token loss. The SBD run sees 2L tokens per sequence per step; the budget that is held equal is the
  number of optimizer steps and training sequences, as in the paper's comparison.
* what is trained (``--method``): ``lora`` (needs ``peft``: rank-16 adapters on q/k/v/o/gate/up/down + the mask
  row of the embedding), ``full`` (every weight), ``attn`` (attention projections and norms + the embedding,
  MLPs frozen). ``auto`` = ``lora`` when ``peft`` is installed, else ``full``.
* optimizer: AdamW (betas 0.9/0.95, no weight decay), linear warm-up then cosine to 0, clip 1.0; lr 1e-4 for
  full/attn, 1e-3 for LoRA. fp32 master weights; on a GPU the forward runs under bf16 autocast.
* result (``--out DIR``): ``DIR/{sbd,ntp}/`` with the compact weights -- the LoRA adapter, or for full/attn the
  changed tensors in bf16 (``weights.safetensors``) -- plus ``mask_embedding.safetensors`` (the mask token's row),
  ``sbd_config.json`` and ``train_log.json``; ``DIR/results.json`` with the evaluation. :func:`load_finetuned`
  rebuilds the model from the base checkpoint and such a folder.
* evaluation (``--eval N``, default 200 on a GPU): on N held-out problems, accuracy and forwards per sequence (NFE)
  of the NTP control with NTP decoding, the SBD model with NTP decoding, and the SBD model with SBD decoding (EB
  sampler, block 16, gamma 0.1 and 0.35, the paper's reasoning values), all greedy through ``sbd_ext.generate``;
  and the wall-clock of each against HF ``generate`` (greedy, KV cache, "sdpa") of the NTP control.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["FinetuneConfig", "run", "main", "load_finetuned", "task_problems", "make_batches", "evaluate"]

IGNORE_INDEX = -100
GAMMAS = (0.1, 0.35)  # the paper's reasoning gamma_low / gamma_high for the EB sampler
BLOCK_SIZE = 16
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# --------------------------------------------------------------------------------------------------------
# the task
# --------------------------------------------------------------------------------------------------------
def task_problems(split: str, n: int | None, seed: int = 0) -> Iterator:
    """Problems of the project's reasoning task, :func:`sbd_ext.demo.tasks.problems` (``prompt``, ``completion``,
    ``answer``; the train and test splits are disjoint by construction)."""
    from ..demo import tasks

    return tasks.problems(split, n=n, seed=seed)


def extract_answer(text: str):
    from ..demo.tasks import extract_answer as _extract

    return _extract(text)


def encode(tokenizer, problem) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one sample: prompt + completion + EOS; the prompt carries no loss."""
    p = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(problem.completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p + c, [IGNORE_INDEX] * len(p) + c


def make_batches(tokenizer, problems, batch_size: int, max_len: int, pad_id: int) -> list[dict]:
    """Right-padded batches {input_ids, attention_mask, labels} (sequences cut at ``max_len``)."""
    out, cur = [], []
    for prob in problems:
        ids, lab = encode(tokenizer, prob)
        cur.append((ids[:max_len], lab[:max_len]))
        if len(cur) == batch_size:
            out.append(_collate(cur, pad_id))
            cur = []
    if cur:
        out.append(_collate(cur, pad_id))
    return out


def _collate(items, pad_id: int) -> dict:
    L = max(len(i) for i, _ in items)
    ids = torch.full((len(items), L), pad_id, dtype=torch.long)
    lab = torch.full((len(items), L), IGNORE_INDEX, dtype=torch.long)
    am = torch.zeros((len(items), L), dtype=torch.long)
    for b, (i, l_) in enumerate(items):
        ids[b, : len(i)] = torch.tensor(i)
        lab[b, : len(l_)] = torch.tensor(l_)
        am[b, : len(i)] = 1
    return {"input_ids": ids, "attention_mask": am, "labels": lab}


# --------------------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------------------
@dataclass
class FinetuneConfig:
    steps: int = 3000
    batch_size: int = 32
    max_len: int = 160
    lr: float | None = None  # default by method
    warmup: int | None = None  # default min(200, steps // 10)
    method: str = "auto"
    lora_rank: int = 16
    block_size_range: tuple[int, int] = (2, 16)
    seed: int = 0
    device: str = "auto"
    eval_problems: int = 200
    eval_max_new_tokens: int = 96
    control: bool = True
    fixed_data: int = 0  # >0: cycle over this many training problems only (the smoke run memorises them)
    log_every: int = 50
    out: str | None = None


def _resolve_method(method: str) -> str:
    import importlib.util

    has_peft = importlib.util.find_spec("peft") is not None
    if method == "auto":
        return "lora" if has_peft else "full"
    if method == "lora" and not has_peft:
        raise ImportError("--method lora needs the `peft` package (pip install peft); or use --method full / attn")
    if method not in ("lora", "full", "attn"):
        raise ValueError(f"method must be auto, lora, full or attn, got {method!r}")
    return method


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# --------------------------------------------------------------------------------------------------------
# model preparation
# --------------------------------------------------------------------------------------------------------
def _base_model(device: torch.device):
    from ..training import add_mask_token
    from . import smollm2

    model, tok = smollm2.load_smollm2(dtype=torch.float32, attn_implementation="sdpa")
    mask_id = add_mask_token(model, tok, block_size_range=(2, 16))
    model.to(device)
    return model, tok, mask_id


def _prepare_trainable(model, method: str, rank: int, mask_id: int):
    """Set what trains; returns (model to train, list of trainable params)."""
    emb = model.get_input_embeddings()
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        for p in model.parameters():
            p.requires_grad_(False)
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS, bias="none")
        model = get_peft_model(model, cfg)
        # The mask row of the (tied) embedding must learn too: train the whole table, keep only that row's change.
        emb.weight.requires_grad_(True)
        _only_row_grad(emb.weight, mask_id)
    elif method == "attn":
        for n, p in model.named_parameters():
            p.requires_grad_(("self_attn" in n) or ("norm" in n))
        emb.weight.requires_grad_(True)
        _only_row_grad(emb.weight, mask_id)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, params


def _only_row_grad(weight: torch.Tensor, row: int) -> None:
    """Zero the gradient of every row but ``row`` (the table is shared with the lm_head: tied embeddings)."""

    def hook(g):
        keep = torch.zeros_like(g)
        keep[row] = g[row]
        return keep

    weight.register_hook(hook)


def _hf(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# --------------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------------
def _ntp_loss(model, batch) -> tuple[torch.Tensor, dict]:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    lab = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), lab.reshape(-1), ignore_index=-100)
    return loss, {"ntp_loss": loss.detach()}


def _sbd_loss(model, batch, k: int, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    from ..training import sbd_loss

    loss, parts = sbd_loss(
        model,
        batch["input_ids"],
        block_size=k,
        generator=gen,
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
        mask_format="bool",
        return_parts=True,
    )
    return loss, parts


def _train(model, params, batches, objective: str, cfg: FinetuneConfig, device, log) -> list[dict]:
    """``cfg.steps`` steps of ``objective`` through :func:`sbd_ext.training.train_loop` (AdamW betas 0.9/0.95,
    warm-up + cosine to 0, clip 1.0, bf16 autocast on a GPU); the batches are cycled in order."""
    from ..training import train_loop

    lr = cfg.lr if cfg.lr is not None else (1e-3 if cfg.method == "lora" else 1e-4)
    k_rng = random.Random(cfg.seed)  # same k sequence for every run with this seed
    gen = torch.Generator(device=device).manual_seed(cfg.seed)

    def loss_fn(model, batch):
        batch = {k: v.to(device) for k, v in batch.items()}
        if objective == "sbd":
            return _sbd_loss(model, batch, k_rng.randint(*cfg.block_size_range), gen)
        return _ntp_loss(model, batch)

    return train_loop(
        model,
        batches,
        loss_fn,
        cfg.steps,
        lr=lr,
        betas=(0.9, 0.95),
        warmup_steps=cfg.warmup if cfg.warmup is not None else min(200, cfg.steps // 10),
        max_grad_norm=1.0,
        params=params,
        autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
        log_every=cfg.log_every,
        progress="lines",
        name=objective,
        rngs=(k_rng, gen),
    )


@torch.no_grad()
def _fixed_loss(model, batch, objective: str, device, seed: int = 1234) -> float:
    """The loss on a fixed batch with fixed randomness (k = 8, eta = 0.5): comparable before/after training."""
    batch = {k: v.to(device) for k, v in batch.items()}
    was = model.training
    model.eval()
    if objective == "sbd":
        from ..training import sbd_loss

        gen = torch.Generator(device=device).manual_seed(seed)
        loss = sbd_loss(
            model,
            batch["input_ids"],
            block_size=8,
            eta=0.5,
            generator=gen,
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
            mask_format="bool",
        )
    else:
        loss = _ntp_loss(model, batch)[0]
    model.train(was)
    return float(loss)


# --------------------------------------------------------------------------------------------------------
# saving / loading the compact result
# --------------------------------------------------------------------------------------------------------
def _save(model, method: str, base_state: dict, mask_id: int, folder: Path, info: dict) -> int:
    """Write the compact result; returns its size in bytes."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    hf = _hf(model)
    emb = hf.get_input_embeddings().weight
    save_file(
        {"mask_embedding": emb[mask_id : mask_id + 1].detach().float().cpu().contiguous()},
        folder / "mask_embedding.safetensors",
    )
    if method == "lora":
        model.save_pretrained(folder / "adapter")
    else:
        changed = {}
        for name, p in hf.named_parameters():
            if not p.requires_grad or name.endswith("embed_tokens.weight"):
                continue  # the embedding's only change is the mask row, saved above
            if name in base_state and torch.equal(p.detach().cpu(), base_state[name]):
                continue
            changed[name] = p.detach().to(torch.bfloat16).cpu().contiguous()
        save_file(changed, folder / "weights.safetensors")
    cfg = hf.config
    meta = {
        "method": method,
        "mask_token_id": int(mask_id),
        "mask_token": "<|mask|>",
        "sbd_block_size_range": list(getattr(cfg, "sbd_block_size_range", [2, 16])),
        "vocab_size": int(cfg.vocab_size),
        **info,
    }
    (folder / "sbd_config.json").write_text(json.dumps(meta, indent=1))
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def load_finetuned(folder: str | os.PathLike, dtype=torch.float32, attn_implementation: str = "sbd", device=None):
    """(model, tokenizer) = the base SmolLM2 + a result folder written by this module (``DIR/sbd`` or ``DIR/ntp``)."""
    from safetensors.torch import load_file

    from ..metadata import set_sbd_metadata
    from ..training import add_mask_token
    from . import smollm2

    folder = Path(folder)
    meta = json.loads((folder / "sbd_config.json").read_text())
    model, tok = smollm2.load_smollm2(dtype=torch.float32, attn_implementation=attn_implementation)
    mask_id = add_mask_token(model, tok, block_size_range=tuple(meta["sbd_block_size_range"]))
    assert mask_id == meta["mask_token_id"], (mask_id, meta["mask_token_id"])
    with torch.no_grad():
        model.get_input_embeddings().weight[mask_id] = load_file(folder / "mask_embedding.safetensors")[
            "mask_embedding"
        ][0]
    if meta["method"] == "lora":
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, folder / "adapter").merge_and_unload()
    else:
        missing = model.load_state_dict(
            {k: v.float() for k, v in load_file(folder / "weights.safetensors").items()}, strict=False
        )
        if missing.unexpected_keys:
            raise ValueError(f"unexpected tensors in {folder}: {missing.unexpected_keys[:5]}")
    set_sbd_metadata(model, mask_id, tuple(meta["sbd_block_size_range"]))
    model.to(dtype)
    if device is not None:
        model.to(device)
    model.eval()
    return model, tok


# --------------------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def evaluate(models: dict, tok, problems, device, max_new_tokens: int = 96, log=print) -> list[dict]:
    """Accuracy, mean NFE per sequence and wall-clock of each decoding setting, one problem at a time (batch 1).

    models: {"ntp": NTP-control model, "sbd": SBD model} (either may be missing). Rows: HF generate of the control
    (the wall-clock baseline), sbd_ext NTP decoding of both models, SBD decoding (EB, block 16) at each gamma.
    """
    import sbd_ext

    rows = []
    settings = []
    if "ntp" in models:
        settings += [("ntp control, HF generate", "ntp", "hf", None), ("ntp control, NTP decoding", "ntp", "ntp", None)]
    if "sbd" in models:
        settings += [("sbd model, NTP decoding", "sbd", "ntp", None)]
        settings += [(f"sbd model, SBD gamma={g}", "sbd", "sbd", g) for g in GAMMAS]
    prompts = [torch.tensor([tok(p.prompt, add_special_tokens=False)["input_ids"]], device=device) for p in problems]
    for label, which, how, gamma in settings:
        model = models[which]
        model.set_attn_implementation("sdpa" if how == "hf" else "sbd")
        correct, nfe, ntok, secs = 0, 0, 0, 0.0
        for prob, ids in zip(problems, prompts, strict=True):
            _sync(device)
            t0 = time.perf_counter()
            if how == "hf":
                seq = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
                gen = seq[0, ids.shape[1] :]
                forwards = len(gen)
            else:
                out = sbd_ext.generate(
                    model,
                    ids,
                    mode=how,
                    block_size=BLOCK_SIZE,
                    sampler="eb",
                    threshold=gamma,
                    max_new_tokens=max_new_tokens,
                    return_trace=False,
                )
                gen = out.sequences[0, ids.shape[1] : ids.shape[1] + int(out.num_generated[0])]
                forwards = int(out.nfe[0])
            _sync(device)
            secs += time.perf_counter() - t0
            text = tok.decode(gen, skip_special_tokens=True)
            correct += int(extract_answer(text) == prob.answer)
            nfe += forwards
            ntok += len(gen)
        n = max(1, len(problems))
        rows.append(
            {
                "setting": label,
                "accuracy": correct / n,
                "nfe_per_seq": nfe / n,
                "tokens_per_seq": ntok / n,
                "tokens_per_forward": ntok / max(1, nfe),
                "seconds": secs,
                "tokens_per_s": ntok / max(secs, 1e-9),
            }
        )
        model.set_attn_implementation("sdpa")
        log(f"[eval] {label}: " + " ".join(f"{k} {v:.4g}" for k, v in rows[-1].items() if k != "setting"))
    base = next((r for r in rows if r["setting"] == "ntp control, NTP decoding"), None)
    hf = next((r for r in rows if r["setting"] == "ntp control, HF generate"), None)
    for r in rows:
        if base:
            r["nfe_reduction_vs_ntp"] = base["nfe_per_seq"] / max(r["nfe_per_seq"], 1e-9)
        if hf:
            r["speedup_vs_hf_generate"] = hf["seconds"] / max(r["seconds"], 1e-9)
    return rows


def _table(rows: list[dict]) -> str:
    head = "| setting | accuracy | NFE/seq | tokens/forward | NFE reduction | tokens/s | speed-up vs HF generate |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['accuracy']:.3f} | {r['nfe_per_seq']:.1f} | {r['tokens_per_forward']:.2f} | "
            f"{r.get('nfe_reduction_vs_ntp', float('nan')):.2f}x | {r['tokens_per_s']:.1f} | "
            f"{r.get('speedup_vs_hf_generate', float('nan')):.2f}x |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------
def run(cfg: FinetuneConfig, log=print) -> dict:
    """Fine-tune with SBD (and the NTP control), save, evaluate. Returns a summary dict (also in results.json)."""
    torch.manual_seed(cfg.seed)
    device = _device(cfg.device)
    cfg.method = _resolve_method(cfg.method)
    log(f"device {device}, method {cfg.method}, steps {cfg.steps}, batch {cfg.batch_size}, max_len {cfg.max_len}")
    if cfg.method == "full" and cfg.out:
        log(
            "note: --method full saves every changed weight (~210 MB in bf16 per run); for a compact result install "
            "peft (--method lora, a few MB) or use --method attn (~53 MB)"
        )
    t_all = time.perf_counter()

    tok = None
    n_train = cfg.fixed_data if cfg.fixed_data > 0 else cfg.steps * cfg.batch_size
    train_problems = list(task_problems("train", n_train, seed=cfg.seed))
    eval_problems = list(task_problems("test", cfg.eval_problems, seed=cfg.seed)) if cfg.eval_problems else []

    summary: dict = {"config": {k: v for k, v in vars(cfg).items()}, "runs": {}}
    trained: dict = {}
    objectives = ["sbd", "ntp"] if cfg.control else ["sbd"]
    for objective in objectives:
        model, tok, mask_id = _base_model(device)
        base_state = {n: p.detach().cpu().clone() for n, p in model.named_parameters()} if cfg.out else {}
        batches = make_batches(tok, train_problems, cfg.batch_size, cfg.max_len, tok.pad_token_id)
        probe = batches[0]
        model, params = _prepare_trainable(model, cfg.method, cfg.lora_rank, mask_id)
        n_params = sum(p.numel() for p in params)
        log(f"[{objective}] trainable parameters: {n_params / 1e6:.1f} M; {len(batches)} distinct batches")
        before = {o: _fixed_loss(model, probe, o, device) for o in ("sbd", "ntp")}
        t0 = time.perf_counter()
        hist = _train(model, params, batches, objective, cfg, device, log)
        secs = time.perf_counter() - t0
        after = {o: _fixed_loss(model, probe, o, device) for o in ("sbd", "ntp")}
        log(
            f"[{objective}] fixed-batch loss before -> after: sbd {before['sbd']:.4f} -> {after['sbd']:.4f}, "
            f"ntp {before['ntp']:.4f} -> {after['ntp']:.4f} ({secs:.1f} s)"
        )
        run_info = {
            "train_seconds": secs,
            "trainable_params": n_params,
            "fixed_batch_loss_before": before,
            "fixed_batch_loss_after": after,
            "history": hist,
        }
        if cfg.out:
            size = _save(model, cfg.method, base_state, mask_id, Path(cfg.out) / objective, {"objective": objective})
            (Path(cfg.out) / objective / "train_log.json").write_text(json.dumps(run_info, indent=1))
            run_info["saved_bytes"] = size
            log(f"[{objective}] saved {size / 1e6:.1f} MB to {Path(cfg.out) / objective}")
        summary["runs"][objective] = run_info
        del base_state
        if cfg.method == "lora":
            model = model.merge_and_unload()
        if eval_problems:
            from ..metadata import set_sbd_metadata

            set_sbd_metadata(model, mask_id, cfg.block_size_range)
            if device.type == "cuda":
                model.to(torch.bfloat16)
            trained[objective] = model
        else:
            del model
    if eval_problems:
        rows = evaluate(trained, tok, eval_problems, device, cfg.eval_max_new_tokens, log=log)
        summary["eval"] = rows
        summary["eval_table"] = _table(rows)
        log(summary["eval_table"])
    summary["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    summary["total_seconds"] = time.perf_counter() - t_all
    if cfg.out:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m sbd_ext.recipes.finetune_smollm2", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--smoke", action="store_true", help="a short CPU run: few steps, short sequences, tiny eval")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--method", default="auto", choices=["auto", "lora", "full", "attn"])
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--eval", type=int, default=None, help="held-out problems to evaluate (0: none)")
    ap.add_argument("--eval-max-new-tokens", type=int, default=96)
    ap.add_argument("--no-control", action="store_true", help="skip the NTP control run")
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--out", default=None, help="folder for the compact result and results.json")
    a = ap.parse_args(argv)
    if a.smoke:
        # Memorise 4 fixed problems with a higher lr: the loss falls visibly within a handful of CPU steps.
        cfg = FinetuneConfig(
            steps=8,
            batch_size=2,
            max_len=96,
            lr=3e-4 if a.method != "lora" else 3e-3,
            warmup=0,
            eval_problems=0,
            fixed_data=4,
            log_every=1,
            device="cpu" if a.device == "auto" else a.device,
        )
    else:
        cfg = FinetuneConfig()
    for field, val in (
        ("steps", a.steps),
        ("batch_size", a.batch_size),
        ("max_len", a.max_len),
        ("lr", a.lr),
        ("warmup", a.warmup),
        ("eval_problems", a.eval),
        ("log_every", a.log_every),
        ("out", a.out),
    ):
        if val is not None:
            setattr(cfg, field, val)
    cfg.method, cfg.lora_rank, cfg.seed = a.method, a.lora_rank, a.seed
    if not a.smoke:
        cfg.device = a.device
    cfg.eval_max_new_tokens = a.eval_max_new_tokens
    cfg.control = not a.no_control
    if not a.smoke and cfg.eval_problems and _device(cfg.device).type == "cpu" and a.eval is None:
        cfg.eval_problems = 0  # the full evaluation is for a GPU; ask for it on a CPU with --eval N
    summary = run(cfg)
    for name, r in summary["runs"].items():
        traj = " ".join(f"{h['loss']:.3f}" for h in r["history"])
        print(f"{name}: loss trajectory {traj}")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
