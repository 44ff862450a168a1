"""Generation settings: :class:`GenerationSettings` (validated once), and the :class:`Job` one call decodes -- the
settings resolved against the model (its defaults, SBD metadata and position limit) and the checked prompts."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch

from ..metadata import BLOCK_RANGE_ATTR, MASK_TOKEN_ATTR, get_sbd_metadata
from ..samplers import check_threshold, get_sampler

__all__ = ["GenerationSettings", "Job", "make_job", "check_prompts", "model_device_dtype"]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_ALTERNATES = 8  # runners-up of the first draft per forward (each 1 + k rows)
MAX_LOOKUP = 2**16  # drafts a lookup may propose per cycle (each is a committed row of the next forward)
MAX_BLOCK_SIZE = 2**16  # far above any trained block (SBD trains k <= 64); 2**16 x a 128k vocabulary = 32 GiB fp32


def _is_int(x) -> bool:
    """A Python or NumPy integer (not a bool): what the ops accept as an int."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and type(x).__name__ != "bool_"


def _is_number(x) -> bool:
    """A Python or NumPy real number (not a bool, a string or a tensor)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and type(x).__name__ != "bool_"


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
    return tuple(int(t) for t in ids)


@dataclass(frozen=True)
class GenerationSettings:
    """How :func:`generate` decodes: every field is validated once, at construction, whatever the mode.

    mode: "sbd" (set-block decoding) or "ntp" (one token per forward through the same cache and kernels).
    block_size: k, the set-block size (SBD). sampler: a name of the sampler registry (:mod:`sbd_ext.samplers`):
    "eb" (entropy-bounded, paper Eq. 8), "entropy" (entropy threshold) or "confidence". threshold: gamma for
    "eb"/"entropy" (>= 0), tau for "confidence"; None -> the registry's default (``DEFAULT_THRESHOLDS[sampler]``).
    temperature: 0 -> argmax; > 0 -> sample from softmax(logits / temperature) (Gumbel-max, Philox).
    seed: the Philox seed (an int64); forward f draws with offset f.
    max_new_tokens: generated tokens per sequence at most; None -> the model's generation_config (max_new_tokens,
    else max_length - longest prompt). eos_token_id: an int or ids; None -> generation_config / config EOS; ()
    disables. stop_token_ids: more ids that stop a sequence like EOS. pad_token_id: fills ``sequences``; None ->
    generation_config / config pad id, else the first EOS id, else 0. strict_block_size: refuse a k outside the
    model's trained ``sbd_block_size_range``. verify (SBD): lossless mode -- every revealed block is checked
    against the next-token choices its commit forward computes anyway; the output equals ``mode="ntp"``'s exactly,
    in at most as many forwards.
    first_from_ntp (SBD): reveal a block's first position from the next-token choice of the forward's last
    committed row (always done in verify mode) instead of from the block's own mask prediction. compile: every
    forward after the prefill runs with static shapes under ``torch.compile(fullgraph=True)`` (a CUDA graph on
    CUDA); same tokens as eager decoding (see :func:`generate`). lookup (verify): up to this many drafts per cycle
    from the context where it repeats itself (prompt lookup, as transformers' ``prompt_lookup_num_tokens``;
    :mod:`sbd_ext.decoding.lookup`): the tokens that followed the latest earlier occurrence of the text's final
    4, 3 or 2 tokens, else, where the model's drafter carries a draft store (``model.sbd_drafter.draft_store``), its
    chain of the tokens that most often followed such n-grams in the base's own answers. They take the block's
    later slots (the drafter's tokens stay where the lookup has none or the block is sure of its own) and
    may run past the block; a cycle proposes 4 at first, twice as many after a fully accepted proposal, 4 again
    after a rejected one (``sbd_ext.decoding.state.LOOKUP_START``); 0 (default): off. The output stays verify's,
    exactly. Outside verify mode it does nothing (unchecked drafts would change the output), so a checkpoint can
    recommend it next to ``sbd_verify`` and a call with ``verify=False`` still decodes plain SBD.
    branch (verify): each forward that checks drafts also drafts a second block behind the last verified token
    (the branch: its rows see the committed rows up to that token only), so that when the first draft is
    rejected the next cycle has drafts after the correction instead of none: one forward per cycle yields
    1 + a tokens at a first-draft acceptance rate a instead of 2 / (2 - a), for k more rows per forward. Same
    output as verify without it; like ``lookup``, it does nothing outside verify mode.
    alternates (verify with ``branch``): the drafter's next ``alternates`` most likely tokens for the first draft
    (its runners-up; 0: off), each checked in the same forward as a row of its own behind the last verified token
    (a base row: its next-token choice is exact) with a block of k rows behind it: when the first draft is rejected
    and the correction is one of them, the cycle keeps the correction, that row's next-token choice (a second
    verified token) and its block's drafts, instead of the branch's. ``1 + k`` more rows per forward each; same
    output as verify without it; without the branch (and outside verify mode) it does nothing.

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
    lookup: int = 0
    branch: bool = False
    alternates: int = 0
    cycle: str = "host"

    def __post_init__(self):
        set_ = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731  (frozen: normalise in place once)
        if self.mode not in ("sbd", "ntp"):
            raise ValueError(f"mode must be 'sbd' or 'ntp', got {self.mode!r}")
        if not _is_int(self.block_size) or not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(
                f"block_size must be an int in [1, {MAX_BLOCK_SIZE}] (a block's logits are block_size x vocab floats "
                f"per sequence), got {self.block_size!r}"
            )
        sampler = get_sampler(self.sampler, "sampler")
        threshold = sampler.default_threshold if self.threshold is None else self.threshold
        if not _is_number(threshold):  # a NumPy scalar or a tensor is not a setting
            raise ValueError(f"threshold must be a finite number, got {threshold!r}")
        set_("threshold", check_threshold(sampler.name, threshold, "GenerationSettings", finite=True))
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        set_("temperature", float(self.temperature))
        if not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise ValueError(f"seed must be an int in [-2**63, 2**63), got {self.seed!r}")
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        for name in ("block_size", "seed", "max_new_tokens", "pad_token_id"):  # NumPy integers -> int
            if _is_int(getattr(self, name)):
                set_(name, int(getattr(self, name)))
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
        if not isinstance(self.branch, bool):
            raise TypeError(f"branch must be a bool, got {self.branch!r}")
        if not _is_int(self.lookup) or not 0 <= self.lookup <= MAX_LOOKUP:
            raise ValueError(
                f"lookup must be an int in [0, {MAX_LOOKUP}] (drafts per cycle; 0: off), got {self.lookup!r}"
            )
        set_("lookup", int(self.lookup))
        if not _is_int(self.alternates) or not 0 <= self.alternates <= MAX_ALTERNATES:
            raise ValueError(
                f"alternates must be an int in [0, {MAX_ALTERNATES}] (the first draft's runners-up checked per "
                f"forward; 0: off), got {self.alternates!r}"
            )
        set_("alternates", int(self.alternates))
        if self.cycle not in ("host", "device"):
            raise ValueError(f"cycle must be 'host' or 'device', got {self.cycle!r}")
        if self.cycle == "device" and self.temperature != 0.0:
            raise ValueError(
                "cycle='device' decodes greedily (temperature=0); sampled decoding keys its noise by position on the "
                "host: use cycle='host'"
            )
        if self.cycle == "device" and self.verify and (self.lookup or self.branch):
            raise ValueError(
                "cycle='device' verifies the drafter's blocks without lookup or branch (their proposals are made on "
                "the host): pass lookup=0 and branch=False, or use cycle='host'"
            )
        if self.first_from_ntp and self.mode != "sbd":
            raise ValueError("first_from_ntp=True changes how SBD reveals a block; it needs mode='sbd'")
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
class Job:
    """One call's settings with the model's defaults filled in, plus what the model and the prompts decide."""

    settings: GenerationSettings  # threshold, max_new_tokens, eos_token_id and pad_token_id resolved
    prompts: list[list[int]]
    stop_ids: frozenset
    mask_id: int | None
    vocab: int
    # verify with a gated drafter that has a sampler head: (head, the input embedding's weight); see sbd_ext.drafter
    sampler_head: tuple | None = None
    # verify with lookup and a drafter that carries a draft store (sbd_ext.decoding.lookup.DraftStore): the lookup's
    # drafts where the context has none
    draft_store: object | None = None

    mode = property(lambda self: self.settings.mode)
    sbd = property(lambda self: self.settings.mode == "sbd")
    verify = property(lambda self: self.settings.verify)
    # The block's first position from the commit rows' NTP choice (always in verify mode, where it is verified).
    first_from_ntp = property(lambda self: self.settings.verify or self.settings.first_from_ntp)
    # The effective block: k, capped by the token budget (the buffers and the block's [B, k, V] logits follow it,
    # not a k far beyond what can be generated).
    block_size = property(
        lambda self: min(self.settings.block_size, self.settings.max_new_tokens) if self.settings.mode == "sbd" else 1
    )
    sampler = property(lambda self: self.settings.sampler)
    threshold = property(lambda self: self.settings.threshold)
    temperature = property(lambda self: self.settings.temperature)
    seed = property(lambda self: self.settings.seed)
    max_new_tokens = property(lambda self: self.settings.max_new_tokens)
    pad_id = property(lambda self: self.settings.pad_token_id)
    lookup = property(lambda self: self.settings.lookup)
    # A token id that is not the mask id: fills the block slots of sequences without a block (nothing is revealed).
    filler = property(lambda self: self.pad_id if self.pad_id != self.mask_id else (0 if self.mask_id != 0 else 1))
    # The branch's rows per forward (verify with ``branch``; 0: none): a block of the job's size.
    branch_rows = property(lambda self: self.block_size if self.settings.verify and self.settings.branch else 0)
    # The first draft's runners-up checked per forward (verify with ``branch`` and a block of >= 2; 0: none), each
    # ``alt_rows`` rows: the candidate's own (a committed base row) and a block of the job's size behind it.
    alternates = property(lambda self: self.settings.alternates if self.branch_rows and self.block_size >= 2 else 0)
    alt_rows = property(lambda self: 1 + self.block_size)


