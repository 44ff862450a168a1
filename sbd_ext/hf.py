"""The ``"sbd"`` attention implementation for HuggingFace transformers.

``import sbd_ext`` registers, through transformers' public extension points only,

* ``"sbd"`` with :class:`transformers.AttentionInterface` -> :func:`sbd_attention_forward`, and
* ``"sbd"`` with :class:`transformers.masking_utils.AttentionMaskInterface` -> :func:`sbd_mask`,

so ``LlamaForCausalLM.from_pretrained(path, attn_implementation="sbd")``, ``config._attn_implementation = "sbd"``
and ``model.set_attn_implementation("sbd")`` all work, for the model families of :mod:`sbd_ext.families`.

The model's family must be in :data:`sbd_ext.families.FAMILIES` (checked per call, before any work): its
attention features reach the kernel as parameters -- ``softcap`` (logit soft-capping) and ``sliding_window``
(``window_left = sliding_window - 1``), as transformers passes them to this function -- on every route below; a
feature the kernel has no parameter for (gpt-oss's ``s_aux``) is refused, never dropped.

How a forward is routed (decided per layer call, in this order):

1. **SBD decoding.** ``sbd_plan=<SBDForwardPlan>`` among the forward kwargs (set by :mod:`sbd_ext.decoding`; it
   reaches this function through ``LlamaModel.forward(**kwargs)`` -> decoder layer -> ``LlamaAttention`` ->
   ``attention_interface(..., **kwargs)``): ``key``/``value`` are this forward's new rows only (``SBDCache.update``
   stores nothing) and :func:`sbd_ext.ops.block_attention` attends over the plan's cache + the new rows, appending
   the committed rows' K/V to the cache in place.
2. **Plain causal or sliding-window causal, no grad.** :func:`sbd_mask` returns ``None`` exactly when the mask is
   the plain causal one, or the plain sliding-window causal one of a family whose window is a kernel parameter (no
   padding, keys = consecutive tokens ending with the queries: every cached token, or the last ``W - 1`` of them
   that a sliding cache layer keeps). Then ``key``/``value`` end with the queries' own ``T`` rows:
   :func:`~sbd_ext.ops.block_attention` runs with ``cache_lens = S - T``, ``n_commit = n_valid = T`` and the
   layer's window (positions relative to the first key, which the window only compares by difference).
3. **Fallback to transformers' SDPA path** (:func:`transformers.integrations.sdpa_attention.sdpa_attention_forward`)
   for everything else: a materialised 4D mask (padding, custom 4D masks, sliding/chunked/bidirectional or
   ``or``/``and`` mask functions, static caches), autograd (any of q/k/v requires grad while grad mode is on:
   the kernel has no backward), dropout in training mode, ``output_attentions``, dtypes, devices or head dims
   without an ``sbd_ext`` kernel (CUDA: :data:`CUDA_HEAD_DIMS`). With a ``None`` mask and ``1 < T < S`` (a
   multi-token forward on top of a cache), or a sliding window, the fallback builds the lower-right (sliding) causal
   mask itself, because SDPA's ``is_causal`` is upper-left aligned and transformers' SDPA path would crop the keys.
   With ``softcap`` the fallback is an eager attention (the one of transformers' Gemma-2: scale, soft-cap, mask, fp32
   softmax), which SDPA cannot do.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)
from transformers.utils.import_utils import is_tracing

from . import _C, families, ops

__all__ = ["ATTN_IMPLEMENTATION", "CUDA_HEAD_DIMS", "sbd_attention_forward", "sbd_mask", "register", "kernel_available"]

ATTN_IMPLEMENTATION = "sbd"

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_kernel_on_device: dict[str, bool] = {}


# Head dims the CUDA block_attention kernels are built for, as the extension reports them (its one definition:
# sbd::kCudaBlockAttentionHeadDims in csrc/include/sbd/block_attention_params.h); the CPU kernel takes any.
CUDA_HEAD_DIMS: tuple[int, ...] = tuple(int(d) for d in _C.build_info()["cuda_head_dims"])


def kernel_available(device: torch.device, head_dim: int | None = None) -> bool:
    """Whether ``sbd_ext::block_attention`` has a kernel (not only a fake impl) for ``device``'s dispatch key, and,
    given ``head_dim``, one for that head dim (CUDA: :data:`CUDA_HEAD_DIMS`)."""
    key = device.type
    if key not in _kernel_on_device:
        dispatch_key = {"cpu": "CPU", "cuda": "CUDA"}.get(key)
        _kernel_on_device[key] = dispatch_key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
            "sbd_ext::block_attention", dispatch_key
        )
    if head_dim is not None and key == "cuda" and head_dim not in CUDA_HEAD_DIMS:
        return False
    return _kernel_on_device[key]


# --------------------------------------------------------------------------------------------------------
# mask function
# --------------------------------------------------------------------------------------------------------
def sbd_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The ``"sbd"`` entry of ``AttentionMaskInterface``.

    Returns ``None`` iff the mask is plain causal, or plain sliding-window causal (:func:`_plain_sliding`), over
    consecutive keys that end with the queries -- no padding in ``attention_mask``, and ``kv_offset + kv_length ==
    q_offset + q_length`` (keys = every cached token, or the last ``W - 1`` a sliding cache layer keeps; not true
    for static caches, whose keys are the whole preallocated buffer). :func:`sbd_attention_forward` reads ``None``
    as "lower-right aligned causal, within the layer's ``sliding_window``" and runs the block-attention kernel. In
    every other case the mask is materialised exactly as ``sdpa_mask`` builds it (4D boolean, never skipped), which
    sends the layer to the fallback. In particular a ``None`` never means "bidirectional", unlike
    ``sdpa_mask(..., allow_is_bidirectional_skip=True)``.
    """
    causal = mask_function is causal_mask_function and local_size is None
    plain = (
        allow_is_causal_skip
        and (causal or _plain_sliding(local_size, kwargs))
        and not isinstance(kv_offset, torch.Tensor)
        and kv_offset >= 0
    )
    if plain and isinstance(q_offset, torch.Tensor):
        plain = not is_tracing(q_offset) and q_offset.numel() == 1
        q_offset_int = int(q_offset) if plain else -1
    else:
        q_offset_int = q_offset
    plain = plain and kv_offset + kv_length == q_offset_int + q_length
    if plain and attention_mask is not None:
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, :kv_length]
        # One host sync, as sdpa_mask's own skip check does.
        plain = not is_tracing(padding) and bool(padding.all())
    if plain:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        **kwargs,
    )


