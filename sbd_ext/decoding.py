"""Set Block Decoding over a HuggingFace causal LM, with the exact KV cache of the paper's Alg. 3.

Public API
----------
* :func:`generate` -- SBD (or NTP) generation through :class:`SBDCache` and the sbd_ext kernels.
* :func:`generate_reference` -- the no-cache reference decoder: recomputes every sequence from scratch on every
  forward with a dense 4D mask (prefix causal, block bidirectional) through the model's SDPA/eager attention and
  the pure-PyTorch reference samplers of :mod:`sbd_ext.reference`. Same arguments, same outputs, same random
  stream: with a deterministic model it returns exactly the tokens of :func:`generate`.
* :class:`SBDCache` / :class:`SBDForwardPlan` live in :mod:`sbd_ext.cache`; the SBD fields of a model config
  (``set_sbd_metadata`` / ``get_sbd_metadata``) in :mod:`sbd_ext.metadata`. Both are re-exported here.

SBD metadata
------------
``mask_token_id`` and ``sbd_block_size_range`` on the model's text config; see :mod:`sbd_ext.metadata`.

Decoding (per sequence; sequences of a batch advance independently)
--------------------------------------------------------------------
* forward 0: the prompt (committed, causal, K/V written) followed by the first block's k mask slots (set block):
  prefill and the block's first forward fused in one forward;
* first forward of every later block: the k tokens of the block just finished (committed: the only time their K/V
  are computed) followed by the k slots of the new block;
* later forwards of a block: the k block positions only (``n_commit = 0``); mask-slot K/V are never stored and the
  prefix is never recomputed. Position ids are ``cache_len + row``.
* The prediction for block position t+i is read from the output at t+i itself; the mask token's logit is set to
  -inf; :func:`sbd_ext.ops.entropy_sample` proposes a token per position (argmax or a Philox/Gumbel-max sample)
  and :func:`sbd_ext.ops.mask_replace` reveals positions by the sampler rule, in place.
* Sampling stream: forward f draws with ``offset = f``; block position j of batch row b is row ``b * block_size + j``
  (NTP: row b). Greedy decoding is batch-invariant; temperature sampling depends on the row's place in the batch.
* Stopping: a sequence stops when it has ``max_new_tokens`` tokens, or when a revealed token is a stop token (EOS)
  and every position before the first such token is revealed; tokens after it are dropped (the stop token is
  kept, as HF ``generate`` keeps EOS). The last block is shortened to the remaining budget.
* NTP mode (``mode="ntp"``) runs through the same cache and kernels: one token per forward from the model's
  next-token head (output at t-1), argmax or a sample via ``entropy_sample``; the mask token is not banned there.
* The counts and block tokens are read back once per forward (one device-to-host copy) to decide block completion
  and stopping. A sequence that still has masked positions but revealed none (NaN logits) raises an error.
* :func:`generate` needs the ``"sbd"`` attention; a model set to another implementation is switched with
  ``model.set_attn_implementation("sbd")`` for the call and switched back afterwards.
* Finished sequences stay in the batch as padding rows (``n_valid = 0``) until every sequence is done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from . import families, ops, reference
from .cache import SBDCache, SBDForwardPlan
from .hf import ATTN_IMPLEMENTATION, kernel_available
from .metadata import BLOCK_RANGE_ATTR, MASK_TOKEN_ATTR, get_sbd_metadata, set_sbd_metadata

__all__ = [
    "MASK_TOKEN_ATTR",
    "BLOCK_RANGE_ATTR",
    "DEFAULT_THRESHOLDS",
    "SAMPLERS",
    "set_sbd_metadata",
    "get_sbd_metadata",
    "SBDCache",
    "SBDForwardPlan",
    "SBDGenerateOutput",
    "GenerationSettings",
    "generate",
    "generate_reference",
    "sample_block",
]

SAMPLERS = reference.RULES  # ("eb", "entropy", "confidence")
# Library defaults. gamma 0.35 for the entropy rules is the paper's chat gamma_low (and its reasoning gamma_high;
# the reasoning gamma_low is 0.1, which the demo uses); tau 0.9 for the confidence rule as in Fast-dLLM.
DEFAULT_THRESHOLDS = {"eb": 0.35, "entropy": 0.35, "confidence": 0.9}


# --------------------------------------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------------------------------------
@dataclass
class SBDGenerateOutput(ModelOutput):
    """Result of :func:`generate` / :func:`generate_reference`.

    sequences: [B, L] int64, row b = its prompt (padding removed) + its generated tokens, right-padded with
        ``pad_token_id``.
    prompt_lengths, num_generated, nfe: [B] int64; nfe = model forwards the sequence took part in (the fused
        prefill included). tokens_per_forward: [B] float, num_generated / nfe.
    trace: per sequence, one ``(forward index, positions revealed, tokens)`` tuple per forward (positions index
        into the row of ``sequences``); only positions kept in the output are listed. None unless return_trace.
    past_key_values: the :class:`SBDCache` (only with ``return_cache=True``; :func:`generate` only).
    num_accepted, num_corrected: [B] int64 (verify mode; zeros otherwise): generated tokens that SBD revealed and
        verification kept, and corrections (each the NTP choice that replaced the first disagreeing token of a
        block, the rest of the block dropped); num_accepted + num_corrected = num_generated.
    corrections: per sequence, the positions (in the row of ``sequences``) of corrected tokens (verify mode).
    """

    sequences: torch.Tensor | None = None
    prompt_lengths: torch.Tensor | None = None
    num_generated: torch.Tensor | None = None
    nfe: torch.Tensor | None = None
    tokens_per_forward: torch.Tensor | None = None
    trace: list | None = None
    past_key_values: SBDCache | None = None
    num_accepted: torch.Tensor | None = None
    num_corrected: torch.Tensor | None = None
    corrections: list | None = None


# --------------------------------------------------------------------------------------------------------
# settings: validated once
# --------------------------------------------------------------------------------------------------------
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _token_ids(value, name: str) -> tuple[int, ...] | None:
    """None, an int, or a sequence / 1-D tensor of ints -> a tuple of ids >= 0; a clear error for anything else
    (a string is refused: "12" is not the ids (1, 2))."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool or value.dim() > 1:
            raise TypeError(f"{name} must be an int or a 1-D integer tensor / list of ints, got {value!r}")
        value = value.tolist()
    if _is_int(value):
        value = (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset, range)):
        raise TypeError(f"{name} must be an int or a list of ints (token ids), got {type(value).__name__} {value!r}")
    ids = tuple(value)
    for t in ids:
        if not _is_int(t) or not 0 <= t <= _INT64_MAX:
            raise ValueError(f"{name} must hold token ids (ints >= 0), got {t!r} in {value!r}")
    return ids


