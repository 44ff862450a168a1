"""The drafter's GPU training stage (``bash bench/run_gpu.sh drafter-train``): the recipe's data, train, head and
eval stages in one resumable driver sized for the few minutes a GPU is lent, its results brought back to be
committed.

    python -m sbd_ext.recipes.smollm2.drafter_stage --work DIR --results DIR [--returns DIR] [--deadline EPOCH_S]
    python -m sbd_ext.recipes.smollm2.drafter_stage --work DIR --results DIR --dry-run     # tiny, on the CPU

Phases, each skipped when ``--work`` already holds its result (a warm machine's second call continues where the
first stopped; a phase cut by ``--deadline`` continues from its own checkpoint):

1. ``data``: the base's greedy answers (sbd_ext NTP decoding, large batches on the device) to instructions the base
   writes itself and then to the recipe's template prompts (never the held-out prompts), ``--max-new-tokens`` each; a
   ``samples.npz`` brought back earlier or a folder of parts committed by a CPU data run
   (:mod:`sbd_ext.recipes.drafter.parts`; ``--import-samples``) is taken, and only the prompts after it answered;
2. ``sweep``: short runs of the gated-LoRA distillation at each ``--ranks`` (bf16 autocast), scored by the
   teacher-forced 2-ahead accuracy (slot 1 of k=2 blocks) on the held-out prompts' answers;
3. ``train``: the best rank whose artifact can ship (``--max-ship-rank``) for the time left, from the shipped
   drafter (``--init-from``; grown to the chosen rank where that is higher, :func:`sbd_ext.drafter.grow_rank`);
4. ``head``: the sampler head on the trained drafter;
5. ``store``: the draft store over the answers (:func:`sbd_ext.recipes.drafter.build_store`), added to it;
6. ``eval``: tokens per forward and equality with NTP on ``--eval-n`` held-out prompts x ``--eval-max-new``
   tokens, verify at the shipped settings, for the new drafter and the shipped one.

``--results``: small files (``stage.json`` with every phase's figures, logs). ``--returns``: the big ones, split
into parts of at most 15 MiB: ``drafter-samples.npz`` (uint16 token ids), ``drafter-artifact.tar.partNN``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tarfile
import time
from pathlib import Path

import torch

from ... import drafter as drafter_mod
from ...demo import models
from .. import drafter as recipe
from ..drafter.bases import load_task_base, prompt_ids
from ..drafter.parts import export_samples, import_samples
from ..drafter.prompts import eval_prompts

PART = 15 << 20  # bytes per returned part (a device call returns files of at most 16 MiB)
SHIPPED = Path(__file__).resolve().parents[2] / "demo" / "models" / "smollm2-drafter"
# setting: (on a GPU, in the dry run)
SIZES = {
    # Instructions the base writes itself first (the held-out chat prompts' kind), then template prompts: the shipped
    # drafter guesses 2 ahead on template answers 20 points more often than on open chat, and 420 steps on 5,000
    # template answers added 10 points there and 0.5 on the held-out chat prompts (docs/notes/drafter-studies.md,
    # 2026-11-29; 200 steps on 2,200 self-written answers added 0.2). The 5,000 committed template answers
    # (bench/results/drafter-data) are all the templates this stage uses.
    "self_prompts": (15000, 0),  # instructions the base writes itself, answered
    "templates": (5000, 6),  # template prompts answered
    "max_new_tokens": (192, 8),  # per answer
    "gen_batch": (512, 4),  # prompts per batched NTP decoding
    "gen_seconds": (330, 600),  # the data phase's time limit in one call
    "ranks": ([16, 64, 128], [2, 4]),  # the sweep
    "sweep_steps": (120, 2),
    "max_steps": (20000, 4),  # the final run's schedule, at most
    "batch_size": (64, 2),
    "max_len": (256, 64),
    "lr": (1e-3, 1e-3),
    "eval_n": (56, 2),  # held-out prompts
    "eval_max_new": (128, 8),
    "head_epochs": (5, 1),
}
GPU = {k: v[0] for k, v in SIZES.items()}
DRY = {k: v[1] for k, v in SIZES.items()}


def _state(work: Path) -> dict:
    f = work / "stage_state.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _save_state(work: Path, st: dict) -> None:
    (work / "stage_state.json").write_text(json.dumps(st, indent=1) + "\n")


def _left(deadline: float | None) -> float:
    return float("inf") if deadline is None else deadline - time.time()


def phase_data(work: Path, cfg: dict, a, st: dict, log) -> None:
    path = work / recipe.SAMPLES_FILE
    if a.import_samples and not path.is_file():
        rows = import_samples(Path(a.import_samples))
        torch.save(rows, path)
        log(f"data: {len(rows)} samples imported from {a.import_samples}")
    stop = time.time() + min(cfg["gen_seconds"], _left(a.deadline) - 60)
    kw = dict(max_new_tokens=cfg["max_new_tokens"], batch_size=cfg["gen_batch"], base=a.base, device=a.device)
    if cfg["self_prompts"] and time.time() < stop:
        recipe.make_samples(work, cfg["self_prompts"], seed=5, prompts="self", deadline=stop, **kw)
    if time.time() < stop:
        recipe.make_samples(work, cfg["templates"], seed=21, deadline=stop, **kw)
    rows = torch.load(path, weights_only=True)
    st["data"] = {"samples": len(rows), "answer_tokens": sum(len(r["answer_ids"]) for r in rows)}
    log(f"data: {st['data']}")


def _heldout(work: Path, cfg: dict, a) -> tuple[list, list]:
    """The held-out prompts and the base's NTP answers to them (cached): what the sweep scores against."""
    f = work / "heldout.json"
    if f.is_file():
        d = json.loads(f.read_text())
        return d["prompts"], d["answers"]
    model, tok, eos = load_task_base("general", base=a.base)
    model.to(a.device).eval()
    prompts = [prompt_ids(tok, p["text"]) for p in eval_prompts()[: cfg["eval_n"]]]
    answers = recipe.greedy_answers(model, prompts, cfg["eval_max_new"], eos, tok.pad_token_id or 0)
    f.write_text(json.dumps({"prompts": prompts, "answers": answers}))
    return prompts, answers