def model_device_dtype(model) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, (model.dtype if hasattr(model, "dtype") else p.dtype)


def check_prompts(input_ids, attention_mask, device, vocab: int) -> list[list[int]]:
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
        pad, where = getattr(gen_cfg, "pad_token_id", None), "model.generation_config.pad_token_id"
        if pad is None:
            pad, where = getattr(cfg, "pad_token_id", None), "config.pad_token_id"
        if pad is not None and (not _is_int(pad) or pad < 0):
            raise ValueError(
                f"the model's {where} = {pad!r} is not a token id (an int >= 0); pass pad_token_id=<a token id> "
                f"(e.g. the EOS id) to override it"
            )
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


def _check_given_ids(settings: GenerationSettings, vocab: int) -> None:
    """Stop and pad ids the caller gave must be token ids of this model (an EOS id the model cannot produce would
    silently never stop). Ids taken from the model's own config are its business and are not checked."""
    for name in ("eos_token_id", "stop_token_ids"):
        ids = getattr(settings, name) or ()
        if any(t >= vocab for t in ids):
            raise ValueError(f"{name} {list(ids)} holds ids outside [0, vocab_size={vocab}): they could never stop")
    if settings.pad_token_id is not None and settings.pad_token_id >= vocab:
        raise ValueError(f"pad_token_id = {settings.pad_token_id} is not a token id in [0, vocab_size={vocab})")