@dataclass(frozen=True)
class GenerationSettings:
    """How :func:`generate` decodes: every field is validated once, at construction, whatever the mode.

    mode: "sbd" (set-block decoding) or "ntp" (one token per forward through the same cache and kernels).
    block_size: k, the set-block size (SBD). sampler: "eb" (entropy-bounded, paper Eq. 8), "entropy" (entropy
    threshold) or "confidence". threshold: gamma for "eb"/"entropy" (>= 0), tau for "confidence"; None ->
    ``DEFAULT_THRESHOLDS[sampler]``. temperature: 0 -> argmax; > 0 -> sample from softmax(logits / temperature)
    (Gumbel-max, Philox). seed: the Philox seed (an int64); forward f draws with offset f.
    max_new_tokens: generated tokens per sequence at most; None -> the model's generation_config (max_new_tokens,
    else max_length - longest prompt). eos_token_id: an int or ids; None -> generation_config / config EOS; ()
    disables. stop_token_ids: more ids that stop a sequence like EOS. pad_token_id: fills ``sequences``; None ->
    generation_config / config pad id, else the first EOS id, else 0. strict_block_size: refuse a k outside the
    model's trained ``sbd_block_size_range``. verify (SBD): lossless mode -- every revealed block is checked
    against the next-token choices its commit forward computes anyway; the output equals ``mode="ntp"``'s exactly.
    first_from_ntp (SBD): reveal a block's first position from the next-token choice of the forward's last
    committed row (always done in verify mode) instead of from the block's own mask prediction. compile: every
    forward after the prefill runs with static shapes under ``torch.compile(fullgraph=True)`` (a CUDA graph on
    CUDA); same tokens as eager decoding (see :func:`generate`).

    ``GenerationSettings.of(settings, **overrides)`` builds one from another plus keyword changes (what
    :func:`generate`'s keywords do).
    """

    mode: str = "sbd"
    block_size: int = 16
    sampler: str = "eb"
    threshold: float | None = None
    temperature: float = 0.0
    seed: int = 0
    max_new_tokens: int | None = None
    eos_token_id: tuple[int, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    strict_block_size: bool = True
    verify: bool = False
    first_from_ntp: bool = False
    compile: bool = False

    def __post_init__(self):
        set_ = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731  (frozen: normalise in place once)
        if self.mode not in ("sbd", "ntp"):
            raise ValueError(f"mode must be 'sbd' or 'ntp', got {self.mode!r}")
        if not _is_int(self.block_size) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if self.threshold is None:
            set_("threshold", float(DEFAULT_THRESHOLDS[self.sampler]))
        if not _is_number(self.threshold) or not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be a finite number, got {self.threshold!r}")
        if self.sampler in ("eb", "entropy") and self.threshold < 0:
            raise ValueError(f"threshold (gamma) of the {self.sampler!r} sampler must be >= 0, got {self.threshold}")
        set_("threshold", float(self.threshold))
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        set_("temperature", float(self.temperature))
        if not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise ValueError(f"seed must be an int in [-2**63, 2**63), got {self.seed!r}")
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        set_("eos_token_id", _token_ids(self.eos_token_id, "eos_token_id"))
        set_("stop_token_ids", _token_ids(self.stop_token_ids, "stop_token_ids") or ())
        if self.pad_token_id is not None and (not _is_int(self.pad_token_id) or self.pad_token_id < 0):
            raise ValueError(f"pad_token_id must be a token id (an int >= 0), got {self.pad_token_id!r}")
        if not isinstance(self.strict_block_size, bool):
            raise TypeError(f"strict_block_size must be a bool, got {self.strict_block_size!r}")
        if not isinstance(self.verify, bool):
            raise TypeError(f"verify must be a bool, got {self.verify!r}")
        if not isinstance(self.first_from_ntp, bool):
            raise TypeError(f"first_from_ntp must be a bool, got {self.first_from_ntp!r}")
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile must be a bool, got {self.compile!r}")
        if self.verify and self.mode != "sbd":
            raise ValueError(
                "verify=True checks SBD's revealed blocks; it needs mode='sbd' (mode='ntp' is exact already)"
            )

    @classmethod
    def of(cls, settings: GenerationSettings | None = None, **overrides) -> GenerationSettings:
        """``settings`` (default: all defaults) with ``overrides`` applied; unknown names are a TypeError."""
        if settings is not None and not isinstance(settings, GenerationSettings):
            raise TypeError(f"settings must be a GenerationSettings, got {type(settings).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown generation setting(s) {unknown}; the settings are {sorted(names)}")
        if settings is None:
            return cls(**overrides)
        return dataclasses.replace(settings, **overrides) if overrides else settings


@dataclass(frozen=True)
class _Job:
    """One call's settings with the model's defaults filled in, plus what the model and the prompts decide."""

    settings: GenerationSettings  # threshold, max_new_tokens, eos_token_id and pad_token_id resolved
    prompts: list[list[int]]
    stop_ids: frozenset
    mask_id: int | None
    vocab: int

    mode = property(lambda self: self.settings.mode)
    sbd = property(lambda self: self.settings.mode == "sbd")
    verify = property(lambda self: self.settings.verify)
    # The block's first position from the commit rows' NTP choice (always in verify mode, where it is verified).
    first_from_ntp = property(lambda self: self.settings.verify or self.settings.first_from_ntp)
    block_size = property(lambda self: self.settings.block_size if self.settings.mode == "sbd" else 1)
    sampler = property(lambda self: self.settings.sampler)
    threshold = property(lambda self: self.settings.threshold)
    temperature = property(lambda self: self.settings.temperature)
    seed = property(lambda self: self.settings.seed)
    max_new_tokens = property(lambda self: self.settings.max_new_tokens)
    pad_id = property(lambda self: self.settings.pad_token_id)


def _model_device_dtype(model) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, (model.dtype if hasattr(model, "dtype") else p.dtype)


def _prompts(input_ids, attention_mask, device, vocab: int) -> list[list[int]]:
    """The prompts as lists of ids, padding removed; clear errors for every malformed input."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"input_ids must be an integer tensor (token ids), got dtype {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D [batch, prompt_len], got shape {tuple(input_ids.shape)}")
    if input_ids.device != device:
        raise ValueError(f"input_ids is on {input_ids.device} but the model is on {device}; move it there first")
    B, P = input_ids.shape
    if B == 0 or P == 0:
        raise ValueError(f"empty prompt: input_ids has shape {tuple(input_ids.shape)}; every sequence needs >= 1 token")
    ids_host = input_ids.to("cpu", torch.int64)
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got "
                f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}"
            )
        if attention_mask.device != device:
            raise ValueError(f"attention_mask is on {attention_mask.device} but the model is on {device}")
        if attention_mask.is_floating_point() or attention_mask.is_complex():
            raise TypeError(f"attention_mask must be a bool or integer 0/1 tensor, got dtype {attention_mask.dtype}")
        am = attention_mask.to("cpu", torch.int64)
        if ((am != 0) & (am != 1)).any():
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    else:
        am = torch.ones_like(ids_host)
    prompts = []
    for b in range(B):
        idx = am[b].nonzero().flatten()
        if idx.numel() == 0:
            raise ValueError(f"sequence {b} of the batch is all padding (attention_mask row is all 0): empty prompt")
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        if hi - lo != idx.numel():
            raise ValueError(f"sequence {b}: attention_mask must be one contiguous run of 1s (left or right padding)")
        prompts.append(ids_host[b, lo:hi].tolist())
    if any(t < 0 or t >= vocab for p in prompts for t in p):
        raise ValueError(f"input_ids holds token ids outside [0, vocab_size={vocab})")
    return prompts


def _fill_model_defaults(settings: GenerationSettings, model, cfg, longest_prompt: int) -> GenerationSettings:
    """max_new_tokens, eos_token_id and pad_token_id from the model's generation_config / config when not given."""
    gen_cfg = getattr(model, "generation_config", None)
    fill = {}
    if settings.max_new_tokens is None:
        n = getattr(gen_cfg, "max_new_tokens", None)
        if n is None:
            max_len = getattr(gen_cfg, "max_length", None) or 20  # HF's default max_length
            n = max_len - longest_prompt
            if n < 1:
                raise ValueError(
                    f"max_new_tokens not given and generation_config.max_length={max_len} leaves no room after the "
                    f"longest prompt ({longest_prompt} tokens); pass max_new_tokens"
                )
        fill["max_new_tokens"] = n
    eos = settings.eos_token_id
    if eos is None:
        eos = getattr(gen_cfg, "eos_token_id", None)
        eos = getattr(cfg, "eos_token_id", None) if eos is None else eos
        fill["eos_token_id"] = _token_ids(eos, "the model's eos_token_id") or ()
    if settings.pad_token_id is None:
        pad = getattr(gen_cfg, "pad_token_id", None)
        pad = getattr(cfg, "pad_token_id", None) if pad is None else pad
        if pad is None:
            eos_ids = fill.get("eos_token_id", settings.eos_token_id)
            pad = eos_ids[0] if eos_ids else 0
        fill["pad_token_id"] = int(pad)
    return dataclasses.replace(settings, **fill) if fill else settings


def _check_sbd_model(settings: GenerationSettings, mask_id, block_range, vocab: int) -> None:
    if mask_id is None:
        raise ValueError(
            f"the model config has no `{MASK_TOKEN_ATTR}`: it was not trained for SBD (or its SBD metadata was not "
            f"saved). Set it with sbd_ext.metadata.set_sbd_metadata(model, mask_token_id=...), or use mode='ntp'"
        )
    if not 0 <= mask_id < vocab:
        raise ValueError(f"config.{MASK_TOKEN_ATTR} = {mask_id} is not a token id in [0, vocab_size={vocab})")
    k = settings.block_size
    if block_range is not None and settings.strict_block_size and not block_range[0] <= k <= block_range[1]:
        raise ValueError(
            f"block_size={k} is outside the block sizes the model was trained with "
            f"(config.{BLOCK_RANGE_ATTR} = [{block_range[0]}, {block_range[1]}]); pass strict_block_size=False to "
            f"decode with it anyway"
        )


def _job(model, input_ids, attention_mask, settings: GenerationSettings) -> _Job:
    """Resolve ``settings`` against ``model`` and the prompts (model defaults, SBD metadata, position limit)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise TypeError("model must be a HuggingFace PreTrainedModel (it has no .config)")
    cfg = config.get_text_config(decoder=True)
    device, _ = _model_device_dtype(model)
    vocab = int(cfg.vocab_size)
    prompts = _prompts(input_ids, attention_mask, device, vocab)
    longest = max(len(p) for p in prompts)
    settings = _fill_model_defaults(settings, model, cfg, longest)
    total = longest + settings.max_new_tokens
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if max_pos is not None and total > max_pos:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({settings.max_new_tokens}) = {total} exceeds the "
            f"model's max_position_embeddings = {max_pos}"
        )
    mask_id, block_range = get_sbd_metadata(config)
    if settings.mode == "sbd":
        _check_sbd_model(settings, mask_id, block_range, vocab)
    stop_ids = frozenset(settings.eos_token_id + settings.stop_token_ids)
    return _Job(settings, prompts, stop_ids, mask_id, vocab)


# --------------------------------------------------------------------------------------------------------
# per-sequence state machine, shared by the cached decoder and the reference
# --------------------------------------------------------------------------------------------------------
class _Seq:
    """Host-side state of one sequence: its output, the current block and the pending (uncached) tokens.

    ``pending`` are the tokens after the cached prefix; they are committed (causal rows, K/V written) in the next
    forward. In verify mode the last ``n_draft`` of them are a finished block's unverified tokens (drafts): that
    forward's committed rows also give the next-token (NTP) choice at every draft position, which accepts the
    agreeing prefix and corrects the first disagreement (:meth:`_verify`). Without verify, ``n_draft`` stays 0 and a
    finished block goes straight to the output.
    """

    def __init__(self, prompt: list[int], s: _Job):
        self.s = s
        self.prompt = prompt
        self.gen: list[int] = []  # the output (in verify mode: verified tokens only)
        self.pending: list[int] = list(prompt)  # tokens after the cached prefix, committed in the next forward
        self.n_draft = 0  # trailing pending tokens still to verify (verify mode)
        self.block: list[int] = []  # the current block (mask ids where masked); SBD only
        self.block_verified = 0  # leading block positions revealed by the verified NTP choice (verify mode)
        self.done = False
        self.nfe = 0
        self.corrected = 0  # corrections (one per rejected draft suffix)
        self.corrections: list[int] = []  # positions (in the output row) of the corrected tokens
        self.trace: list[tuple[int, list[int], list[int]]] = []
        if s.sbd:
            self._start_block()

    @property
    def n_cached(self) -> int:
        return len(self.prompt) + len(self.gen) + self.n_draft - len(self.pending)

    @property
    def block_start(self) -> int:
        return len(self.prompt) + len(self.gen) + self.n_draft

    def _start_block(self) -> None:
        k = min(self.s.block_size, self.s.max_new_tokens - len(self.gen) - self.n_draft)
        self.block = [self.s.mask_id] * k  # k = 0: the drafts fill the budget, only their verification is left
        self.block_verified = 0

    def _finished(self) -> bool:
        return self.n_draft == 0 and (
            len(self.gen) >= self.s.max_new_tokens or (bool(self.gen) and self.gen[-1] in self.s.stop_ids)
        )

    def _cut_trace(self, end: int) -> None:
        """Drop trace entries at positions >= end (tokens that will not be in the output)."""
        self.trace = [
            (g, [p for p in pos if p < end], [t for p, t in zip(pos, tok, strict=True) if p < end])
            for g, pos, tok in self.trace
        ]

    def _verify(self, f: int, ntp: list[int]) -> int | None:
        """Check the drafts against the NTP choices of this forward's committed rows (``ntp[i]`` = the choice for
        the position after pending row i). Returns None when all are accepted, else the number of committed rows
        whose K/V stay valid (the cache length is rolled back to n_cached + that)."""
        base = len(self.pending) - self.n_draft  # row of the first draft
        drafts = self.pending[base:]
        for t, d in enumerate(drafts):
            row = base + t - 1  # the committed row that predicts draft t (t = 0: checked when it was revealed)
            if row >= 0 and (ntp[row] is None or ntp[row] < 0):
                raise RuntimeError(
                    f"verify: sequence got an invalid next-token distribution at forward {f} (NaN or +inf logits)"
                )
            if row >= 0 and d != ntp[row]:
                c = ntp[row]
                pos = self.block_start - self.n_draft + t
                self._cut_trace(pos)
                self.trace.append((f, [pos], [c]))
                self.corrections.append(pos)
                self.gen.extend(drafts[:t] + [c])
                self.corrected += 1
                self.pending, self.n_draft = [c], 0
                return base + t
        self.gen.extend(drafts)
        self.pending, self.n_draft = [], 0
        return None

    def after_sbd_forward(
        self, f: int, block: list[int], n_rev: int, n_rem: int, b: int, ntp: list[int | None] | None = None
    ) -> int | None:
        """Update after an SBD forward (``block``: the block as revealed in place; ``ntp``, verify mode: the NTP
        choice after each of this sequence's committed rows, None where not computed). Returns, after a
        correction, how many of this forward's committed rows keep their K/V (the caller rolls the cache back to
        the length before the forward + that); else None."""
        s = self.s
        self.nfe += 1
        n_commit = len(self.pending)
        if self.n_draft:  # verify mode: this forward committed a finished block's drafts
            keep_rows = self._verify(f, ntp)
            if keep_rows is not None:
                # The block's predictions of this forward were conditioned on rejected drafts: drop them and start
                # the block after the correction.
                self.block = []
                if self._finished():
                    self.done = True
                else:
                    self._start_block()
                return keep_rows
        else:
            self.pending = []  # committed (their K/V cached) by this forward
        if self._finished():  # verify mode: the accepted drafts completed the output
            self.done, self.block = True, []
            return None
        k = len(self.block)
        if k == 0:
            return None
        if s.verify and n_commit > 0:
            self.block_verified = 1  # position 0 was revealed from the last committed row's NTP choice
        block = block[:k]
        if n_rem > 0 and n_rev == 0:
            raise RuntimeError(
                f"SBD decoding: sequence {b} revealed no token at forward {f} although {n_rem} positions are masked: "
                f"every proposal was invalid (NaN or +inf logits, or all logits -inf once the mask token is banned)"
            )
        revealed = [j for j in range(k) if self.block[j] == s.mask_id and block[j] != s.mask_id]
        self.block = block
        stop = next((j for j in range(k) if block[j] in s.stop_ids and block[j] != s.mask_id), None)
        stopped = stop is not None and all(t != s.mask_id for t in block[:stop])
        if stopped:
            keep = stop + 1
        elif n_rem == 0:
            keep = k
        else:
            keep = None
        start = self.block_start
        self.trace.append((f, [start + j for j in revealed], [block[j] for j in revealed]))
        if keep is None:
            return None
        if keep < k:
            self._cut_trace(start + keep)  # stopped at a stop token: the positions after it are dropped
        finished = block[:keep]
        self.block = []
        if s.verify and keep > self.block_verified:
            self.pending, self.n_draft = finished, keep  # checked by the next forward's committed rows
        else:
            self.gen.extend(finished)
            self.pending = finished
        if self._finished():
            self.done = True
        elif not stopped:
            self._start_block()  # (after a stop token only the drafts' verification is left)
        return None

    def after_ntp_forward(self, f: int, token: int, b: int) -> None:
        self.nfe += 1
        if token < 0:
            raise RuntimeError(
                f"NTP decoding: sequence {b} got an invalid next-token distribution at forward {f} (NaN or +inf logits)"
            )
        self.trace.append((f, [self.block_start], [token]))
        self.gen.append(token)
        self.pending = [token]
        if token in self.s.stop_ids or len(self.gen) >= self.s.max_new_tokens:
            self.done = True


def _block_tensor(seqs: list[_Seq], active: list[bool], s: _Job) -> torch.Tensor:
    """[B, block_size] int64 on the CPU: each active sequence's block, then a filler that is not the mask id."""
    fill = s.pad_id if s.pad_id != s.mask_id else (0 if s.mask_id != 0 else 1)
    block = torch.full((len(seqs), s.block_size), fill, dtype=torch.int64)
    for b, q in enumerate(seqs):
        if active[b] and q.block:
            block[b, : len(q.block)] = torch.tensor(q.block, dtype=torch.int64)
    return block