def _plain_sliding(local_size: int | None, kwargs: dict) -> bool:
    """Whether a mask request is transformers' plain sliding-window causal mask of a family whose window the kernel
    takes as a parameter: ``create_sliding_window_causal_mask`` passes ``local_size = config.sliding_window`` and
    turns the skip off (``allow_is_causal_skip=False``, checked by the caller) or builds with vmap whenever it adds
    anything (extra mask functions, packed sequences, block overlays); the family table says the model passes the
    same window to its attention as ``sliding_window``."""
    config = kwargs.get("config")
    if local_size is None or config is None or kwargs.get("use_vmap", False):
        return False
    family = families.FAMILIES.get(getattr(config, "model_type", None), {})
    return family.get("sliding_window") == families.KERNEL and local_size == getattr(config, "sliding_window", None)


# --------------------------------------------------------------------------------------------------------
# attention function
# --------------------------------------------------------------------------------------------------------
def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _kernel_ok(module, query, key, value, attention_mask, dropout, is_causal, kwargs) -> bool:
    if attention_mask is not None or dropout != 0.0:
        return False
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        return False
    if kwargs.get("position_bias") is not None:
        return False
    if kwargs.get("output_attentions", False):
        return False
    if _needs_grad(query, key, value):
        return False
    if query.dtype not in _KERNEL_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if query.dim() != 4 or key.dim() != 4 or key.shape[2] < query.shape[2] or key.shape[1] == 0:
        return False
    if query.shape[1] % key.shape[1] != 0 or key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        return False
    return kernel_available(query.device, query.shape[-1])


