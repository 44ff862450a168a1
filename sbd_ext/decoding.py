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
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from . import ops, reference
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
    """

    sequences: torch.Tensor | None = None
    prompt_lengths: torch.Tensor | None = None
    num_generated: torch.Tensor | None = None
    nfe: torch.Tensor | None = None
    tokens_per_forward: torch.Tensor | None = None
    trace: list | None = None
    past_key_values: SBDCache | None = None


# --------------------------------------------------------------------------------------------------------
# argument handling
# --------------------------------------------------------------------------------------------------------
@dataclass
class _Setup:
    prompts: list[list[int]]
    mode: str
    block_size: int
    sampler: str
    threshold: float
    temperature: float
    seed: int
    max_new_tokens: int
    stop_ids: frozenset
    pad_id: int
    mask_id: int | None
    vocab: int


def _as_id_list(x) -> list[int]:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.flatten().tolist()]
    if isinstance(x, int):
        return [x]
    return [int(v) for v in x]


def _model_device_dtype(model) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, (model.dtype if hasattr(model, "dtype") else p.dtype)


def _prepare(
    model,
    input_ids,
    attention_mask,
    *,
    block_size,
    sampler,
    threshold,
    temperature,
    seed,
    max_new_tokens,
    eos_token_id,
    stop_token_ids,
    pad_token_id,
    mode,
    strict_block_size,
) -> _Setup:
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError("model must be a HuggingFace PreTrainedModel (it has no .config)")
    cfg = config.get_text_config(decoder=True)
    device, _ = _model_device_dtype(model)
    vocab = int(cfg.vocab_size)

    if mode not in ("sbd", "ntp"):
        raise ValueError(f"mode must be 'sbd' or 'ntp', got {mode!r}")
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

    gen_cfg = getattr(model, "generation_config", None)
    if max_new_tokens is None:
        max_new_tokens = getattr(gen_cfg, "max_new_tokens", None)
        if max_new_tokens is None:
            max_len = getattr(gen_cfg, "max_length", None) or 20  # HF's default max_length
            max_new_tokens = max_len - max(len(p) for p in prompts)
            if max_new_tokens < 1:
                raise ValueError(
                    f"max_new_tokens not given and generation_config.max_length={max_len} leaves no room after the "
                    f"longest prompt ({max(len(p) for p in prompts)} tokens); pass max_new_tokens"
                )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    total = max(len(p) for p in prompts) + max_new_tokens
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if max_pos is not None and total > max_pos:
        raise ValueError(
            f"prompt ({max(len(p) for p in prompts)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
            f"model's max_position_embeddings = {max_pos}"
        )

    if eos_token_id is None:
        eos_token_id = getattr(gen_cfg, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(cfg, "eos_token_id", None)
    stop_ids = frozenset(_as_id_list(eos_token_id) + _as_id_list(stop_token_ids))
    if pad_token_id is None:
        pad_token_id = getattr(gen_cfg, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(cfg, "pad_token_id", None)
        if pad_token_id is None:
            eos_list = _as_id_list(eos_token_id)
            pad_token_id = eos_list[0] if eos_list else 0
    pad_token_id = int(pad_token_id)

    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    seed = int(seed)

    mask_id, block_range = get_sbd_metadata(config)
    if mode == "ntp":
        return _Setup(
            prompts,
            mode,
            1,
            "eb",
            0.0,
            float(temperature),
            seed,
            max_new_tokens,
            stop_ids,
            pad_token_id,
            mask_id,
            vocab,
        )

    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    if threshold is None:
        threshold = DEFAULT_THRESHOLDS[sampler]
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ValueError(f"threshold must be a finite number, got {threshold!r}")
    if sampler in ("eb", "entropy") and threshold < 0:
        raise ValueError(f"threshold (gamma) of the {sampler!r} sampler must be >= 0, got {threshold}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if mask_id is None:
        raise ValueError(
            f"the model config has no `{MASK_TOKEN_ATTR}`: it was not trained for SBD (or its SBD metadata was not "
            f"saved). Set it with sbd_ext.decoding.set_sbd_metadata(model.config, mask_token_id=...), or use mode='ntp'"
        )
    if not 0 <= mask_id < vocab:
        raise ValueError(f"config.{MASK_TOKEN_ATTR} = {mask_id} is not a token id in [0, vocab_size={vocab})")
    if block_range is not None and strict_block_size and not block_range[0] <= block_size <= block_range[1]:
        raise ValueError(
            f"block_size={block_size} is outside the block sizes the model was trained with "
            f"(config.{BLOCK_RANGE_ATTR} = [{block_range[0]}, {block_range[1]}]); pass strict_block_size=False to "
            f"decode with it anyway"
        )
    return _Setup(
        prompts,
        mode,
        block_size,
        sampler,
        float(threshold),
        float(temperature),
        seed,
        max_new_tokens,
        stop_ids,
        pad_token_id,
        mask_id,
        vocab,
    )


# --------------------------------------------------------------------------------------------------------
# per-sequence state machine, shared by the cached decoder and the reference
# --------------------------------------------------------------------------------------------------------
class _Seq:
    """Host-side state of one sequence: its tokens, the current block and the pending (uncommitted) tokens."""

    def __init__(self, prompt: list[int], s: _Setup):
        self.s = s
        self.prompt = prompt
        self.gen: list[int] = []  # generated tokens of finished blocks (the output)
        self.pending: list[int] = list(prompt)  # tokens in `prompt + gen` whose K/V are not cached yet
        self.block: list[int] = []  # the current block (mask ids where masked); SBD only
        self.done = False
        self.nfe = 0
        self.trace: list[tuple[int, list[int], list[int]]] = []
        if s.mode == "sbd":
            self._start_block()

    @property
    def n_cached(self) -> int:
        return len(self.prompt) + len(self.gen) - len(self.pending)

    @property
    def block_start(self) -> int:
        return len(self.prompt) + len(self.gen)

    def _start_block(self) -> None:
        k = min(self.s.block_size, self.s.max_new_tokens - len(self.gen))
        self.block = [self.s.mask_id] * k

    def after_sbd_forward(self, f: int, block: list[int], n_rev: int, n_rem: int, b: int) -> None:
        s, k = self.s, len(self.block)
        block = block[:k]
        self.nfe += 1
        if n_rem > 0 and n_rev == 0:
            raise RuntimeError(
                f"SBD decoding: sequence {b} revealed no token at forward {f} although {n_rem} positions are masked: "
                f"every proposal was invalid (NaN or +inf logits, or all logits -inf once the mask token is banned)"
            )
        revealed = [j for j in range(k) if self.block[j] == s.mask_id and block[j] != s.mask_id]
        self.block = block
        self.pending = []
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
            return
        if keep < k:
            # Stopped at a stop token: drop the positions after it from this block's trace entries too.
            end = start + keep
            self.trace = [
                (g, [p for p in pos if p < end], [t for p, t in zip(pos, tok, strict=True) if p < end])
                for g, pos, tok in self.trace
            ]
        self.gen.extend(block[:keep])
        if stopped or len(self.gen) >= s.max_new_tokens:
            self.done = True
            self.block = []
            return
        self.pending = block
        self._start_block()

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


def _block_tensor(seqs: list[_Seq], active: list[bool], s: _Setup) -> torch.Tensor:
    """[B, block_size] int64 on the CPU: each active sequence's block, then a filler that is not the mask id."""
    fill = s.pad_id if s.pad_id != s.mask_id else (0 if s.mask_id != 0 else 1)
    block = torch.full((len(seqs), s.block_size), fill, dtype=torch.int64)
    for b, q in enumerate(seqs):
        if active[b] and q.block:
            block[b, : len(q.block)] = torch.tensor(q.block, dtype=torch.int64)
    return block


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One SBD sampling step: reveal masked positions of ``block`` in place.

    Args:
        logits: [B, K, V] the block positions' logits (read at the positions themselves). Modified: the mask
            token's logit is set to -inf (it is never proposed).
        block: [B, K] int64 block tokens, ``mask_id`` where masked, on logits' device. Modified in place.
        sampler, threshold: the mask_replace rule and its gamma / tau.
        temperature, seed, offset: entropy_sample's; position j of row b draws Philox row ``b * K + j``.
        impl: :mod:`sbd_ext.ops` (kernels) or :mod:`sbd_ext.reference`.
    Returns:
        (n_revealed [B], n_remaining [B], entropy [B, K], max_prob [B, K], proposals [B, K]).
    """
    B, K, V = logits.shape
    logits[..., mask_id] = float("-inf")
    ent, pmax, tok = impl.entropy_sample(logits.reshape(B * K, V), temperature, seed, offset)
    ent, pmax, tok = ent.view(B, K), pmax.view(B, K), tok.view(B, K)
    n_rev, n_rem = impl.mask_replace(block, tok, ent, pmax, mask_id, sampler, threshold)
    return n_rev, n_rem, ent, pmax, tok


def _finish(seqs: list[_Seq], s: _Setup, device, return_trace: bool, cache=None) -> SBDGenerateOutput:
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
    )


@contextlib.contextmanager
def _sbd_attention(model):
    """Run the model with attn_implementation="sbd" (switching with set_attn_implementation and back if needed)."""
    prev = model.config._attn_implementation
    if prev == ATTN_IMPLEMENTATION:
        yield
        return
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise RuntimeError(
                f"could not switch {type(model).__name__} to attn_implementation={ATTN_IMPLEMENTATION!r}; load it with "
                f"from_pretrained(..., attn_implementation={ATTN_IMPLEMENTATION!r})"
            )
        yield
    finally:
        model.set_attn_implementation(prev)


# --------------------------------------------------------------------------------------------------------
# the cached decoder
# --------------------------------------------------------------------------------------------------------
_COMMON_DOC = """
    Args:
        model: a HuggingFace causal LM (Llama family) in eval mode.
        input_ids: [B, P] int token ids on the model's device.
        attention_mask: [B, P] 0/1 (or bool), one contiguous run of 1s per row (left or right padding); ragged
            prompts are re-packed per sequence. None: no padding.
        block_size: k, the set-block size (SBD mode).
        sampler: "eb" (entropy-bounded, paper Eq. 8), "entropy" (entropy threshold) or "confidence".
        threshold: gamma for "eb"/"entropy", tau for "confidence"; default DEFAULT_THRESHOLDS[sampler].
        temperature: 0 -> argmax; > 0 -> sample from softmax(logits / temperature) (Gumbel-max, Philox).
        seed: the Philox seed; forward f uses offset f.
        max_new_tokens: generated tokens per sequence at most; default from model.generation_config
            (max_new_tokens, else max_length - longest prompt).
        eos_token_id: int or list; default generation_config.eos_token_id, else config.eos_token_id. [] disables.
        stop_token_ids: more ids that stop a sequence like EOS.
        pad_token_id: fills ``sequences``; default generation_config / config pad id, else the first EOS id, else 0.
        mode: "sbd" or "ntp" (next-token prediction through the same cache and kernels).
        return_trace: fill ``trace``.
        strict_block_size: refuse a block size outside config.sbd_block_size_range.
    Returns:
        SBDGenerateOutput.