def position_key(b: int, p: int) -> int:
    """The Philox offset of the next-token draw at absolute position ``p`` of batch row ``b`` (NTP mode and verify
    mode): ``b * 2**40 + p``, drawn as row 0 of its own ``entropy_sample`` call. Keyed by position rather than by
    forward, the same (seed, b, p) gives the same noise in every mode, which is what makes verify mode with
    temperature > 0 return exactly NTP mode's sample."""
    return (b << 40) + p


def sample_positions(
    logits: torch.Tensor, temperature: float, seed: int, keys: Sequence[int], impl=ops
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """entropy_sample of each row of ``logits`` [N, V] with its own Philox offset ``keys[i]`` (see
    :func:`position_key`). Greedy needs no noise: one call."""
    if temperature == 0.0 or logits.shape[0] == 0:
        return impl.entropy_sample(logits, 0.0, seed, 0)
    outs = [impl.entropy_sample(logits[i : i + 1], temperature, seed, int(key)) for i, key in enumerate(keys)]
    return tuple(torch.cat([o[n] for o in outs]) for n in range(3))


def sample_block(
    logits: torch.Tensor,
    block: torch.Tensor,
    mask_id: int,
    sampler: str = "eb",
    threshold: float = 0.35,
    temperature: float = 0.0,
    seed: int = 0,
    offset: int = 0,
    impl=ops,
    keys: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One SBD sampling step: reveal masked positions of ``block`` in place.

    Args:
        logits: [B, K, V] the block positions' logits (read at the positions themselves). Modified: the mask
            token's logit is set to -inf (it is never proposed).
        block: [B, K] int64 block tokens, ``mask_id`` where masked, on logits' device. Modified in place.
        sampler, threshold: the mask_replace rule and its gamma / tau.
        temperature, seed, offset: entropy_sample's; position j of row b draws Philox row ``b * K + j``.
        impl: :mod:`sbd_ext.ops` (kernels) or :mod:`sbd_ext.reference`.
        keys: [B * K] per-position Philox offsets (:func:`position_key`) instead of ``offset`` (verify mode).
    Returns:
        (n_revealed [B], n_remaining [B], entropy [B, K], max_prob [B, K], proposals [B, K]).
    """
    B, K, V = logits.shape
    logits[..., mask_id] = float("-inf")
    if keys is None:
        ent, pmax, tok = impl.entropy_sample(logits.reshape(B * K, V), temperature, seed, offset)
    else:
        ent, pmax, tok = sample_positions(logits.reshape(B * K, V), temperature, seed, keys, impl)
    ent, pmax, tok = ent.view(B, K), pmax.view(B, K), tok.view(B, K)
    n_rev, n_rem = impl.mask_replace(block, tok, ent, pmax, mask_id, sampler, threshold)
    return n_rev, n_rem, ent, pmax, tok


def _finish(seqs: list[_Seq], s: _Job, device, return_trace: bool, cache=None) -> SBDGenerateOutput:
    B = len(seqs)
    L = max(len(q.prompt) + len(q.gen) for q in seqs)
    out = torch.full((B, L), s.pad_id, dtype=torch.int64)
    for b, q in enumerate(seqs):
        row = q.prompt + q.gen
        out[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
    n_gen = torch.tensor([len(q.gen) for q in seqs], dtype=torch.int64)
    nfe = torch.tensor([q.nfe for q in seqs], dtype=torch.int64)
    return SBDGenerateOutput(
        sequences=out.to(device),
        prompt_lengths=torch.tensor([len(q.prompt) for q in seqs], dtype=torch.int64),
        num_generated=n_gen,
        nfe=nfe,
        tokens_per_forward=n_gen.double() / nfe.clamp_min(1).double(),
        trace=[q.trace for q in seqs] if return_trace else None,
        past_key_values=cache,
        num_accepted=torch.tensor([len(q.gen) - q.corrected if s.verify else 0 for q in seqs], dtype=torch.int64),
        num_corrected=torch.tensor([q.corrected for q in seqs], dtype=torch.int64),
        corrections=[list(q.corrections) for q in seqs],
    )


_SWITCH_LOCK = threading.Lock()


def _use_sbd_attention(model) -> None:
    """Make ``model`` run the ``"sbd"`` attention, once and for good.

    A per-call switch (and switch back) would be seen by every other thread using the same model, so a model loaded
    with another implementation is switched permanently, under a lock, with a warning; for ordinary forwards
    ``"sbd"`` gives what ``"sdpa"`` gives (it falls back to SDPA for custom masks and autograd). Concurrent
    :func:`generate` calls on one model are then independent: each has its own cache and plan, and nothing else
    in the model changes during a call.
    """
    if model.config._attn_implementation == ATTN_IMPLEMENTATION:
        return
    with _SWITCH_LOCK:
        prev = model.config._attn_implementation
        if prev == ATTN_IMPLEMENTATION:
            return
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise RuntimeError(
                f"could not switch {type(model).__name__} to attn_implementation={ATTN_IMPLEMENTATION!r}; load it with "
                f"from_pretrained(..., attn_implementation={ATTN_IMPLEMENTATION!r})"
            )
        warnings.warn(
            f"sbd_ext.generate switched {type(model).__name__} from attn_implementation={prev!r} to "
            f"{ATTN_IMPLEMENTATION!r} (same results for ordinary forwards); load the model with "
            f"attn_implementation={ATTN_IMPLEMENTATION!r} to avoid this",
            stacklevel=4,  # the caller of generate (past the no_grad wrapper)
        )


# --------------------------------------------------------------------------------------------------------
# the cached decoder
# --------------------------------------------------------------------------------------------------------
@dataclass
class _Forward:
    """The rows of one cached forward (host side): per sequence, ``n_commit`` committed rows (the finished block,
    or the prompt, causal; their K/V are written now) followed by the current block's rows (the set block)."""

    ids: torch.Tensor  # [B, T] int64 on the CPU
    pos: torch.Tensor  # [B, T] int64 position ids
    n_commit: list[int]
    n_valid: list[int]
    first: int  # first row whose logits are needed (the lm_head skips the rows before it)
    # The logits hold each sequence's block rows only, [B, block_size, V] (the static step gathers them before the
    # lm_head); else rows [first, T).
    block_rows_only: bool = False


def _next_forward(seqs: list[_Seq], job: _Job, widen=None) -> _Forward:
    """Alg. 3, lines "commit + fill": each active sequence contributes its pending tokens (the block it finished
    last forward, or its prompt) as committed rows, then its current block (SBD). T = the longest sequence's rows,
    or ``widen(that)`` (the compiled step's padded width)."""
    active = [not q.done for q in seqs]
    n_commit = [len(q.pending) if a else 0 for q, a in zip(seqs, active, strict=True)]
    n_block = [len(q.block) if (a and job.sbd) else 0 for q, a in zip(seqs, active, strict=True)]
    n_valid = [c + k for c, k in zip(n_commit, n_block, strict=True)]
    T = max(n_valid) if widen is None else widen(max(n_valid))
    if T < max(n_valid):
        raise RuntimeError(f"internal: a static forward of {T} rows cannot hold {max(n_valid)} rows")
    # Padding rows at position 0: never widens a dynamic RoPE. Built as lists, one tensor: cheap at small B.
    ids, pos = [], []
    for b, q in enumerate(seqs):
        row = (q.pending + (q.block if job.sbd else [])) if active[b] else []
        pad = [0] * (T - len(row))
        ids.append(row + pad)
        pos.append(list(range(q.n_cached, q.n_cached + len(row))) + pad)
    both = torch.tensor([ids, pos], dtype=torch.int64)
    # Rows read: SBD, block rows [c, c+k) of each sequence; NTP, row c-1; verify, also the committed rows that
    # check the drafts and reveal the block's first position, [c - n_draft - 1, c).
    first = min(_first_row(q, c, job) for q, c, a in zip(seqs, n_commit, active, strict=True) if a)
    return _Forward(both[0], both[1], n_commit, n_valid, first if widen is None else 0)


def _first_row(q: _Seq, c: int, job: _Job) -> int:
    """The first of this forward's rows whose logits sequence ``q`` reads (``c`` committed rows)."""
    if not job.sbd:
        return c - 1
    if job.first_from_ntp and c > 0:
        return max(c - q.n_draft - 1, 0)
    return c


def _run_forward(model, cache: SBDCache, fw: _Forward, device) -> torch.Tensor:
    """One forward over the cache; the kernel appends the committed rows' K/V. Returns logits [B, T - first, V]."""
    T = fw.ids.shape[1]
    with cache.forward_plan(fw.n_commit, fw.n_valid) as plan:
        return model(
            input_ids=fw.ids.to(device, non_blocking=True),
            position_ids=fw.pos.to(device, non_blocking=True),
            past_key_values=cache,
            use_cache=True,
            sbd_plan=plan,
            logits_to_keep=T - fw.first,
        ).logits


def _gather_rows(logits: torch.Tensor, fw: _Forward, rows: torch.Tensor) -> torch.Tensor:
    """Logits of absolute forward rows ``rows`` [B, R] (logits hold rows [fw.first, T)) -> [B, R, V] copy; rows
    outside are clamped (their values are never used)."""
    rows = (rows - fw.first).clamp_(0, logits.shape[1] - 1).to(logits.device)
    return torch.gather(logits, 1, rows.unsqueeze(-1).expand(*rows.shape, logits.shape[2]))


def _reveal_ntp(logits: torch.Tensor, fw: _Forward, seqs: list[_Seq], job: _Job, f: int) -> None:
    """NTP mode: the next token of every sequence from its last committed row; one device-to-host read."""
    B, V = len(seqs), logits.shape[2]
    x = _gather_rows(logits, fw, (torch.tensor(fw.n_commit) - 1).view(B, 1)).view(B, V)
    keys = [position_key(b, q.block_start) for b, q in enumerate(seqs)]
    tok = sample_positions(x, job.temperature, job.seed, keys)[2].cpu()  # the one sync
    for b, q in enumerate(seqs):
        if not q.done:
            q.after_ntp_forward(f, int(tok[b]), b)


def _commit_row_choices(
    logits: torch.Tensor, fw: _Forward, seqs: list[_Seq], job: _Job, block: torch.Tensor
) -> tuple[torch.Tensor, list[int]]:
    """The NTP choice after each committed row that the drafts' check needs, rows [lo[b], c[b]) -> ([B, R], lo);
    the last committed row's choice is the token at the block's first position: written into ``block`` now."""
    B, V, device = len(seqs), logits.shape[2], logits.device
    live = [not q.done and c > 0 for q, c in zip(seqs, fw.n_commit, strict=True)]
    lo = [_first_row(q, c, job) if ok else 0 for q, c, ok in zip(seqs, fw.n_commit, live, strict=True)]
    R = max(1, max(c - lb for c, lb in zip(fw.n_commit, lo, strict=True)))
    rows = torch.tensor(lo).view(B, 1) + torch.arange(R).view(1, R)
    keys = [position_key(b, seqs[b].n_cached + r + 1) for b in range(B) for r in rows[b].tolist()]
    ntp = sample_positions(_gather_rows(logits, fw, rows).reshape(B * R, V), job.temperature, job.seed, keys)[2]
    ntp = ntp.view(B, R)
    last = torch.tensor([max(c - 1 - lb, 0) for c, lb in zip(fw.n_commit, lo, strict=True)], device=device)
    first_tok = ntp.gather(1, last.view(B, 1)).view(B)
    can = torch.tensor([ok and len(q.block) > 0 for q, ok in zip(seqs, live, strict=True)], device=device)
    can &= (first_tok >= 0) & (block[:, 0] == job.mask_id)
    block[:, 0] = torch.where(can, first_tok, block[:, 0])
    return ntp, lo


def _reveal(logits: torch.Tensor, fw: _Forward, seqs: list[_Seq], job: _Job, f: int) -> dict[int, int]:
    """Alg. 3, "reveal": sample every block position and reveal by the sampler rule in place (SBD; NTP mode: the
    next token); one device-to-host read; each sequence then advances (finished blocks move to the output, or in
    verify mode are checked first). Returns {batch row: committed rows to keep} for sequences whose drafts were
    corrected (the caller rolls their cache length back)."""
    if not job.sbd:
        _reveal_ntp(logits, fw, seqs, job, f)
        return {}
    B, K = len(seqs), job.block_size
    block = _block_tensor(seqs, [not q.done for q in seqs], job).to(logits.device)
    ntp, lo = _commit_row_choices(logits, fw, seqs, job, block) if job.first_from_ntp else (None, None)
    if fw.block_rows_only:
        x = logits  # [B, K, V]
    else:
        x = _gather_rows(logits, fw, torch.tensor(fw.n_commit).view(B, 1) + torch.arange(K).view(1, K))  # [B, K, V]
    keys = None
    if job.verify and job.temperature > 0:  # drafts drawn with the noise their checks will use
        keys = [position_key(b, seqs[b].block_start + j) for b in range(B) for j in range(K)]
    n_rev, n_rem = sample_block(
        x, block, job.mask_id, job.sampler, job.threshold, job.temperature, job.seed, f, keys=keys
    )[:2]
    parts = [n_rev.view(B, 1), n_rem.view(B, 1), block] + ([ntp] if job.verify else [])
    back = torch.cat(parts, dim=1).cpu()  # the one sync
    rollback = {}
    for b, q in enumerate(seqs):
        if q.done:
            continue
        ntp_b = None
        if job.verify:
            ntp_b = [None] * lo[b] + back[b, 2 + K :].tolist()[: fw.n_commit[b] - lo[b]]
        keep = q.after_sbd_forward(f, back[b, 2 : 2 + K].tolist(), int(back[b, 0]), int(back[b, 1]), b, ntp_b)
        if keep is not None:
            rollback[b] = keep
    return rollback


def _check_runnable(model) -> tuple[torch.device, torch.dtype]:
    device, dtype = _model_device_dtype(model)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"SBD decoding runs fp32, bf16 or fp16 models; this one is {dtype} (use model.to(torch.float32))"
        )
    if not kernel_available(device):
        raise RuntimeError(f"sbd_ext has no block_attention kernel for device {device} in this build")
    return device, dtype


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    settings: GenerationSettings | None = None,
    *,
    return_trace: bool = True,
    return_cache: bool = False,
    **overrides,
) -> SBDGenerateOutput:
    """SBD generation with the exact KV cache (see the module docstring); ``mode="ntp"`` for next-token decoding.

    Args:
        model: a HuggingFace causal LM (Llama family) in eval mode; switched to attn_implementation="sbd" for good
            if it was loaded with another one (see :func:`_use_sbd_attention`).
        input_ids: [B, P] int token ids on the model's device.
        attention_mask: [B, P] 0/1 (or bool), one contiguous run of 1s per row (left or right padding); ragged
            prompts are re-packed per sequence. None: no padding.
        settings: a :class:`GenerationSettings`; ``**overrides`` are its fields by keyword (``block_size=8``,
            ``sampler="eb"``, ``threshold=0.1``, ``temperature``, ``seed``, ``max_new_tokens``, ``eos_token_id``,
            ``stop_token_ids``, ``pad_token_id``, ``mode``, ``strict_block_size``) applied on top of it.
        return_trace: fill ``trace``. return_cache: also return the SBDCache (as ``past_key_values``).
    Returns:
        SBDGenerateOutput.
    """
    families.check_model(model)  # an unsupported family or attention feature fails before any work
    job = _job(model, input_ids, attention_mask, GenerationSettings.of(settings, **overrides))
    device, dtype = _check_runnable(model)
    _use_sbd_attention(model)
    seqs = [_Seq(p, job) for p in job.prompts]
    rows = max(map(len, job.prompts)) + job.max_new_tokens
    if not job.settings.compile:
        cache = SBDCache(model.config, len(seqs), rows, dtype, device)
        _decode(seqs, job, cache, functools.partial(_run_forward, model, cache, device=device))
    else:
        pooled = device.type == "cuda" and not return_cache  # a returned cache must not be reused
        pool = _pooled_cache(model, len(seqs), rows, dtype, device) if pooled else contextlib.nullcontext()
        with _COMPILED_RUN_LOCK, pool as cache:
            cache = cache or SBDCache(model.config, len(seqs), rows, dtype, device)
            _decode_compiled(model, cache, seqs, job, device)
    return _finish(seqs, job, input_ids.device, return_trace, cache if return_cache else None)