def make_job(model, input_ids, attention_mask, settings: GenerationSettings) -> Job:
    """Resolve ``settings`` against ``model`` and the prompts (model defaults, SBD metadata, position limit)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise TypeError("model must be a HuggingFace PreTrainedModel (it has no .config)")
    cfg = config.get_text_config(decoder=True)
    device, _ = model_device_dtype(model)
    vocab = int(cfg.vocab_size)
    prompts = check_prompts(input_ids, attention_mask, device, vocab)
    longest = max(len(p) for p in prompts)
    _check_given_ids(settings, vocab)
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
    elif mask_id is not None and not 0 <= mask_id < vocab:  # NTP bans it too: it must be a token id
        raise ValueError(f"config.{MASK_TOKEN_ATTR} = {mask_id} is not a token id in [0, vocab_size={vocab})")
    stop_ids = frozenset(settings.eos_token_id + settings.stop_token_ids)
    head = getattr(getattr(model, "sbd_drafter", None), "sampler_head", None)
    if head is not None and settings.verify:
        head = (head, model.get_input_embeddings().weight)
        _check_sampler_head(*head)
    else:
        head = None
    store = getattr(getattr(model, "sbd_drafter", None), "draft_store", None)
    if store is not None and not (settings.verify and settings.lookup):
        store = None
    if store is not None and not callable(getattr(store, "propose", None)):
        raise TypeError(
            f"model.sbd_drafter.draft_store must be a sbd_ext.decoding.lookup.DraftStore or None, got "
            f"{type(store).__name__}"
        )
    return Job(settings, prompts, stop_ids, mask_id, vocab, head, store)


def _check_sampler_head(head, emb: torch.Tensor) -> None:
    """``model.sbd_drafter.sampler_head`` must be a SamplerHead (sbd_ext.drafter) of the model's hidden size on its
    device (checked by what decoding reads: ``rescore_`` and ``w1``)."""
    if not callable(getattr(head, "rescore_", None)) or not isinstance(getattr(head, "w1", None), torch.Tensor):
        raise TypeError(
            f"model.sbd_drafter.sampler_head must be a sbd_ext.drafter.SamplerHead or None, got {type(head).__name__}"
        )
    if head.w1.shape[1] != emb.shape[1]:
        raise ValueError(
            f"model.sbd_drafter.sampler_head reads embeddings of size {head.w1.shape[1]}, the model's are "
            f"{emb.shape[1]}"
        )
    if head.w1.device != emb.device:
        raise ValueError(f"model.sbd_drafter.sampler_head is on {head.w1.device}, the model on {emb.device}")