def _check_family(module) -> None:
    """Read the family table (once per config object), so that an unsupported model fails before any work. Not on
    the SBD decoding route: sbd_ext.generate checks the model before its first forward (and that route is compiled
    with ``compile=True``)."""
    config = getattr(module, "config", None)
    if config is not None and _checked_configs.get(id(config)) is not config:
        families.check_config(config)
        _checked_configs[id(config)] = config


def _features(kwargs: dict) -> tuple[float | None, int]:
    """(softcap, window_left) of this layer call, from what transformers passes; refuses what the kernel cannot do."""
    if kwargs.get("s_aux") is not None:
        raise families.UnsupportedModelError(
            "the sbd attention has no attention sinks (s_aux, gpt-oss): " + families.FEATURES["attention_sinks"]
        )
    softcap = kwargs.get("softcap")
    return (float(softcap) if softcap else None), families.window_left(kwargs.get("sliding_window"))


# id(config) -> config: the configs whose family was checked (a config object's model type does not change).
_checked_configs: dict[int, Any] = {}


def _eager_fallback(module, query, key, value, attention_mask, dropout, scaling, softcap):
    """transformers' eager attention of Gemma-2 (scale, soft-cap, mask, fp32 softmax, dropout), with GQA."""
    g = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        w = w.masked_fill(~mask, torch.finfo(w.dtype).min) if mask.dtype == torch.bool else w + mask
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    w = torch.nn.functional.dropout(w, p=dropout, training=module.training)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), None


def _fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, softcap, window, kwargs):
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and (1 < q_len < kv_len or window >= 0 or softcap is not None):
        # sbd_mask only returns None for a lower-right aligned (sliding) causal mask; SDPA's is_causal is upper-left
        # aligned and knows no window, and the eager path has no is_causal. Query i sits at key position
        # kv_len - q_len + i.
        pos = torch.arange(q_len, device=query.device).view(-1, 1) + (kv_len - q_len)
        j = torch.arange(kv_len, device=query.device).view(1, -1)
        attention_mask = ((j <= pos) & ((j >= pos - window) if window >= 0 else True))[None, None]
    if softcap is not None:
        return _eager_fallback(module, query, key, value, attention_mask, dropout, scaling, softcap)
    kwargs = {k: v for k, v in kwargs.items() if k != "softcap"}
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def sbd_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sbd_plan=None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``"sbd"`` entry of ``AttentionInterface``; see the module docstring for the routing.

    query [B, Hq, T, D]; key, value [B, Hkv, S, D] (S = T under an ``sbd_plan``). Returns ([B, T, Hq, D], None).
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    softcap, window = _features(kwargs)
    if sbd_plan is not None:
        return sbd_plan.attend(module, query, key, value, scaling, dropout, softcap=softcap, window_left=window), None
    _check_family(module)
    if not _kernel_ok(module, query, key, value, attention_mask, dropout, is_causal, kwargs):
        return _fallback(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, softcap, window, kwargs
        )

    B, _, T, _ = query.shape
    S = key.shape[2]
    past = S - T
    # The kernel appends the committed rows' K/V to the cache at cache_lens. Here the "cache" is the full key tensor
    # (S rows, e.g. DynamicCache's own), which already holds these rows at [past, S): the write stores identical
    # values. The new rows are cloned (T rows; O(T*D) next to the O(T*S*D) attention) so that the op's read-only
    # inputs never alias its mutated cache.
    k_new = key[:, :, past:].clone()
    v_new = value[:, :, past:].clone()
    lens = torch.full((B,), past, dtype=torch.int32, device=query.device)
    rows = torch.full((B,), T, dtype=torch.int32, device=query.device)
    out = ops.block_attention(query, k_new, v_new, key, value, lens, rows, rows, scaling, softcap, window)
    return out, None


def register() -> None:
    """Register ``"sbd"`` with transformers' attention and mask interfaces (idempotent; done on import)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, sbd_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sbd_mask)


register()