# Compiled generations run one at a time: the step skips dynamo's guard evaluation after a generation's first call
# (torch.compiler.set_stance(skip_guard_eval_unsafe=True)), and that stance is process-global, so a second thread's
# first call -- a new model, batch size or k -- would run under it and could pick another generation's graph.
# Eager generations are not affected and stay concurrent.
_COMPILED_RUN_LOCK = threading.Lock()


def _decode_compiled(model, cache: SBDCache, seqs: list[_Seq], job: _Job, device: torch.device) -> None:
    """Under _COMPILED_RUN_LOCK (taken by generate)."""
    step = _StaticStep(model, cache, job, device)
    f = 0
    if not step.dynamic_rows:  # the prefill (the prompt's length) is eager unless the step takes any row count
        f = _decode(seqs, job, cache, functools.partial(_run_forward, model, cache, device=device), max_forwards=1)
    with cache.static_forwards():
        _decode(seqs, job, cache, step, f)
    if device.type == "cuda":
        ops.check_cuda_errors()  # the graph replays skip the binding that raises the kernel's length errors


def _decode(seqs: list[_Seq], job: _Job, cache: SBDCache, run, f: int = 0, max_forwards: int | None = None) -> int:
    """Alg. 3's loop from forward ``f`` until every sequence is done (or ``max_forwards`` forwards); ``run(fw)`` is
    one forward over the cache (eager or the static step) returning its logits. Returns the next forward index."""
    end = math.inf if max_forwards is None else f + max_forwards
    while f < end and not all(q.done for q in seqs):
        fw = _next_forward(seqs, job, getattr(run, "widen", None))  # commit the finished block + fill the current one
        lengths = list(cache.seq_lens)
        logits = run(fw)
        rollback = _reveal(logits, fw, seqs, job, f)  # reveal; finished blocks move to the output (or are checked)
        for b, keep in rollback.items():  # verify: rows after a correction are overwritten later
            cache.rollback(b, lengths[b] + keep)
        f += 1
    return f


