"""``model.generate`` with Set Block Decoding: transformers' generate arguments mapped onto :func:`sbd_ext.generate`.

Settings flow (highest first): explicit ``sbd_*`` keywords of the call > the per-call ``generation_config`` >
``model.generation_config`` (``generation_config.json``) > the :class:`~sbd_ext.GenerationSettings` defaults, for
the SBD fields ``sbd_block_size``, ``sbd_sampler``, ``sbd_threshold``, ``sbd_verify``, ``sbd_mode`` (and
``sbd_seed``: the Philox seed; when unset, drawn from torch's default generator, so ``torch.manual_seed`` makes a
sampled call reproducible, as in HF). HF's own fields keep HF's meaning: ``do_sample=False`` -> greedy,
``temperature``, ``max_new_tokens`` / ``max_length``, ``eos_token_id``, ``pad_token_id`` (without
``attention_mask``, the pad id marks padding unless it is an EOS id, as in HF). What SBD cannot honour (beams, logits
processors, top-k / top-p / top-h, penalties, stop strings, ``max_time``, DoLa, token healing, ...) is refused with a
ValueError naming it, and so is an unknown ``sbd_*`` field. ``generation_config`` may be a dict of its fields.
Sampling draws from the full softmax(logits / temperature): HF's implicit top-k of 50 for an unset ``top_k`` does
not apply (an explicit one is refused).
"""

from __future__ import annotations

import copy
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..decoding.api import generate as sbd_generate
from ..decoding.gen_config import KNOWN_SBD_FIELDS, SBD_FIELDS, layered_settings, sbd_fields
from ..drafter import attach_from_checkpoint
from ..quantization import saveable_state_dict
from .hooks import (  # noqa: F401  (refuse_continuous_batching: called by checkpoints' custom_generate/generate.py)
    REQUEST_SAMPLES,
    end_stream_with_error,
    refuse_continuous_batching,
    sample_served_temperature,
    warn_next_token_generate,
)

__all__ = [
    "CUSTOM_GENERATE_DIR",
    "SBDGenerateDecoderOnlyOutput",
    "generate",
    "refuse_continuous_batching",
    "sample_served_temperature",
    "save_pretrained",
    "warn_next_token_generate",
]

logger = logging.getLogger(__name__)

# The folder that holds custom_generate/generate.py (package data): pass it as custom_generate=str(...).
CUSTOM_GENERATE_DIR = Path(__file__).resolve().parent

# Generation-config fields SBD cannot honour, with the value that means "off" (None is always off).
_REFUSED = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "penalty_alpha": None,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "force_words_ids": None,
    "min_length": 0,
    "min_new_tokens": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "guidance_scale": None,
    "watermarking_config": None,
    "stop_strings": None,
    "prompt_lookup_num_tokens": None,
    "constraints": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "max_time": None,
    "dola_layers": None,
    "token_healing": False,
    "output_scores": False,
    "output_logits": False,
    "output_attentions": False,
    "output_hidden_states": False,
}
# Sampling filters: refused only when sampling (greedy decoding ignores them, as HF does).
_SAMPLING_FILTERS = {
    "top_k": 0,
    "top_p": 1.0,
    "min_p": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
}
# generate() arguments with no meaning for SBD when given (HF passes them as None by default).
_REFUSED_ARGS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "assistant_model",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
)
# Keywords accepted and ignored: their HF meaning holds as is for SBD (use_cache: SBD always uses its cache).
_IGNORED = {"use_cache", "synced_gpus", "custom_generate", "tokenizer"}


@dataclass
class SBDGenerateDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """HF's decoder-only output (``sequences`` = prompt + generated tokens) plus SBD's counts, per sequence:
    ``nfe`` (model forwards), ``num_generated``, ``tokens_per_forward``."""

    nfe: torch.LongTensor | None = None
    num_generated: torch.LongTensor | None = None
    tokens_per_forward: torch.Tensor | None = None