"""


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    block_size: int = 16,
    sampler: str = "eb",
    threshold: float | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    max_new_tokens: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    pad_token_id: int | None = None,
    mode: str = "sbd",
    return_trace: bool = True,
    return_cache: bool = False,
    strict_block_size: bool = True,
) -> SBDGenerateOutput:
    s = _prepare(
        model,
        input_ids,
        attention_mask,
        block_size=block_size,
        sampler=sampler,
        threshold=threshold,
        temperature=temperature,
        seed=seed,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        stop_token_ids=stop_token_ids,
        pad_token_id=pad_token_id,
        mode=mode,
        strict_block_size=strict_block_size,
    )
    device, dtype = _model_device_dtype(model)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"SBD decoding runs fp32, bf16 or fp16 models; this one is {dtype} (use model.to(torch.float32))"
        )
    if not kernel_available(device):
        raise RuntimeError(f"sbd_ext has no block_attention kernel for device {device} in this build")
    B, K = len(s.prompts), s.block_size
    seqs = [_Seq(p, s) for p in s.prompts]
    cache = SBDCache(model.config, B, max(len(p) for p in s.prompts) + s.max_new_tokens, dtype, device)
    sbd = s.mode == "sbd"
    with _sbd_attention(model):
        f = 0
        while not all(q.done for q in seqs):
            active = [not q.done for q in seqs]
            n_commit = [len(q.pending) if a else 0 for q, a in zip(seqs, active, strict=True)]
            n_block = [len(q.block) if (a and sbd) else 0 for q, a in zip(seqs, active, strict=True)]
            n_valid = [c + k for c, k in zip(n_commit, n_block, strict=True)]
            T = max(n_valid)
            ids = torch.zeros(B, T, dtype=torch.int64)
            pos = torch.zeros(B, T, dtype=torch.int64)  # padding rows at position 0: never widens a dynamic RoPE
            for b, q in enumerate(seqs):
                if active[b]:
                    ids[b, : n_valid[b]] = torch.tensor(q.pending + (q.block if sbd else []), dtype=torch.int64)
                    pos[b, : n_valid[b]] = torch.arange(q.n_cached, q.n_cached + n_valid[b])
            # Rows read: SBD, block rows [c, c+k) of each sequence; NTP, row c-1. Keep only the logits from the
            # first row any sequence needs (the lm_head over a long prompt is skipped).
            first = min((c if sbd else c - 1) for c, a in zip(n_commit, active, strict=True) if a)
            with cache.forward_plan(n_commit, n_valid) as plan:
                logits = model(
                    input_ids=ids.to(device, non_blocking=True),
                    position_ids=pos.to(device, non_blocking=True),
                    past_key_values=cache,
                    use_cache=True,
                    sbd_plan=plan,
                    logits_to_keep=T - first,
                ).logits  # [B, T - first, V]
            if sbd:
                rows = torch.tensor(n_commit).view(B, 1) + torch.arange(K).view(1, K) - first
                rows = rows.clamp_(0, T - first - 1).to(device)  # [B, K]; rows of absent positions are not used
                x = torch.gather(logits, 1, rows.unsqueeze(-1).expand(B, K, logits.shape[-1]))  # [B, K, V] copy
                block = _block_tensor(seqs, active, s).to(device)
                n_rev, n_rem = sample_block(x, block, s.mask_id, s.sampler, s.threshold, s.temperature, s.seed, f)[:2]
                back = torch.cat([n_rev.view(B, 1), n_rem.view(B, 1), block], dim=1).cpu()  # the one sync
                for b, q in enumerate(seqs):
                    if active[b]:
                        q.after_sbd_forward(f, back[b, 2:].tolist(), int(back[b, 0]), int(back[b, 1]), b)
            else:
                rows = (torch.tensor(n_commit) - 1 - first).clamp_(0, T - first - 1).to(device)
                x = logits[torch.arange(B, device=device), rows]  # [B, V]
                _, _, tok = ops.entropy_sample(x, s.temperature, s.seed, f)
                tok = tok.cpu()
                for b, q in enumerate(seqs):
                    if active[b]:
                        q.after_ntp_forward(f, int(tok[b]), b)
            f += 1
    return _finish(seqs, s, input_ids.device, return_trace, cache if return_cache else None)


# --------------------------------------------------------------------------------------------------------
# the no-cache reference decoder
# --------------------------------------------------------------------------------------------------------
def _dense_mask(n_clean: int, n_block: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive [1, 1, n, n] mask (0 = attend, finfo.min = not): clean rows causal, block rows see the clean prefix
    and the whole block. Additive so that it means the same to the eager, SDPA and sbd (fallback) attentions."""
    n = n_clean + n_block
    i = torch.arange(n, device=device).view(n, 1)
    j = torch.arange(n, device=device).view(1, n)
    allowed = (j <= i) | ((i >= n_clean) & (j >= n_clean))
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min).view(1, 1, n, n)