# --------------------------------------------------------------------------------------------------------
# the static decode step (compile=True)
# --------------------------------------------------------------------------------------------------------
def _static_forward(model, cache: SBDCache, tokens: torch.Tensor, meta: torch.Tensor, block_rows: int) -> torch.Tensor:
    """One forward of the static step, traced by torch.compile (fullgraph): nothing here reads a host length.

    tokens: [2, B, T] int64, the input ids and the position ids; meta: [3, B] int32, per sequence the cache length,
    committed rows and valid rows. Runs the decoder and the output head; with ``block_rows`` > 0 only each
    sequence's block rows [n_commit, n_commit + block_rows) reach the head (the head is the costliest matmul of a
    small model with a large vocabulary). Returns logits [B, block_rows or T, V].
    """
    B = tokens.shape[1]
    plan = cache.device_plan(meta[0], meta[1], meta[2])
    hidden = model.get_decoder()(
        input_ids=tokens[0], position_ids=tokens[1], past_key_values=cache, use_cache=True, sbd_plan=plan
    ).last_hidden_state
    plan.check_layers()
    if block_rows:
        rows = meta[1].long().view(B, 1) + torch.arange(block_rows, device=meta.device).view(1, block_rows)
        # A shortened last block (budget) or a finished sequence reads past its rows: clamped, never used.
        rows = rows.clamp(max=tokens.shape[2] - 1)
        hidden = torch.gather(hidden, 1, rows.unsqueeze(-1).expand(B, block_rows, hidden.shape[-1]))
    return families.lm_logits(model, hidden)  # the head as the model's forward applies it (final soft-capping)