_HF_DEFAULTS = (
    GenerationConfig()
)  # a field at its class default was not set by the user (versions where it is not None)


def _off(name: str, value, off) -> bool:
    if value is None or value == off or (isinstance(value, (list, tuple, dict)) and not value):
        return True
    return value == getattr(_HF_DEFAULTS, name, None)


def _call_config(model, generation_config, kwargs: dict) -> GenerationConfig:
    """The model's generation config, then the per-call one's set fields, then the call's HF keywords (which are
    removed from ``kwargs``)."""
    base = getattr(model, "generation_config", None)
    gc = copy.deepcopy(base) if base is not None else GenerationConfig()
    if generation_config is not None:
        for key, value in generation_config.to_diff_dict().items():
            setattr(gc, key, value)
    hf_keys = {k for k in kwargs if hasattr(_HF_DEFAULTS, k) or k in _REFUSED or k in _SAMPLING_FILTERS}
    for key in hf_keys:
        setattr(gc, key, kwargs.pop(key))
    if getattr(generation_config, REQUEST_SAMPLES, False):
        gc.do_sample = True  # a served request's temperature > 0 (see sample_served_temperature)
    return gc


def _refuse_unsupported(gc: GenerationConfig, args: dict, kwargs: dict) -> None:
    for name in _REFUSED_ARGS:
        value = args.get(name)
        if value is not None and not (isinstance(value, list) and not value):
            raise ValueError(f"SBD generate does not support `{name}` (got {type(value).__name__}); leave it unset")
    for name, off in _REFUSED.items():
        if not _off(name, getattr(gc, name, None), off):
            raise ValueError(
                f"SBD generate does not support generation_config.{name}={getattr(gc, name)!r}; leave it unset"
            )
    if gc.do_sample:
        for name, off in _SAMPLING_FILTERS.items():
            if not _off(name, getattr(gc, name, None), off):
                raise ValueError(
                    f"SBD sampling draws from softmax(logits / temperature) only; generation_config.{name}="
                    f"{getattr(gc, name)!r} is not supported (leave it unset, or use do_sample=False)"
                )
    unknown = sorted(set(kwargs) - _IGNORED - {"return_dict_in_generate"})
    unknown_sbd = [k for k in unknown if k.startswith("sbd_")]
    if unknown_sbd:
        raise ValueError(f"unknown SBD setting(s) {unknown_sbd}; the SBD fields are {sorted(KNOWN_SBD_FIELDS)}")
    if unknown:
        raise ValueError(f"SBD generate does not support the argument(s) {unknown}")


def _settings_fields(gc: GenerationConfig, explicit: dict, per_call, model, prompt_len: int) -> dict:
    """GenerationSettings fields from HF's fields of ``gc`` and the layered ``sbd_*`` fields."""
    fields = {}
    fields["temperature"] = float(gc.temperature if gc.temperature is not None else 1.0) if gc.do_sample else 0.0
    if gc.max_new_tokens is not None:
        fields["max_new_tokens"] = gc.max_new_tokens
    elif gc.max_length is not None:
        fields["max_new_tokens"] = max(gc.max_length - prompt_len, 1)
    _fit_positions(fields, model, prompt_len)
    # The call's own eos / pad ids (checked by sbd_ext.generate as the caller's); the model's own ones are left to
    # sbd_ext.generate, which takes them from the model as it does for any call (same answer, same errors).
    model_gc = getattr(model, "generation_config", None)
    for name in ("eos_token_id", "pad_token_id"):
        value = getattr(gc, name)
        if value is not None and (model_gc is None or value != getattr(model_gc, name, None)):
            fields[name] = value
    seed = explicit.pop("seed", None)
    seed = getattr(gc, "sbd_seed", None) if seed is None else seed
    if seed is None:  # HF sampling follows torch's global RNG: so does the Philox seed
        seed = int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)) if gc.do_sample else 0
    fields["seed"] = seed
    layers = [sbd_fields(per_call, "generation_config")] if per_call is not None else []
    layers.append(sbd_fields(getattr(model, "generation_config", None), "model.generation_config"))
    settings = layered_settings(explicit, *layers)
    fields.update({name: getattr(settings, name) for name in SBD_FIELDS.values()})
    return fields


