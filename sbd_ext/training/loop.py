"""The package's one plain training loop, :func:`train_loop`: any model, any loss (nothing SBD-specific); used by
:func:`~sbd_ext.training.train_sbd`, the demo trainer and the SmolLM2 recipe."""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["train_loop", "lr_factor"]


def lr_factor(step: int, steps: int, warmup_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Linear warm-up over ``warmup_steps`` (step 0 gets 1/warmup of the lr, not 0), then cosine decay from 1 to
    ``min_lr_ratio`` at ``steps``. ``step`` counts optimizer steps taken so far (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    t = (step - warmup_steps) / max(1, steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))


def _rng_state(r):
    return r.get_state() if isinstance(r, torch.Generator) else r.getstate()


def _set_rng_state(r, state) -> None:
    if isinstance(r, torch.Generator):
        r.set_state(state)
    else:
        r.setstate(state)


class _Batches:
    """Endless batches: a re-iterable (list, DataLoader) starts over when exhausted; a one-shot iterator ends."""

    def __init__(self, data: Iterable):
        self.data, self.it = data, iter(data)

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.data)
            if self.it is self.data:  # a one-shot iterator: nothing left
                return None
            return next(self.it, None)


def _trainable_state(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """The named parameters that train: all that changes during :func:`train_loop` (frozen ones stay as loaded),
    so a LoRA run's checkpoint holds its adapters, not the base model."""
    ids = {id(p) for p in params}
    return {n: p.detach() for n, p in model.named_parameters() if id(p) in ids}


_CHECKPOINT_KEYS = frozenset({"step", "model", "optimizer", "scheduler", "history", "rngs"})


def _load_checkpoint(path: Path) -> dict:
    """A :func:`train_loop` checkpoint, loaded without executing code (``weights_only``); one clear error for a file
    that is not one."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unpickling failure means: not a checkpoint of this loop
        raise ValueError(f"train_loop: {path} is not a train_loop checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not _CHECKPOINT_KEYS <= state.keys():
        raise ValueError(f"train_loop: {path} is not a train_loop checkpoint (expected {sorted(_CHECKPOINT_KEYS)})")
    kinds = {
        "step": (int, "an int >= 0"),
        "model": (dict, "a dict of tensors"),
        "optimizer": (dict, "an optimizer state_dict"),
        "scheduler": (dict, "a scheduler state_dict"),
        "history": (list, "a list"),
        "rngs": ((list, tuple), "a list of generator states"),
    }
    for key, (kind, what) in kinds.items():
        value = state[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"train_loop: {path}: {key!r} must be {what}, got {type(value).__name__}")
    if state["step"] < 0:
        raise ValueError(f"train_loop: {path}: 'step' must be >= 0, got {state['step']}")
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state["model"].items()):
        raise ValueError(f"train_loop: {path}: 'model' must map parameter names to tensors")
    for key in ("state", "param_groups"):
        if key not in state["optimizer"]:
            raise ValueError(f"train_loop: {path}: 'optimizer' has no {key!r} (not an optimizer state_dict)")
    return state


def _check_trainable(model: torch.nn.Module, saved: dict, path: Path) -> None:
    current = dict(model.named_parameters())
    unknown = sorted(set(saved) - set(current))
    if unknown:
        raise ValueError(f"train_loop: {path} holds parameters this model does not have: {unknown[:5]}")
    for name, value in saved.items():
        if current[name].shape != value.shape:
            raise ValueError(
                f"train_loop: {path}: {name} has shape {tuple(value.shape)}, the model's is "
                f"{tuple(current[name].shape)}"
            )


def _load_trainable(model: torch.nn.Module, saved: dict, path: Path) -> None:
    _check_trainable(model, saved, path)
    current = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in saved.items():
            current[name].copy_(value)


def train_loop(
    model: torch.nn.Module,
    data: Iterable,
    loss_fn: Callable[[torch.nn.Module, Any], Any],
    steps: int,
    *,
    lr: float = 3e-4,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.0,
    warmup_steps: int | None = None,
    min_lr_ratio: float = 0.0,
    max_grad_norm: float | None = 1.0,
    params: Iterable[torch.nn.Parameter] | None = None,
    autocast_dtype: torch.dtype | None = None,
    log_every: int = 10,
    progress: bool | str = True,
    name: str = "train",
    callback: Callable[[dict], None] | None = None,
    eval_fn: Callable[[torch.nn.Module, int], dict] | None = None,
    eval_every: int = 0,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    rngs: Sequence[torch.Generator | random.Random] = (),
) -> list[dict]:
    """Train ``model`` for ``steps`` optimizer steps of ``loss_fn``: the package's one training loop.

    loss_fn(model, batch) returns the loss or ``(loss, parts)``, parts a dict of scalars (tensors or numbers) that
    are averaged over each logging interval next to ``loss`` (an int ``block_size`` part is skipped). ``data`` is
    an iterable of batches, re-iterated when exhausted if it can be (a list, a DataLoader); a one-shot iterator
    that runs out ends training early.

    AdamW over ``params`` (default: the parameters that require grad) with ``lr``, ``betas``, ``weight_decay``;
    the lr follows :func:`lr_factor` (linear warm-up over ``warmup_steps``, default min(200, steps // 10), then
    cosine decay to ``min_lr_ratio`` × lr); gradients are clipped at ``max_grad_norm`` (None: no clipping); the
    forward runs under autocast to ``autocast_dtype`` when given (bf16 on a GPU). Every ``log_every`` steps (and at
    the last) a record {step, loss, <parts>, lr, elapsed_s} is appended to the returned history, shown on a tqdm bar
    (``progress="lines"``, or tqdm missing: a printed line per record, for logs; False: nothing) and passed to
    ``callback``.
    ``eval_fn(model, step)``, every ``eval_every`` steps before the last, returns a dict recorded as
    {step, **dict}; the model is put back in train mode afterwards.

    Resume: with ``checkpoint`` (a file path), the model, optimizer and schedule state, the history, the states of
    ``rngs`` (the generators ``loss_fn`` draws from) and the step are saved there every ``checkpoint_every`` steps
    and at the end (atomically); a later call with the same path continues from the saved step, skipping the
    batches already consumed, so an interrupted run finishes with the same weights as an uninterrupted one.
    The model is left in eval mode.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"train_loop: steps must be an int >= 0, got {steps!r}")
    if log_every < 1:
        raise ValueError(f"train_loop: log_every must be >= 1, got {log_every!r}")
    params = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
    if not params:
        raise ValueError("train_loop: no trainable parameters (none requires grad)")
    warmup_steps = min(200, steps // 10) if warmup_steps is None else int(warmup_steps)
    warmup_steps = max(1, warmup_steps)
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, warmup_steps, min_lr_ratio))
    device = params[0].device

    history: list[dict] = []
    start = 0
    ckpt_path = Path(checkpoint) if checkpoint is not None else None
    if ckpt_path is not None and ckpt_path.exists():
        state = _load_checkpoint(ckpt_path)
        # Every check before anything is loaded: a refused checkpoint leaves the model as it was.
        _check_trainable(model, state["model"], ckpt_path)
        if len(state["rngs"]) != len(rngs):
            raise ValueError(
                f"train_loop: {ckpt_path} saved {len(state['rngs'])} generator state(s), this run passes "
                f"{len(rngs)} in rngs: not a checkpoint of this run"
            )
        for what, obj in (("optimizer", opt), ("scheduler", sched)):
            try:
                obj.load_state_dict(state[what])
            except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as e:
                detail = f"missing key {e}" if isinstance(e, KeyError) else str(e)
                raise ValueError(
                    f"train_loop: {ckpt_path}: its {what!r} state does not fit this run's {what} ({detail})"
                ) from None
        _load_trainable(model, state["model"], ckpt_path)
        history = list(state["history"])
        for r, st in zip(rngs, state["rngs"], strict=True):
            try:
                _set_rng_state(r, st)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"train_loop: {ckpt_path}: a saved generator state does not fit ({e})") from None
        start = int(state["step"])

    def save_checkpoint(step: int) -> None:
        state = dict(
            step=step,
            model=_trainable_state(model, params),
            optimizer=opt.state_dict(),
            scheduler=sched.state_dict(),
            history=history,
            rngs=[_rng_state(r) for r in rngs],
        )
        ckpt_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = ckpt_path.with_name(ckpt_path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, ckpt_path)

    batches = _Batches(data)
    for _ in range(start):  # the batches the saved steps consumed
        batches.next()

    bar = None
    if progress is True and steps > start:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, initial=start, desc=name, dynamic_ncols=True)
        except ImportError:
            bar = None
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    )
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    t0 = time.perf_counter()
    model.train()
    reached = start
    for step in range(start + 1, steps + 1):
        batch = batches.next()
        if batch is None:
            if reached == 0:
                raise ValueError("train_loop: data yielded no batch")
            warnings.warn(
                f"train_loop ({name}): data ran out after step {reached} of {steps}; the checkpoint records "
                f"step {reached}",
                stacklevel=2,
            )
            break
        reached = step
        with autocast:
            out = loss_fn(model, batch)
        loss, parts = out if isinstance(out, tuple) else (out, {})
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        sched.step()
        # Sums stay on the device: no host sync per step, one per logging interval.
        for key, v in {"loss": loss, **parts}.items():
            if key == "block_size" or key == "num_masked":
                continue
            v = torch.as_tensor(v).detach().float().to(device)
            sums[key] = sums[key] + v if key in sums else v
            counts[key] = counts.get(key, 0) + 1  # a part a step may leave out is averaged over the steps with it
        if bar is not None:
            bar.update(1)
        if step % log_every == 0 or step == steps:
            rec = {"step": step, **{k: round(float(v) / counts[k], 4) for k, v in sums.items()}}
            rec["lr"] = sched.get_last_lr()[0]
            rec["elapsed_s"] = round(time.perf_counter() - t0, 1)
            history.append(rec)
            sums, counts = {}, {}
            msg = " ".join(f"{k} {rec[k]:.4f}" for k in rec if k not in ("step", "lr", "elapsed_s"))
            if bar is not None:
                bar.set_postfix_str(msg)
            elif progress:
                rate = (step - start) / max(time.perf_counter() - t0, 1e-9)
                print(f"[{name}] step {step}/{steps} {msg} lr {rec['lr']:.2e} ({rate:.2f} steps/s)", flush=True)
            if callback is not None:
                callback(rec)
        if eval_fn is not None and eval_every and step % eval_every == 0 and step < steps:
            rec = {"step": step, **eval_fn(model, step)}
            model.train()
            history.append(rec)
            if progress:
                print(f"[{name}] step {step}: " + " ".join(f"{k} {v}" for k, v in rec.items() if k != "step"))
        if ckpt_path is not None and checkpoint_every and step % checkpoint_every == 0 and step < steps:
            save_checkpoint(step)
    if bar is not None:
        bar.close()
    if ckpt_path is not None and reached > start:
        save_checkpoint(reached)
    model.eval()
    return history