_COMPILED: dict[str, object] = {}
_COMPILE_LOCK = threading.Lock()


def _compiled_forward(device: torch.device):
    """torch.compile of :func:`_static_forward`, one per device type. On CUDA mode "reduce-overhead" captures each
    forward as a CUDA graph and replays it (the cache buffers are marked static, so they are written in place, not
    copied in). dynamic=False: B and T are specialised (one graph per batch size and k);
    the cache's row count is marked dynamic by :meth:`SBDCache.static_forwards`, so prompt lengths and budgets do
    not recompile."""
    # CUDA: "reduce-overhead" (CUDA graphs). CPU: a C++ wrapper instead of the Python one that calls each kernel
    # (~150 calls per forward of the embedded model, ~1 ms); the kernels themselves are the same.
    kw = {"mode": "reduce-overhead"} if device.type == "cuda" else {"options": {"cpp_wrapper": True}}
    with _COMPILE_LOCK:
        if device.type not in _COMPILED:
            _COMPILED[device.type] = torch.compile(_static_forward, fullgraph=True, dynamic=False, **kw)
        return _COMPILED[device.type]


_CACHE_POOL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: [cache, leased]}


@contextlib.contextmanager
def _pooled_cache(model, batch_size: int, rows: int, dtype: torch.dtype, device: torch.device):
    """Lease an SBDCache reused across generations of ``model`` with this batch size (CUDA graphs): the graphs read
    and write the cache buffers at fixed addresses, and a new buffer makes CUDA-graph trees re-record (after 128
    re-records they stop using graphs for the function). Grown to a power of two when too short; a fresh,
    unpooled cache while the pooled one is leased (concurrent calls)."""
    key = (batch_size, dtype, str(device))
    with _COMPILE_LOCK:
        pool = _CACHE_POOL.setdefault(model, {})
        entry = pool.get(key)
        if entry is not None and entry[1]:
            entry = [SBDCache(model.config, batch_size, rows, dtype, device), True]  # not pooled
        else:
            if entry is None or entry[0].max_cache_len < rows:
                entry = pool[key] = [SBDCache(model.config, batch_size, 1 << (rows - 1).bit_length(), dtype, device)]
                entry.append(False)
            entry[1] = True
    entry[0].rewind()
    try:
        yield entry[0]
    finally:
        entry[1] = False


