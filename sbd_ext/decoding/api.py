"""``sbd_ext.generate``: SBD (or NTP) generation through :class:`~sbd_ext.cache.SBDCache` and the sbd_ext
kernels, eager or compiled."""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch

from .. import families
from ..cache import SBDCache
from ..greedy_head import greedy_exclude, greedy_head
from ..hf import ATTN_IMPLEMENTATION, CUDA_HEAD_DIMS, kernel_available
from ..linear import ensure_row_linear
from .compiled import COMPILED_RUN_LOCK, decode_compiled, pooled_cache
from .device_loop import decode_device
from .gen_config import resolve_settings
from .output import SBDGenerateOutput, finish
from .settings import GenerationSettings, make_job, model_device_dtype
from .state import SequenceState
from .step import EagerStep, TwoForwardStep, decode
from .streaming import FinalTokensCallback, StreamingState

__all__ = ["generate"]


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    settings: GenerationSettings | None = None,
    *,
    return_trace: bool = True,
    return_cache: bool = False,
    on_final_tokens: FinalTokensCallback | None = None,
    step_cls: type[EagerStep] = EagerStep,
    **overrides,
) -> SBDGenerateOutput:
    """Generate with Set Block Decoding over the exact KV cache of the paper's Alg. 3 (``mode="ntp"``: next-token
    decoding through the same cache and kernels). See :mod:`sbd_ext.decoding` for the algorithm.

    Args:
        model: a HuggingFace causal LM (Llama family) in eval mode, fp32 / bf16 / fp16. It must run the ``"sbd"``
            attention: a model loaded with another ``attn_implementation`` is switched to ``"sbd"`` with
            ``model.set_attn_implementation("sbd")`` on the first call, permanently (not switched back: another
            thread may be using the model), with a warning; ordinary forwards give the same results after it.
            An fp32 CPU model's plain ``nn.Linear`` layers are switched to :class:`sbd_ext.linear.RowLinear` on
            the first call (the same layers and weights; forwards of at most 32 rows run the row_linear kernel,
            equal to ``F.linear`` to fp32 rounding); ``sbd_ext.linear.use_row_linear(model, False)`` undoes it
            and keeps it off.
        input_ids: [B, P] int token ids on the model's device.
        attention_mask: [B, P] 0/1 (or bool), one contiguous run of 1s per row (left or right padding); ragged
            prompts are re-packed per sequence. None: no padding.
        settings: a :class:`GenerationSettings`; None: the ``sbd_*`` fields of ``model.generation_config``
            (``sbd_block_size``, ``sbd_sampler``, ``sbd_threshold``, ``sbd_verify``, ``sbd_mode``:
            :mod:`sbd_ext.decoding.gen_config`) over the defaults. ``**overrides`` are its fields by keyword,
            applied on top of it (an explicit ``mode="ntp"`` drops the recommended SBD-only ``verify`` / ``lookup``
            / ``branch``):

            - ``mode``: "sbd" or "ntp";
            - ``block_size`` (k), ``strict_block_size`` (refuse a k outside the model's trained range);
            - ``sampler`` ("eb", "entropy", "confidence": :mod:`sbd_ext.samplers`), ``threshold`` (gamma / tau);
            - ``temperature`` (0: argmax), ``seed`` (the Philox stream);
            - ``max_new_tokens``, ``eos_token_id``, ``stop_token_ids``, ``pad_token_id`` (None: the model's
              generation_config / config);
            - ``verify``: lossless SBD -- each revealed block is checked against the next-token choices of the
              forward that commits it; the output equals ``mode="ntp"``'s exactly, in never more forwards;
            - ``first_from_ntp``: a block's first position is revealed from the next-token choice of the last
              committed row (always on with ``verify``);
            - ``compile``: the forwards after the prefill run with static shapes under
              ``torch.compile(fullgraph=True)`` (CUDA graphs on CUDA); same tokens as eager decoding. Compiled
              generations run one at a time in a process (eager ones stay concurrent).
            - ``cycle``: "host" or "device" (the whole decoding cycle as tensor operations on the model's device:
              one graph per cycle with ``compile``; greedy, no lookup / branch / alternates, no trace;
              :mod:`sbd_ext.decoding.device_cycle`).
        The mask token (``config.mask_token_id``) is never generated, in any mode: its logit is excluded at every
        position.
        return_trace: fill ``trace``. return_cache: also return the SBDCache (as ``past_key_values``).
        on_final_tokens: ``f(batch_row, token_ids)``, called after each forward with each sequence's newly final
            generated tokens, in order (streaming; :mod:`sbd_ext.decoding.streaming`). Their concatenation per row
            is that row's generated tokens.
        step_cls: the eager step (:mod:`sbd_ext.decoding.step`); ``TwoForwardStep`` is the two-forwards-per-cycle
            ablation (commit rows, then block rows: same tokens, more forwards). Not used with ``compile``.
    Returns:
        SBDGenerateOutput.
    """
    families.check_model(model)  # an unsupported family or attention feature fails before any work
    job = make_job(model, input_ids, attention_mask, resolve_settings(model, settings, overrides))
    device, dtype = _check_runnable(model)
    if job.branch_rows and issubclass(step_cls, TwoForwardStep):
        raise ValueError("branch=True drafts the branch in the fused forward; the two-forward ablation has no branch")
    on_device = job.settings.cycle == "device"
    if on_device and step_cls is not EagerStep:
        raise ValueError("cycle='device' runs its own forwards; step_cls applies to cycle='host'")
    return_trace = return_trace and not on_device  # the device cycle records no trace
    _use_sbd_attention(model)
    ensure_row_linear(model, device, dtype)  # fp32 CPU: the few-row linear kernel (sbd_ext.linear)
    if on_final_tokens is None:
        seqs = [SequenceState(prompt, job) for prompt in job.prompts]
    else:
        seqs = [StreamingState(prompt, job, b, on_final_tokens) for b, prompt in enumerate(job.prompts)]
    rows = max(map(len, job.prompts)) + job.max_new_tokens
    # greedy next-token / verify decoding: a packed fp32 head's choice at a bf16 head's bytes (sbd_ext.greedy_head)
    with greedy_head(greedy_exclude(job)):
        if not job.settings.compile:
            cache = SBDCache(model.config, len(seqs), rows, dtype, device)
            if on_device:
                decode_device(model, cache, seqs, job, device, compiled=False)
            else:
                decode(seqs, job, step_cls(model, cache, device))
        else:
            pooled = device.type == "cuda" and not return_cache  # a returned cache must not be reused
            pool = pooled_cache(model, len(seqs), rows, dtype, device) if pooled else contextlib.nullcontext()
            with COMPILED_RUN_LOCK, pool as cache:
                cache = cache or SBDCache(model.config, len(seqs), rows, dtype, device)
                if on_device:
                    decode_device(model, cache, seqs, job, device, compiled=True)
                else:
                    decode_compiled(model, cache, seqs, job, device)
    return finish(seqs, job, input_ids.device, return_trace, cache if return_cache else None)


def _check_runnable(model) -> tuple[torch.device, torch.dtype]:
    """The model's device and dtype, refused when no kernel runs them."""
    device, dtype = model_device_dtype(model)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"SBD decoding runs fp32, bf16 or fp16 models; this one is {dtype} (use model.to(torch.float32))"
        )
    if not kernel_available(device):
        raise RuntimeError(f"sbd_ext has no block_attention kernel for device {device} in this build")
    head_dim = families.head_dim(model.config)
    if not kernel_available(device, head_dim):
        raise ValueError(
            f"sbd_ext's CUDA block_attention kernels support head dims {', '.join(map(str, CUDA_HEAD_DIMS))}; this "
            f"model's is {head_dim}. SBD decoding of it runs on the CPU (model.to('cpu')); its ordinary forwards "
            "on CUDA fall back to SDPA."
        )
    return device, dtype


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
