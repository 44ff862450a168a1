"""Set Block Decoding over a HuggingFace causal LM, with the exact KV cache of the paper's Alg. 3.

Public API
----------
* :func:`generate` -- SBD (or NTP) generation through :class:`SBDCache` and the sbd_ext kernels.
* :func:`generate_reference` -- the no-cache reference decoder (same arguments, outputs and random stream).
* :class:`GenerationSettings` -- every setting of a generation, validated once.
* :class:`SBDCache` / :class:`SBDForwardPlan` live in :mod:`sbd_ext.cache`, the SBD fields of a model config
  (``set_sbd_metadata`` / ``get_sbd_metadata``) in :mod:`sbd_ext.metadata`, the sampler names and default
  thresholds in :mod:`sbd_ext.samplers`; all are re-exported here.

Rooms (each imports only those above it)
----------------------------------------
``settings`` (GenerationSettings, the Job of one call, prompt checks) -> ``state`` (the per-sequence state
machine, the output) -> ``sampling`` (entropy_sample + mask_replace over a block) -> ``step`` (one forward: plan,
run, reveal; the DecodeStep interface, the eager step, the loop) -> ``compiled`` (the static step, its cache pool,
the locks) -> ``device_cycle`` (the whole cycle as tensor operations: ``cycle="device"``) -> ``device_loop`` (its
host side) -> ``api`` (:func:`generate`); ``nocache`` (:func:`generate_reference`) beside them.

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
  next-token head (output at t-1), argmax or a sample via ``entropy_sample``.
* The mask token is never generated, in either mode: its logit is set to -inf at every position (SBD blocks, NTP
  choices, verify checks, the reference decoder), so ``verify=True`` can equal ``mode="ntp"`` exactly.
* Verify mode spends a forward that commits nothing (a later forward of a block) only while the sequence has more
  verified tokens than forwards; otherwise it drafts the block's revealed prefix at once. Every other forward yields
  at least one verified token, so verify never takes more forwards than NTP decoding.
* The counts and block tokens are read back once per forward (one device-to-host copy) to decide block completion
  and stopping. A sequence that still has masked positions but revealed none (NaN logits) raises an error.
* :func:`generate` needs the ``"sbd"`` attention; a model set to another implementation is switched with
  ``model.set_attn_implementation("sbd")`` on its first call, for good (with a warning).
* Finished sequences stay in the batch as padding rows (``n_valid = 0``) until every sequence is done.
"""

from __future__ import annotations

from ..cache import SBDCache, SBDForwardPlan
from ..metadata import BLOCK_RANGE_ATTR, MASK_TOKEN_ATTR, get_sbd_metadata, set_sbd_metadata
from ..samplers import DEFAULT_THRESHOLDS
from ..samplers import NAMES as SAMPLERS
from .api import generate
from .nocache import generate_reference
from .output import SBDGenerateOutput
from .sampling import position_key, sample_block, sample_positions
from .settings import GenerationSettings

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
    "sample_positions",
    "position_key",
]

# Internal names of the single-file decoding.py and where they live now.
_MOVED = {
    "_Job": "settings.Job",
    "_job": "settings.make_job",
    "_prompts": "settings.check_prompts",
    "_model_device_dtype": "settings.model_device_dtype",
    "_Seq": "state.SequenceState",
    "_block_tensor": "state.block_tensor",
    "_finish": "output.finish",
    "_Forward": "step.ForwardRows",
    "_next_forward": "step.plan_forward",
    "_first_row": "step.first_row_read",
    "_run_forward": "step.EagerStep",
    "_gather_rows": "rows.gather_rows",
    "_reveal": "step.reveal",
    "_decode": "step.decode",
    "_StaticStep": "compiled.StaticStep",
    "_decode_compiled": "compiled.decode_compiled",
    "_pooled_cache": "compiled.pooled_cache",
    "_COMPILED_RUN_LOCK": "compiled.COMPILED_RUN_LOCK",
    "_use_sbd_attention": "api._use_sbd_attention",
    "_check_runnable": "api._check_runnable",
    "_dense_mask": "sbd_ext.families.reference_mask",
}


def __getattr__(name: str):
    if name in _MOVED:
        target = _MOVED[name] if _MOVED[name].startswith("sbd_ext.") else f"sbd_ext.decoding.{_MOVED[name]}"
        raise ImportError(
            f"sbd_ext.decoding.{name} is gone: decoding.py became the package sbd_ext.decoding; use {target}"
        )
    raise AttributeError(f"module 'sbd_ext.decoding' has no attribute {name!r}")