def _fit_positions(fields: dict, model, prompt_len: int) -> None:
    """HF's ``max_new_tokens`` is a bound, and callers set it past a small model's positions (``transformers serve``
    asks for 1024 new tokens unless the request says otherwise): cut it to what the model's
    ``max_position_embeddings`` leaves after the prompt, with a warning. sbd_ext.generate itself refuses such a
    request; a prompt that alone fills the positions is still refused there."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config(decoder=True) if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    max_pos = getattr(cfg, "max_position_embeddings", None)
    want = fields.get("max_new_tokens")
    if max_pos is None or want is None or prompt_len + want <= max_pos or prompt_len >= max_pos:
        return
    fields["max_new_tokens"] = max_pos - prompt_len
    logger.warning(
        "max_new_tokens=%d: prompt (%d tokens) + max_new_tokens exceeds the model's max_position_embeddings (%d); "
        "generating at most %d tokens",
        want,
        prompt_len,
        max_pos,
        max_pos - prompt_len,
    )


def _inferred_attention_mask(input_ids: torch.Tensor, gc: GenerationConfig) -> torch.Tensor | None:
    """transformers' rule for a call without ``attention_mask``: when the pad id occurs in the inputs and is not an
    EOS id, the pads are padding (``input_ids != pad``); otherwise every position is a token (None)."""
    pad = gc.pad_token_id
    if pad is None or input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        return None
    eos = gc.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if pad in eos or not bool((input_ids == pad).any()):
        return None
    return input_ids.ne(pad).long()


def _hf_sequences(input_ids: torch.Tensor, out, pad_id: int) -> torch.Tensor:
    """HF's layout: each row's input (padding included) followed by its generated tokens, right-padded."""
    n_gen = out.num_generated.tolist()
    new = torch.full((input_ids.shape[0], max(n_gen)), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    for b, n in enumerate(n_gen):
        p = int(out.prompt_lengths[b])
        new[b, :n] = out.sequences[b, p : p + n]
    return torch.cat([input_ids, new], dim=1)


def _pad_id(model, fields: dict) -> int:
    """The pad id sbd_ext.generate fills with (its rule: the call's, generation config, config, first EOS id, 0)."""
    model_gc = getattr(model, "generation_config", None)
    pad = fields.get("pad_token_id", getattr(model_gc, "pad_token_id", None))
    pad = getattr(model.config, "pad_token_id", None) if pad is None else pad
    if pad is None:
        eos = fields.get("eos_token_id", getattr(model_gc, "eos_token_id", None))
        eos = getattr(model.config, "eos_token_id", None) if eos is None else eos
        pad = (eos[0] if isinstance(eos, (list, tuple)) and eos else eos) or 0
    return int(pad)


@torch.no_grad()
def generate(
    model,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    streamer=None,
    **kwargs,
):
    """transformers' ``generate`` arguments decoded by :func:`sbd_ext.generate` (see the module docstring).

    Returns a LongTensor [B, P + N] (the inputs as given, then the generated tokens, right-padded with the pad id),
    or with ``return_dict_in_generate=True`` an :class:`SBDGenerateDecoderOnlyOutput` that also carries the NFE.
    A ``streamer`` gets the prompt once (``put``), then each newly final run of tokens (shape (n,)) as soon as a
    forward makes it final, then ``end()``; like HF's streamers, batch 1 only (TextStreamer raises for more).
    """
    try:
        if isinstance(generation_config, dict):
            generation_config = GenerationConfig(**generation_config)
        elif generation_config is not None and not isinstance(generation_config, GenerationConfig):
            raise TypeError(
                f"generation_config must be a GenerationConfig or a dict of its fields, got "
                f"{type(generation_config).__name__}"
            )
        out = _generate(model, inputs, generation_config, streamer, kwargs)
    except BaseException as e:
        if streamer is not None:  # also on an error (a refused option too): a consumer must not wait forever
            end_stream_with_error(streamer, e)
        raise
    if streamer is not None:
        streamer.end()
    return out


def _generate(model, inputs, generation_config, streamer, kwargs: dict):
    attach_from_checkpoint(model)  # an exported checkpoint's gated drafter (sbd_drafter/), once
    args = {name: kwargs.pop(name, None) for name in _REFUSED_ARGS}
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError("SBD generate needs the prompt as `input_ids` (or `inputs`), a [batch, length] tensor")
    attention_mask = kwargs.pop("attention_mask", None)
    explicit = {name: kwargs.pop(attr) for attr, name in {**SBD_FIELDS, "sbd_seed": "seed"}.items() if attr in kwargs}
    gc = _call_config(model, generation_config, kwargs)
    _refuse_unsupported(gc, args, kwargs)
    return_dict = bool(kwargs.pop("return_dict_in_generate", None) or gc.return_dict_in_generate)
    fields = _settings_fields(gc, explicit, generation_config, model, input_ids.shape[-1])
    on_final = None
    if streamer is not None:
        streamer.put(input_ids.cpu())  # HF's streamers raise here for batch > 1 (TextStreamer)
        # 1-D, as HF's generate puts each step's tokens: streamers that iterate value.tolist() (transformers
        # serve's) then get token ids; TextStreamer takes either shape.
        on_final = lambda b, ids: streamer.put(torch.tensor(ids, dtype=torch.long))  # noqa: E731
    if attention_mask is None:
        attention_mask = _inferred_attention_mask(input_ids, gc)
    try:
        out = sbd_generate(model, input_ids, attention_mask, return_trace=False, on_final_tokens=on_final, **fields)
    except ValueError as e:
        if "pass strict_block_size=False" not in str(e):
            raise
        # model.generate's name for it: a keyword or a generation-config field
        raise ValueError(
            str(e).replace(
                "pass strict_block_size=False",
                "pass sbd_strict_block_size=False (a generate keyword or generation-config field)",
            )
        ) from e
    sequences = _hf_sequences(input_ids, out, _pad_id(model, fields))
    if not return_dict:
        return sequences
    return SBDGenerateDecoderOnlyOutput(
        sequences=sequences, nfe=out.nfe, num_generated=out.num_generated, tokens_per_forward=out.tokens_per_forward
    )


def save_pretrained(model, save_directory: str | Path, **kwargs) -> None:
    """``model.save_pretrained(save_directory, **kwargs)`` plus ``custom_generate/`` (generate.py +
    requirements.txt naming sbd_ext), so that ``from_pretrained(save_directory, trust_remote_code=True)`` gives a
    model whose ``generate`` decodes with SBD. The SBD settings to carry go on ``model.generation_config``
    (``sbd_block_size``, ...) before saving; a generation config built from the model config (transformers' default,
    ``_from_model_config``, which from_pretrained would rebuild from config.json, dropping every ``sbd_*`` field) is
    saved as the checkpoint's own. A quantized model: :func:`sbd_ext.quantization.saveable_state_dict` (packed weights
    saved unpacked; int8 / w8a8 refused before anything is written)."""
    kwargs["state_dict"] = saveable_state_dict(model, kwargs.get("state_dict"), "sbd_ext.integration.save_pretrained")
    gc = getattr(model, "generation_config", None)
    own = bool(getattr(gc, "_from_model_config", False)) and any(k.startswith("sbd_") for k in vars(gc))
    if own:
        gc._from_model_config = False
    try:
        model.save_pretrained(save_directory, **kwargs)
    finally:
        if own:
            gc._from_model_config = True
    dest = Path(save_directory) / "custom_generate"
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("generate.py", "requirements.txt"):
        shutil.copyfile(CUSTOM_GENERATE_DIR / "custom_generate" / name, dest / name)
