"""The SBD objective in HF ``Trainer``: :class:`SBDTrainer` (multi-GPU through accelerate / FSDP)."""

from __future__ import annotations

import random
import zlib

import torch
from transformers import Trainer

from ..metadata import (
    DEFAULT_BLOCK_SIZE_RANGE,
    check_block_size_range,
    get_sbd_metadata,
    require_mask_token_id,
    set_sbd_metadata,
    unwrap_model,
)
from ..quantization import check_trainable_weights
from .loss import sbd_loss

__all__ = ["SBDTrainer"]

_PART_NAMES = ("ntp_loss", "mask_loss", "mask_accuracy")


class SBDTrainer(Trainer):
    """``transformers.Trainer`` with the SBD objective; distributed training comes from accelerate (DDP, FSDP).

    Extra arguments: ``block_size_range`` (inclusive; default ``model.config.sbd_block_size_range`` or (2, 16)),
    ``mask_token_id`` (default ``model.config.mask_token_id``). Batches are dicts with ``input_ids`` [B, L] and
    optionally ``attention_mask`` (right padding) and ``labels`` (``IGNORE_INDEX`` = no loss). k is drawn per
    forward from a ``random.Random(args.seed)``, so every rank uses the same k at the same step (equal work per
    rank). Each sequence's eta and masks come from a generator keyed by (seed, optimizer step, its unpadded
    tokens), and the two token means are taken over the whole world's tokens (counts summed across ranks): N ranks
    with batch b follow the trajectory of one rank with batch N·b. The mean NTP loss, mask loss and masked
    accuracy since the last log are logged next to ``loss`` (``ntp_loss``, ``mask_loss``, ``mask_accuracy``; with
    the ``eval_`` prefix on evaluation). Evaluation reports the SBD loss as ``eval_loss``.
    """

    # compute_loss returns a per-batch mean: let the Trainer divide it by the gradient-accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(self, *args, block_size_range=None, mask_token_id: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        # Same statement for transformers versions without ``loss_is_scaled_for_ga`` (5.17, the GPU image's): they
        # divide by the accumulation steps only when the model is not marked as taking loss kwargs.
        self.model_accepts_loss_kwargs = False
        hf = unwrap_model(self.model)
        check_trainable_weights(hf, "SBDTrainer")
        if block_size_range is None:
            block_size_range = get_sbd_metadata(hf)[1] or DEFAULT_BLOCK_SIZE_RANGE
        self.block_size_range = check_block_size_range(block_size_range)
        self.mask_token_id = require_mask_token_id(hf, mask_token_id, "SBDTrainer")
        set_sbd_metadata(hf, self.mask_token_id, self.block_size_range)
        self._k_rng = random.Random(self.args.seed)
        self._sbd_sums: dict[str, dict] = {}

    def _accumulate(self, prefix: str, parts: dict) -> None:
        acc = self._sbd_sums.setdefault(prefix, {"n": 0})
        for name in _PART_NAMES:
            acc[name] = acc.get(name, 0.0) + parts[name]
        acc["n"] += 1

    def _sequence_noise(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        """(eta [B], noise [B, L]) per sequence from (seed, step, its unpadded tokens): a sequence is masked the same
        way whichever rank, batch or padding it gets."""
        B, L = input_ids.shape
        lengths = [L] * B if attention_mask is None else attention_mask.long().sum(1).tolist()
        eta, noise = torch.empty(B), torch.ones(B, L)
        for b in range(B):
            tokens = input_ids[b, : lengths[b]].detach().cpu().numpy().tobytes()
            key = (int(self.args.seed) * 1_000_003 + int(self.state.global_step)) * (1 << 32) + zlib.crc32(tokens)
            g = torch.Generator().manual_seed(key % (1 << 63))
            eta[b] = torch.rand(1, generator=g)[0]
            noise[b, : lengths[b]] = torch.rand(lengths[b], generator=g)
        return eta.to(input_ids.device), noise.to(input_ids.device)

    def _global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        world = self.accelerator.num_processes
        return self.accelerator.reduce(counts.to(self.args.device), reduction="sum") / world

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        k = self._k_rng.randint(*self.block_size_range)
        eta, noise = self._sequence_noise(inputs["input_ids"], inputs.get("attention_mask"))
        loss, parts = sbd_loss(
            model,
            inputs["input_ids"],
            mask_token_id=self.mask_token_id,
            block_size=k,
            attention_mask=inputs.get("attention_mask"),
            labels=inputs.get("labels"),
            eta=eta,
            noise=noise,
            reduce_counts=self._global_counts if self.accelerator.num_processes > 1 and model.training else None,
            return_parts=True,
        )
        self._accumulate("" if model.training else "eval_", parts)
        return (loss, parts) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation = the SBD loss (a plain forward of the 2L batch has no other meaning here)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        for prefix, key in (("", "loss"), ("eval_", "eval_loss")):
            acc = self._sbd_sums.get(prefix)
            if key in logs and acc and acc["n"] > 0:
                vals = torch.stack([torch.as_tensor(acc[n], dtype=torch.float32) for n in _PART_NAMES]) / acc["n"]
                vals = self.accelerator.reduce(vals.to(self.args.device), reduction="mean")
                for n, v in zip(_PART_NAMES, vals.tolist(), strict=True):
                    logs[prefix + n] = round(v, 4)
                self._sbd_sums.pop(prefix)
        super().log(logs, start_time)