class _StaticStep:
    """The compiled forwards, with no host length read inside (the plan is device tensors) and shapes fixed by
    (B, k), so one graph serves every forward of every generation with that B and k.

    On CUDA: the forwards after the prefill, [B, 2k] rows in SBD mode (up to k committed rows padded to k, then the
    block: the prefill commits the prompt, so a later forward commits one finished block at most), [B, 1] in NTP
    mode; one CUDA graph, and at small batch the padding rows are nearly free (memory-bound). The prefill is eager.

    On the CPU a forward's cost grows with its rows (compute-bound: 16 rows cost ~2x 8 rows on the embedded model),
    so SBD forwards keep eager decoding's row count -- k + the committed rows -- and that count is marked dynamic:
    one graph for all of them, the prefill included (at least 2 rows: a size-1 dim would be specialised). NTP
    forwards are [B, 1] after an eager prefill.

    Called with a host :class:`_Forward`; validates its plan on the host, copies ids, positions and plan to the
    device, runs the compiled forward and advances the host lengths. The caller's read-back of the sampled block is
    the forward's one device-to-host copy."""

    def __init__(self, model, cache: SBDCache, job: _Job, device: torch.device):
        self.model, self.cache, self.device = model, cache, device
        self.dynamic_rows = job.sbd and device.type != "cuda"
        if not job.sbd:
            self.widen = lambda T: 1
        elif self.dynamic_rows:
            self.widen = lambda T: max(T, 2)
        else:
            self.widen = lambda T: 2 * job.block_size
        # Plain SBD reads only the block rows; verify / first_from_ntp also read committed rows: every row then.
        self.block_rows = job.block_size if job.sbd and not job.first_from_ntp else 0
        self.fn = _compiled_forward(device)
        self.calls = 0

    def __call__(self, fw: _Forward) -> torch.Tensor:
        n_commit, n_valid = self.cache.check_plan(fw.n_commit, fw.n_valid)
        tokens = torch.stack([fw.ids, fw.pos])
        meta = torch.tensor([self.cache.seq_lens, n_commit, n_valid], dtype=torch.int32)
        if self.device.type == "cuda":
            tokens = tokens.pin_memory().to(self.device, non_blocking=True)
            meta = meta.pin_memory().to(self.device, non_blocking=True)
            torch.compiler.cudagraph_mark_step_begin()  # the previous forward's logits are consumed
        if self.dynamic_rows:
            torch._dynamo.mark_dynamic(tokens, 2)
        # The first call of a generation checks every guard (model, config, cache, shapes); later calls only change
        # tensor contents and the (dynamic) row count, so they run only the guards that pick among compiled graphs.
        # dynamo's full check costs ~0.8 ms per call here (the model's every module and parameter).
        with torch.compiler.set_stance(skip_guard_eval_unsafe=self.calls > 0):
            logits = self.fn(self.model, self.cache, tokens, meta, self.block_rows)
        self.calls += 1
        self.cache.advance(n_commit)
        fw.block_rows_only = self.block_rows > 0
        return logits


