"""The ``"sbd"`` attention implementation for HuggingFace transformers.

``import sbd_ext`` registers, through transformers' public extension points only,

* ``"sbd"`` with :class:`transformers.AttentionInterface` -> :func:`sbd_attention_forward`, and
* ``"sbd"`` with :class:`transformers.masking_utils.AttentionMaskInterface` -> :func:`sbd_mask`,

so ``LlamaForCausalLM.from_pretrained(path, attn_implementation="sbd")``, ``config._attn_implementation = "sbd"``
and ``model.set_attn_implementation("sbd")`` all work, for Llama and every model whose attention calls
``ALL_ATTENTION_FUNCTIONS.get_interface(...)``.

How a forward is routed (decided per layer call, in this order):

1. **SBD decoding.** ``sbd_plan=<SBDForwardPlan>`` among the forward kwargs (set by :mod:`sbd_ext.decoding`; it
   reaches this function through ``LlamaModel.forward(**kwargs)`` -> decoder layer -> ``LlamaAttention`` ->
   ``attention_interface(..., **kwargs)``): ``key``/``value`` are this forward's new rows only (``SBDCache.update``
   stores nothing) and :func:`sbd_ext.ops.block_attention` attends over the plan's cache + the new rows, appending
   the committed rows' K/V to the cache in place.
2. **Plain causal, no grad.** :func:`sbd_mask` returns ``None`` exactly when the mask is the plain causal one
   (causal mask function, no padding, keys = every cached token followed by the queries). Then ``key``/``value`` are
   the full keys (e.g. what ``DynamicCache.update`` returned) and the last ``T`` of them are the queries' own rows:
   :func:`~sbd_ext.ops.block_attention` runs with ``cache_lens = S - T`` and ``n_commit = n_valid = T``.
3. **Fallback to transformers' SDPA path** (:func:`transformers.integrations.sdpa_attention.sdpa_attention_forward`)
   for everything else: a materialised 4D mask (padding, custom 4D masks, sliding/chunked/bidirectional or
   ``or``/``and`` mask functions, static caches), autograd (any of q/k/v requires grad while grad mode is on:
   the kernel has no backward), dropout in training mode, ``softcap``/``sliding_window``/``s_aux`` kwargs,
   dtypes or devices without an ``sbd_ext`` kernel. With a ``None`` mask and ``1 < T < S`` (a multi-token forward on
   top of a cache) the fallback builds the lower-right causal mask itself, because SDPA's ``is_causal`` is
   upper-left aligned and transformers' SDPA path would crop the keys.
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

from . import ops

__all__ = ["ATTN_IMPLEMENTATION", "sbd_attention_forward", "sbd_mask", "register", "kernel_available"]

ATTN_IMPLEMENTATION = "sbd"

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_kernel_on_device: dict[str, bool] = {}


def kernel_available(device: torch.device) -> bool:
    """Whether ``sbd_ext::block_attention`` has a kernel (not only a fake impl) for ``device``'s dispatch key."""
    key = device.type
    if key not in _kernel_on_device:
        dispatch_key = {"cpu": "CPU", "cuda": "CUDA"}.get(key)
        _kernel_on_device[key] = dispatch_key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
            "sbd_ext::block_attention", dispatch_key
        )
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

    Returns ``None`` iff the mask is plain causal over *all* keys -- the causal mask function, no local window, no
    padding in ``attention_mask``, and the keys are exactly the ``q_offset`` cached tokens followed by the
    ``q_length`` queries (``kv_offset == 0``, ``kv_length == q_offset + q_length``; not true for static caches,
    whose keys are the whole preallocated buffer). :func:`sbd_attention_forward` reads ``None`` as "lower-right
    aligned causal" and runs the block-attention kernel. In every other case the mask is materialised exactly as
    ``sdpa_mask`` builds it (4D boolean, never skipped), which sends the layer to the SDPA fallback. In particular a
    ``None`` never means "bidirectional", unlike ``sdpa_mask(..., allow_is_bidirectional_skip=True)``.
    """
    plain = (
        allow_is_causal_skip
        and mask_function is causal_mask_function
        and local_size is None
        and not isinstance(kv_offset, torch.Tensor)
        and kv_offset == 0
    )
    if plain and isinstance(q_offset, torch.Tensor):
        plain = not is_tracing(q_offset) and q_offset.numel() == 1
        q_offset_int = int(q_offset) if plain else -1
    else:
        q_offset_int = q_offset
    plain = plain and kv_length == q_offset_int + q_length
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
    if any(kwargs.get(k) is not None for k in ("softcap", "sliding_window", "s_aux", "position_bias")):
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
    return kernel_available(query.device)


def _sdpa_fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and 1 < q_len < kv_len:
        # sbd_mask only returns None for a lower-right aligned causal mask; SDPA's is_causal is upper-left aligned.
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        attention_mask = attention_mask[None, None]
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
    if sbd_plan is not None:
        return sbd_plan.attend(module, query, key, value, scaling, dropout), None
    if not _kernel_ok(module, query, key, value, attention_mask, dropout, is_causal, kwargs):
        return _sdpa_fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)

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
    out = ops.block_attention(query, k_new, v_new, key, value, lens, rows, rows, scaling)
    return out, None


def register() -> None:
    """Register ``"sbd"`` with transformers' attention and mask interfaces (idempotent; done on import)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, sbd_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sbd_mask)


register()
