"""Convert SmolLM2-135M-Instruct to SBD by fine-tuning, and train its NTP control with the same budget.

One objective per call, each resumable::

    python -m sbd_ext.recipes.smollm2 train --objective sbd --out runs/smollm2 [--resume]
    python -m sbd_ext.recipes.smollm2 train --objective ntp --out runs/smollm2 [--resume]

Recipe (the paper's Alg. 1 on a real pretrained Llama, scaled to a CPU):

* model: SmolLM2-135M-Instruct from the offline GGUF (:mod:`.checkpoint`, float32); the mask token ``<|mask|>`` is
  added by :func:`sbd_ext.training.add_mask_token` (id 49152, starting as the mean row) and the SBD metadata
  (``mask_token_id``, ``sbd_block_size_range`` = [2, 16]) recorded;
* what trains (:mod:`.adapters`): ``lora`` (rank 16, alpha 32, on q/k/v/o/gate/up/down) + the mask token's row,
  ``attn`` (attention projections and norms + the row) or ``full`` (every weight but the embedding table + the row);
* data (:mod:`.data`): the arithmetic task, ``prompt + completion + EOS``, prompt without loss, right-padded;
* SBD: :func:`sbd_ext.training.sbd_loss`, k ~ U[2, 16] per step, eta ~ U(0, 1) per sequence;
  NTP control: the plain next-token loss, same model, data order, steps, batch, optimizer and trainable parameters;
* rehearsal (``--rehearsal N``, off by default): each step also takes the next-token loss (weight
  ``rehearsal_weight``) on N sequences the *base* model sampled from itself after the document separator
  (:func:`.data.rehearsal_samples`, made once per run and kept in ``<out>/<objective>/rehearsal.pt``), which pulls
  the converted model's next-token distribution on general text back to the base model's -- what the task-only
  fine-tune costs on general text (the perplexity of :mod:`.evaluate`), with no data anybody wrote;
* :func:`sbd_ext.training.train_loop`: AdamW (0.9, 0.95), warm-up then cosine to 0, clip 1.0; the checkpoint
  (``<out>/<objective>/checkpoint.pt``, trainable tensors + optimizer + schedule + RNG states, every
  ``--checkpoint-every`` steps) makes ``--resume`` continue exactly where the run stopped;
* output ``<out>/<objective>/``: ``artifact/`` (:func:`.adapters.save_artifact`: a few MB), ``train_log.json``
  (config, the loss curve with ntp_loss / mask_loss / mask_accuracy, seconds per step, machine) and
  ``curve.jsonl`` (the same records as they are logged, for watching a run).
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ... import adapters
from ...training import OBJECTIVES, SBDTrainer, ntp_loss, objective_loss_fn, sbd_loss, train_loop
from . import checkpoint, data

__all__ = ["FinetuneConfig", "OBJECTIVES", "base_model", "train", "train_with_trainer", "run_dir"]

CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class FinetuneConfig:
    objective: str = "sbd"
    steps: int = 240
    batch_size: int = 8
    max_len: int = 128
    lr: float | None = None  # default: 1e-3 for lora, 1e-4 otherwise
    warmup: int | None = None  # default: min(20, steps // 10)
    method: str = "lora"
    lora_rank: int = 16
    block_size_range: tuple[int, int] = (2, 16)
    seed: int = 0
    fixed_data: int = 0  # > 0: cycle over this many training problems (the smoke run memorises them)
    log_every: int = 5
    checkpoint_every: int = 10
    init_from: str = ""  # an artifact folder of the same method: continue that conversion (fresh optimizer)
    rehearsal: int = 0  # > 0: sequences of the base model's own samples per step, next-token loss (see above)
    rehearsal_len: int = 128
    rehearsal_weight: float = 1.0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.method not in adapters.METHODS:
            raise ValueError(f"method must be one of {adapters.METHODS}, got {self.method!r}")
        for name in ("steps", "batch_size", "max_len", "lora_rank", "log_every", "checkpoint_every", "rehearsal_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if int(self.rehearsal) < 0 or not float(self.rehearsal_weight) >= 0:
            raise ValueError(
                f"rehearsal must be >= 0 and rehearsal_weight >= 0, got {self.rehearsal!r}, {self.rehearsal_weight!r}"
            )
        if self.rehearsal and self.rehearsal_len < 2:
            raise ValueError(f"rehearsal_len must be >= 2, got {self.rehearsal_len}")
        self.block_size_range = tuple(int(v) for v in self.block_size_range)

    @property
    def rehearsal_pool(self) -> int:
        """How many distinct rehearsal sequences a run samples (cycled over its steps)."""
        return min(REHEARSAL_POOL, self.steps * self.rehearsal)

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else (1e-3 if self.method == "lora" else 1e-4)

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, min(20, self.steps // 10))


def run_dir(out: str | os.PathLike, objective: str) -> Path:
    return Path(out) / objective


REHEARSAL_POOL = 256
REHEARSAL_FILE = "rehearsal.pt"

BASE_LOADER = "sbd_ext.recipes.smollm2.checkpoint:load_base"


def base_model(device: torch.device | str = "cpu", block_size_range=(2, 16)):
    """(model, tokenizer, mask_id): SmolLM2 in float32 with the mask token added (not yet trained)."""
    model, tok = checkpoint.load_base(attn_implementation="sdpa", block_size_range=block_size_range)
    return model.to(device), tok, int(tok.mask_token_id)


def with_rehearsal(loss_fn, weight: float, device):
    """``loss_fn`` plus ``weight`` x the next-token loss on the batch's ``rehearsal_input_ids`` (every next token
    labelled), reported as ``rehearsal_loss``; a batch without them is ``loss_fn``'s alone."""

    def fn(model, batch):
        batch = dict(batch)
        ids = batch.pop("rehearsal_input_ids", None)
        loss, parts = loss_fn(model, batch)
        if ids is None:
            return loss, parts
        ids = ids.to(device)
        r_loss = ntp_loss(model, {"input_ids": ids, "labels": ids})[0]
        return loss + weight * r_loss, {**parts, "rehearsal_loss": r_loss.detach()}

    return fn