# --------------------------------------------------------------------------------------------------------
# the no-cache reference decoder
# --------------------------------------------------------------------------------------------------------
@torch.no_grad()
def generate_reference(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    settings: GenerationSettings | None = None,
    *,
    return_trace: bool = True,
    **overrides,
) -> SBDGenerateOutput:
    """The no-cache reference decoder: every forward recomputes each sequence with a dense mask (sliding layers' with
    their window: :func:`sbd_ext.families.reference_mask`) through the model's own attention (SDPA/eager; the 'sbd'
    backend falls back to SDPA, or eager when soft-capping, for a 4D mask), one sequence at a time, and uses the
    pure-PyTorch reference samplers. Same arguments and outputs as :func:`generate` (no return_cache)."""
    families.check_model(model)
    s = _job(model, input_ids, attention_mask, GenerationSettings.of(settings, **overrides))
    if s.verify:
        raise ValueError("generate_reference has no verify mode: compare sbd_ext.generate(verify=True) with mode='ntp'")
    device, dtype = _model_device_dtype(model)
    B, K, V = len(s.prompts), s.block_size, s.vocab
    seqs = [_Seq(p, s) for p in s.prompts]
    sbd = s.mode == "sbd"
    f = 0
    while not all(q.done for q in seqs):
        active = [not q.done for q in seqs]
        x = torch.zeros(B, K if sbd else 1, V, dtype=torch.float32, device=device)
        for b, q in enumerate(seqs):
            if not active[b]:
                continue
            clean = q.prompt + q.gen
            toks = torch.tensor([clean + (q.block if sbd else [])], dtype=torch.int64, device=device)
            n = toks.shape[1]
            out = (
                model(
                    input_ids=toks,
                    attention_mask=families.reference_mask(
                        model.config, len(clean), len(q.block) if sbd else 0, dtype, device
                    ),
                    position_ids=torch.arange(n, device=device).view(1, n),
                    use_cache=False,
                )
                .logits[0]
                .float()
            )
            if sbd:
                x[b, : len(q.block)] = out[len(clean) :]
            else:
                x[b, 0] = out[len(clean) - 1]
        if sbd:
            block = _block_tensor(seqs, active, s)
            n_rev, n_rem = sample_block(
                x.cpu(), block, s.mask_id, s.sampler, s.threshold, s.temperature, s.seed, f, impl=reference
            )[:2]
            for b, q in enumerate(seqs):
                if active[b]:
                    q.after_sbd_forward(f, block[b].tolist(), int(n_rev[b]), int(n_rem[b]), b)
        else:
            keys = [position_key(b, q.block_start) for b, q in enumerate(seqs)]
            tok = sample_positions(x.view(B, V).cpu(), s.temperature, s.seed, keys, impl=reference)[2]
            for b, q in enumerate(seqs):
                if active[b]:
                    q.after_ntp_forward(f, int(tok[b]), b)
        f += 1
    return _finish(seqs, s, input_ids.device, return_trace)