def _train(work: Path, name: str, cfg: dict, a, rank: int, steps: int, init_from: str, deadline) -> Path:
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    if not (out / recipe.SAMPLES_FILE).exists():
        (out / recipe.SAMPLES_FILE).symlink_to((work / recipe.SAMPLES_FILE).resolve())
    dc = recipe.DrafterConfig(
        steps=steps,
        batch_size=cfg["batch_size"],
        max_len=cfg["max_len"],
        lr=cfg["lr"],
        warmup=min(20, steps // 5),
        rank=rank,
        full_block_prob=1.0,
        block_size_range=(2, 5),
        first_slot_loss=False,
        checkpoint_every=20,
        log_every=5 if steps >= 20 else 1,
        init_from=init_from,
        base=a.base,
    )
    resume = (out / recipe.CHECKPOINT_FILE).is_file()
    recipe.train(out, dc, resume=resume, device=a.device, precision="auto", deadline=deadline)
    return out


def _slot1(artifact: Path, a, heldout) -> float:
    acc = recipe.slot_accuracy(artifact, heldout[0], heldout[1], 2, device=a.device)
    return round(float(acc[1]), 4)


def phase_sweep(work: Path, cfg: dict, a, st: dict, log) -> None:
    heldout = _heldout(work, cfg, a)
    scores = st.setdefault("sweep", {})
    for r in cfg["ranks"]:
        if str(r) in scores:
            continue
        t0 = time.time()
        out = _train(work, f"sweep-r{r}", cfg, a, r, cfg["sweep_steps"], "", a.deadline)
        done = json.loads((out / "train_log.json").read_text())["steps_done"]
        if done < cfg["sweep_steps"]:
            raise TimeoutError(f"sweep rank {r}: {done}/{cfg['sweep_steps']} steps before the deadline")
        scores[str(r)] = {"slot1_heldout": _slot1(out / "artifact", a, heldout), "seconds": round(time.time() - t0, 1)}
        scores[str(r)]["s_per_step"] = round((time.time() - t0) / cfg["sweep_steps"], 4)
        log(f"sweep rank {r}: {scores[str(r)]}")
        _save_state(work, st)


def phase_train(work: Path, cfg: dict, a, st: dict, log) -> None:
    heldout = _heldout(work, cfg, a)
    ok = {int(r): v for r, v in st["sweep"].items() if int(r) <= a.max_ship_rank}
    rank = max(ok, key=lambda r: ok[r]["slot1_heldout"])
    if "final" not in st:  # the schedule's length, fixed once (a resumed call keeps it)
        budget = max(_left(a.deadline) - a.reserve, 0) if a.deadline else a.train_seconds
        steps = int(min(budget, a.train_seconds) / max(ok[rank]["s_per_step"], 1e-3))
        steps = max(min(steps, cfg["max_steps"]), 2)
        init = str(a.init_from) if a.init_from and drafter_mod.read_drafter_config(a.init_from)["r"] <= rank else ""
        st["final"] = {"rank": rank, "steps": steps, "init_from": init}
        _save_state(work, st)
    f = st["final"]
    out = _train(work, "final", cfg, a, f["rank"], f["steps"], f["init_from"], a.deadline)
    done = json.loads((out / "train_log.json").read_text())["steps_done"]
    if done < f["steps"]:
        raise TimeoutError(f"train: {done}/{f['steps']} steps before the deadline (the next call continues)")
    f["slot1_heldout"] = _slot1(out / "artifact", a, heldout)
    log(f"train: {f}")
    _save_state(work, st)


def phase_head(work: Path, cfg: dict, a, st: dict, log) -> None:
    head = recipe.train_head(
        work / "head",
        work / "final" / "artifact",
        [work / recipe.SAMPLES_FILE],
        epochs=cfg["head_epochs"],
        device=a.device,
    )
    st["head"] = drafter_mod.read_drafter_config(head)["sbd"]["sampler_head"]
    log(f"head: {st['head']}")


def phase_store(work: Path, cfg: dict, a, st: dict, log) -> None:
    """The draft store over the stage's answers, into the head's artifact (in place; ~10 s per 10^6 answer tokens
    on one host core)."""
    art = recipe.build_store(work / "head", work / "head" / "artifact", [work / recipe.SAMPLES_FILE])
    st["store"] = drafter_mod.read_drafter_config(art)["sbd"]["draft_store"]
    log(f"store: {st['store']}")


def phase_eval(work: Path, cfg: dict, a, st: dict, log) -> None:
    kw = recipe.verify_settings(drafter_mod.read_drafter_config(SHIPPED)["sbd"]["generation"])
    settings = [kw | {"branch": False}, kw | {"branch": True}, kw | {"branch": True, "alternates": 3}]
    cands = {"new": work / "head" / "artifact"} | ({} if a.base else {"shipped": SHIPPED})
    ev = st.setdefault("eval", {})
    for name, art in cands.items():
        if name not in ev:
            ev[name] = recipe.evaluate(
                art, cfg["eval_n"], cfg["eval_max_new"], settings, batch_size=cfg["eval_n"], device=a.device
            )
            log(f"eval {name}: {ev[name]}")
            _save_state(work, st)


def _returns(work: Path, a, st: dict) -> list[str]:
    """The big files back: the samples (npz) and the new drafter (tar, in parts)."""
    dest = Path(a.returns)
    dest.mkdir(parents=True, exist_ok=True)
    made = []
    if (work / recipe.SAMPLES_FILE).is_file():
        npz = dest / "drafter-samples.npz"
        export_samples(torch.load(work / recipe.SAMPLES_FILE, weights_only=True), npz)
        made.append(npz.name)
    art = work / "head" / "artifact"
    if not art.is_dir():
        art = work / "final" / "artifact"
    if art.is_dir():
        tar = work / "drafter-artifact.tar"
        with tarfile.open(tar, "w") as t:
            t.add(art, arcname="artifact")
        data = tar.read_bytes()
        for i in range(0, len(data), PART):
            (dest / f"drafter-artifact.tar.part{i // PART:02d}").write_bytes(data[i : i + PART])
            made.append(f"drafter-artifact.tar.part{i // PART:02d}")
    return made


PHASES = {
    "data": phase_data,
    "sweep": phase_sweep,
    "train": phase_train,
    "head": phase_head,
    "store": phase_store,
    "eval": phase_eval,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sbd_ext.recipes.smollm2.drafter_stage", description=__doc__)
    ap.add_argument("--work", required=True, help="the stage's working folder (kept between calls while warm)")
    ap.add_argument("--results", required=True, help="small results: stage.json, the phase log")
    ap.add_argument("--returns", help="big results (samples, artifact parts); default: --results")
    ap.add_argument("--deadline", type=float, help="epoch seconds: every phase stops before it")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dry-run", action="store_true", help="a tiny base (the embedded ntp-arith + a chat template)")
    ap.add_argument("--base", default="", help="a local HF model folder instead of SmolLM2")
    ap.add_argument(
        "--import-samples", help="a drafter-samples.npz brought back by an earlier run, or a folder of committed parts"
    )
    ap.add_argument(
        "--init-from", default=str(SHIPPED), help="continue this drafter when the chosen rank is its or higher (grown)"
    )
    ap.add_argument("--max-ship-rank", type=int, default=16, help="the largest rank the package can embed")
    ap.add_argument("--train-seconds", type=float, default=240.0)
    ap.add_argument("--reserve", type=float, default=150.0, help="seconds kept for the head and eval after train")
    ap.add_argument("--phases", nargs="*", default=list(PHASES), choices=list(PHASES))
    a = ap.parse_args(argv)
    work, res = Path(a.work), Path(a.results)
    work.mkdir(parents=True, exist_ok=True)
    res.mkdir(parents=True, exist_ok=True)
    a.returns = a.returns or str(res)
    cfg = dict(DRY if a.dry_run else GPU)
    if a.dry_run:
        a.base = a.base or str(_tiny_base(work / "tiny-base"))
        a.init_from, a.max_ship_rank, a.train_seconds, a.reserve = "", 4, 20.0, 0.0
    st = _state(work)
    lines = []

    def log(msg: str) -> None:
        lines.append(f"[{time.strftime('%H:%M:%S')}] {msg}")
        print(lines[-1], flush=True)

    rc = 0
    for name in a.phases:
        if name in st.setdefault("done", []):
            continue
        if _left(a.deadline) < 30:
            log(f"{name}: not started, {_left(a.deadline):.0f} s before the deadline")
            rc = 3
            break
        t0 = time.time()
        try:
            PHASES[name](work, cfg, a, st, log)
        except TimeoutError as e:
            log(f"{name}: {e}")
            rc = 3
            break
        st["done"].append(name)
        st.setdefault("seconds", {})[name] = round(time.time() - t0, 1)
        _save_state(work, st)
    st["returned"] = _returns(work, a, st)
    _save_state(work, st)
    (res / "stage.json").write_text(json.dumps(st | {"config": cfg, "device": a.device}, indent=1) + "\n")
    with open(res / "stage.log", "a") as f:
        f.write("\n".join(lines) + "\n")
    return rc


def _tiny_base(folder: Path) -> Path:
    """The embedded ntp-arith Llama with a chat template: a tiny base the dry run can run every phase on."""
    from transformers import AutoTokenizer

    if not (folder / "config.json").is_file():
        shutil.copytree(
            models.path("ntp-arith"),
            folder,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("sbd_demo.json", "train_log.json"),
        )
        tok = AutoTokenizer.from_pretrained(folder)
        tok.chat_template = (
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
        )
        tok.save_pretrained(folder)
    return folder.resolve()


if __name__ == "__main__":
    raise SystemExit(main())