def _rehearsal(cfg: FinetuneConfig, folder: Path, model, tok, mask_id: int, log) -> torch.Tensor:
    """The run's rehearsal sequences: sampled from the base model once, then read back (resume, same run)."""
    path = folder / REHEARSAL_FILE
    want = (cfg.rehearsal_pool, cfg.rehearsal_len)
    if path.exists():
        try:  # weights_only: a pickle that runs code is refused, whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says
            samples = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(
                f"{path} is not this recipe's rehearsal file ({type(e).__name__}: {e}); delete it to sample anew"
            ) from None
        if not isinstance(samples, torch.Tensor) or samples.dtype != torch.int64:
            raise ValueError(f"{path} is not this recipe's rehearsal file (an int64 tensor of token ids)")
        if tuple(samples.shape) == want:
            return samples
    t0 = time.perf_counter()
    samples = data.rehearsal_samples(model, tok, *want, seed=cfg.seed, exclude_ids=(mask_id,))
    torch.save(samples, path)
    log(
        f"[{cfg.objective}] rehearsal: {want[0]} base-model samples of {want[1]} tokens "
        f"in {time.perf_counter() - t0:.0f} s"
    )
    return samples


@torch.no_grad()
def fixed_batch_losses(model, batch, device, seed: int = 1234) -> dict:
    """Both objectives on a fixed batch with fixed randomness (k = 8, eta = 0.5): comparable across runs."""
    batch = {k: v.to(device) for k, v in batch.items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    sbd = sbd_loss(
        model,
        batch["input_ids"],
        block_size=8,
        eta=0.5,
        generator=gen,
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
        mask_format="bool",
        return_parts=True,
    )[1]
    return {
        "ntp_loss": float(ntp_loss(model, batch)[0]),
        "mask_loss": float(sbd["mask_loss"]),
        "mask_accuracy": float(sbd["mask_accuracy"]),
    }


def machine() -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def train(cfg: FinetuneConfig, out: str | os.PathLike, resume: bool = False, device="cpu", log=print) -> dict:
    """Train one objective into ``<out>/<objective>/``; returns the training log (also in ``train_log.json``)."""
    folder = run_dir(out, cfg.objective)
    ckpt = folder / CHECKPOINT_FILE
    if ckpt.exists() and not resume:
        raise FileExistsError(f"{ckpt} exists: pass --resume to continue that run, or choose another --out")
    if resume and not ckpt.exists():
        log(f"[{cfg.objective}] no checkpoint in {folder}: starting from step 0")
    folder.mkdir(parents=True, exist_ok=True)
    saved_cfg = folder / "config.json"
    if resume and saved_cfg.exists():
        # a run saved before a field existed ran with that field's default
        defaults = json.loads(json.dumps(asdict(FinetuneConfig(objective=cfg.objective))))
        before = {**defaults, **json.loads(saved_cfg.read_text())}
        if before != json.loads(json.dumps(asdict(cfg))):
            raise ValueError(f"--resume with a different configuration than {saved_cfg} records: {before}")
    saved_cfg.write_text(json.dumps(asdict(cfg), indent=1) + "\n")

    torch.manual_seed(cfg.seed)
    device = torch.device(device)
    model, tok, mask_id = base_model(device, cfg.block_size_range)
    n_train = cfg.fixed_data if cfg.fixed_data > 0 else cfg.steps * cfg.batch_size
    batches = data.make_batches(
        tok, data.task_problems("train", n_train, seed=cfg.seed), cfg.batch_size, cfg.max_len, tok.pad_token_id
    )
    if cfg.rehearsal:  # sampled from the base model, before anything is trained
        batches = data.attach_rehearsal(batches, _rehearsal(cfg, folder, model, tok, mask_id, log), cfg.rehearsal)
    mask_row, params = adapters.prepare(model, mask_id, cfg.method, cfg.lora_rank)
    parent = {}
    if cfg.init_from:  # a resumed run's checkpoint then replaces these tensors
        adapters.load_trainable(model, mask_row, cfg.init_from)
        parent["init_from"] = describe_artifact(cfg.init_from)  # what was loaded, recorded in the artifact
        log(f"[{cfg.objective}] starting from the artifact {cfg.init_from}: {parent['init_from']}")
    n_params = sum(p.numel() for p in params)
    log(
        f"[{cfg.objective}] {cfg.method}: {n_params / 1e6:.2f} M trainable parameters, {len(batches)} batches of "
        f"{cfg.batch_size}, {cfg.steps} steps, lr {cfg.learning_rate:g}, {torch.get_num_threads()} thread(s)"
        + (f", rehearsal {cfg.rehearsal} x {cfg.rehearsal_len} tokens per step" if cfg.rehearsal else "")
    )
    curve = folder / "curve.jsonl"
    last = {}

    def on_log(rec: dict) -> None:
        rec = dict(rec)
        if last:
            rec["sec_per_step"] = round((rec["elapsed_s"] - last["elapsed_s"]) / (rec["step"] - last["step"]), 2)
        last.update(rec)
        with open(curve, "a") as f:
            f.write(json.dumps(rec) + "\n")

    k_rng = random.Random(cfg.seed)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    probe = batches[0]
    before = fixed_batch_losses(model, probe, device)
    t0 = time.perf_counter()
    loss_fn = objective_loss_fn(
        cfg.objective,
        generator=gen,
        k_rng=k_rng,
        block_size_range=cfg.block_size_range,
        device=device,
        mask_format="bool",
    )
    history = train_loop(
        model,
        batches,
        with_rehearsal(loss_fn, cfg.rehearsal_weight, device),
        cfg.steps,
        lr=cfg.learning_rate,
        betas=(0.9, 0.95),
        warmup_steps=cfg.warmup_steps,
        max_grad_norm=1.0,
        params=params,
        autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
        log_every=cfg.log_every,
        progress="lines",
        name=cfg.objective,
        callback=on_log,
        checkpoint=ckpt,
        checkpoint_every=cfg.checkpoint_every,
        rngs=(k_rng, gen),
    )
    secs = time.perf_counter() - t0
    after = fixed_batch_losses(model, probe, device)
    info = {
        "objective": cfg.objective,
        "config": asdict(cfg),
        "trainable_params": n_params,
        "seconds_this_process": round(secs, 1),
        "fixed_batch_before": before,
        "fixed_batch_after": after,
        "machine": machine(),
        "history": history,
    }
    size = adapters.save_artifact(
        model,
        mask_row,
        cfg.method,
        folder / "artifact",
        {
            "objective": cfg.objective,
            "mask_token": tok.mask_token,
            "sbd_block_size_range": list(cfg.block_size_range),
            "steps": cfg.steps,
            **parent,
            **({"rehearsal": [cfg.rehearsal, cfg.rehearsal_len, cfg.rehearsal_weight]} if cfg.rehearsal else {}),
            "base_loader": BASE_LOADER,
            "base": f"{checkpoint.PACKAGE}=={checkpoint.PACKAGE_VERSION} ({checkpoint.GGUF_NAME})",
        },
    )
    info["artifact_bytes"] = size
    (folder / "train_log.json").write_text(json.dumps(info, indent=1) + "\n")
    log(f"[{cfg.objective}] done: fixed-batch {after}; artifact {size / 1e6:.1f} MB in {folder / 'artifact'}")
    return info


def describe_artifact(folder: str | os.PathLike) -> str:
    """A portable record of the artifact a run continued: its folder's name, its steps and the SHA-256 of its
    adapter weights (never this machine's absolute path, which means nothing where the artifact ships)."""
    import hashlib

    folder = Path(folder)
    digest = hashlib.sha256((folder / adapters.ADAPTER_FILE).read_bytes()).hexdigest()
    steps = adapters.read_artifact_config(folder).get("steps")
    return f"{folder.name} ({steps} steps; {adapters.ADAPTER_FILE} sha256 {digest[:16]})"


def train_with_trainer(cfg: FinetuneConfig, out: str | os.PathLike, log=print) -> dict:
    """The SBD objective through :class:`sbd_ext.training.SBDTrainer` (transformers' ``Trainer``): the path that
    scales past one machine, since ``accelerate launch`` (DDP, FSDP) distributes it with no code of ours; batch =
    ``cfg.batch_size`` per process. Writes ``<out>/sbd-trainer/`` (artifact + log) from the main process."""
    from transformers import TrainingArguments

    if cfg.objective != "sbd":
        raise ValueError("train_with_trainer trains the SBD objective")
    model, tok, mask_id = base_model("cpu", cfg.block_size_range)
    n_train = cfg.fixed_data if cfg.fixed_data > 0 else cfg.steps * cfg.batch_size
    samples = [data.encode(tok, p) for p in data.task_problems("train", n_train, seed=cfg.seed)]
    samples = [(ids[: cfg.max_len], lab[: cfg.max_len]) for ids, lab in samples]
    mask_row, params = adapters.prepare(model, mask_id, cfg.method, cfg.lora_rank)
    folder = Path(out) / "sbd-trainer"
    args = TrainingArguments(
        output_dir=str(folder / "trainer"),
        max_steps=cfg.steps,
        per_device_train_batch_size=cfg.batch_size,
        learning_rate=cfg.learning_rate,
        adam_beta2=0.95,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine",
        warmup_steps=cfg.warmup_steps,
        logging_steps=cfg.log_every,
        report_to=[],
        save_strategy="no",
        seed=cfg.seed,
        disable_tqdm=True,
        remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = SBDTrainer(
        model=model,
        args=args,
        train_dataset=samples,
        data_collator=lambda items: data.collate(items, tok.pad_token_id),
        block_size_range=cfg.block_size_range,
    )
    t0 = time.perf_counter()
    trainer.train()
    info = {
        "processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "config": asdict(cfg),
        "seconds": round(time.perf_counter() - t0, 1),
        "history": trainer.state.log_history,
    }
    if trainer.is_world_process_zero():
        adapters.save_artifact(
            model,
            mask_row,
            cfg.method,
            folder / "artifact",
            {"objective": "sbd", "base_loader": BASE_LOADER, "sbd_block_size_range": list(cfg.block_size_range)},
        )
        (folder / "train_log.json").write_text(json.dumps(info, indent=1, default=str) + "\n")
        log(f"[sbd-trainer] {info['processes']} process(es), {info['distributed_type']}: {folder}")
    return info