@torch.no_grad()
def generate_reference(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    block_size: int = 16,
    sampler: str = "eb",
    threshold: float | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    max_new_tokens: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    pad_token_id: int | None = None,
    mode: str = "sbd",
    return_trace: bool = True,
    strict_block_size: bool = True,
) -> SBDGenerateOutput:
    s = _prepare(
        model,
        input_ids,
        attention_mask,
        block_size=block_size,
        sampler=sampler,
        threshold=threshold,
        temperature=temperature,
        seed=seed,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        stop_token_ids=stop_token_ids,
        pad_token_id=pad_token_id,
        mode=mode,
        strict_block_size=strict_block_size,
    )
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
                    attention_mask=_dense_mask(len(clean), len(q.block) if sbd else 0, dtype, device),
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
            _, _, tok = reference.entropy_sample(x.view(B, V).cpu(), s.temperature, s.seed, f)
            for b, q in enumerate(seqs):
                if active[b]:
                    q.after_ntp_forward(f, int(tok[b]), b)
        f += 1
    return _finish(seqs, s, input_ids.device, return_trace)


generate.__doc__ = (
    "SBD generation with the exact KV cache (see the module docstring); mode='ntp' for next-token decoding.\n"
    + _COMMON_DOC
    + "        return_cache: also return the SBDCache (as ``past_key_values``).\n"
)
generate_reference.__doc__ = (
    "The no-cache reference decoder: every forward recomputes each sequence with a dense mask through the model's\n"
    "own attention (SDPA/eager; the 'sbd' backend falls back to SDPA for a 4D mask), one sequence at a time, and uses\n"
    "the pure-PyTorch reference samplers. Same arguments and outputs as generate (no return_cache).\n" + _COMMON_DOC
)
