"""The model families sbd_ext decodes, and how each attention feature reaches the kernel: one table.

:data:`FAMILIES` maps a transformers ``config.model_type`` to the attention features that family's models can use
and how sbd_ext handles each (:data:`FEATURES` says what each feature is):

* ``"kernel"`` -- a parameter of :func:`sbd_ext.ops.block_attention`, filled from what transformers passes the
  attention function (``softcap``, ``sliding_window`` -> ``window_left = sliding_window - 1``), on every path;
* ``"head"`` -- applied to the output logits by the model's forward, and by sbd_ext's compiled decode step, which
  calls the decoder and the head itself (:func:`lm_logits`);
* ``"refuse"`` -- the kernel has no such parameter: a model that uses the feature is refused.

:func:`check_model` reads the table: :func:`sbd_ext.generate`, :func:`sbd_ext.generate_reference` and the ``"sbd"``
attention backend call it before any work, and a model type that is not in the table, or that uses a refused
feature, raises :class:`UnsupportedModelError` naming what is supported. Unknown types are refused even when they
look like a Llama: a family enters the table once its features are known and its tests pass
(python_tests/test_model_families.py: NTP mode == HF ``generate``, SBD == the no-cache reference).

Everything else a family does differently (Gemma's embedding scale, Gemma-3's RoPE per layer type, Qwen3's q/k
norms, biases, GQA) happens in transformers' own modules around the attention call.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "FAMILIES",
    "FEATURES",
    "HEAD",
    "KERNEL",
    "REFUSE",
    "UnsupportedModelError",
    "check_config",
    "check_model",
    "layer_windows",
    "lm_logits",
    "markdown_table",
    "reference_mask",
    "window_left",
]

KERNEL = "kernel"
HEAD = "head"
REFUSE = "refuse"

# feature -> (what it is, how it is detected on a text config; shown in errors and in the README table)
FEATURES: dict[str, str] = {
    "sliding_window": "sliding-window attention (`sliding_window`, per layer by `layer_types`) -> `window_left`",
    "softcap": "attention logit soft-capping (`attn_logit_softcapping`, as transformers passes it) -> `softcap`",
    "final_softcap": "final logit soft-capping (`final_logit_softcapping`) of the output head",
    "attention_sinks": "attention sinks (`s_aux`, gpt-oss): no kernel parameter",
    "bidirectional": "bidirectional attention (`use_bidirectional_attention`, `is_causal=False`): not a decoder",
}

# model_type -> {feature: how it is handled}. A feature not listed for a family is not used by it; "bidirectional"
# is refused for every family (see _uses).
FAMILIES: dict[str, dict[str, str]] = {
    "llama": {},
    "mistral": {"sliding_window": KERNEL},
    "qwen2": {"sliding_window": KERNEL},
    "qwen3": {"sliding_window": KERNEL},
    "gemma": {},
    "gemma2": {"softcap": KERNEL, "sliding_window": KERNEL, "final_softcap": HEAD},
    "gemma3_text": {"softcap": KERNEL, "sliding_window": KERNEL, "final_softcap": HEAD},
    "gpt_oss": {"sliding_window": KERNEL, "attention_sinks": REFUSE},
}

# Families whose model forward takes a {layer type: 4D mask} dict as attention_mask (the no-cache reference decoder
# gives sliding and full layers their own masks); the others take one 4D mask for every layer.
_MASK_BY_LAYER_TYPE = {"qwen2", "qwen3", "gemma2", "gemma3_text", "gpt_oss"}


class UnsupportedModelError(ValueError):
    """A model whose family, or one of whose attention features, sbd_ext cannot decode exactly."""


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def head_dim(config) -> int:
    """The attention head dim of a (text) config: ``head_dim`` where set, else hidden_size / num_attention_heads."""
    cfg = _text_config(config)
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def layer_windows(config) -> list[int | None]:
    """Per decoder layer, the sliding window transformers applies (``kv > q - window``), or None for full attention.

    ``config.layer_types`` says which layers slide (Gemma-2/3, Qwen2/3, gpt-oss); without it (Mistral) a set
    ``sliding_window`` applies to every layer, as the model's attention passes it to every layer.
    """
    cfg = _text_config(config)
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    if window is None:
        return [None] * n
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return [window] * n
    return [window if t == "sliding_attention" else None for t in types[:n]]


def window_left(sliding_window: int | None) -> int:
    """block_attention's ``window_left`` for transformers' ``sliding_window``: ``kv > q - W`` is ``kv >= q - W + 1``."""
    if sliding_window is None:
        return -1
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise UnsupportedModelError(f"sliding_window must be a positive integer or None, got {sliding_window!r}")
    return sliding_window - 1


def _uses(cfg, feature: str) -> bool:
    if feature == "sliding_window":
        return any(w is not None for w in layer_windows(cfg))
    if feature == "softcap":
        return getattr(cfg, "attn_logit_softcapping", None) is not None
    if feature == "final_softcap":
        return getattr(cfg, "final_logit_softcapping", None) is not None
    if feature == "attention_sinks":
        return True  # every gpt-oss attention layer has sinks
    if feature == "bidirectional":
        return bool(getattr(cfg, "use_bidirectional_attention", False)) or not getattr(cfg, "is_causal", True)
    raise KeyError(feature)


def _supported() -> str:
    return ", ".join(t for t, feats in FAMILIES.items() if REFUSE not in feats.values())


def check_config(config) -> dict[str, str]:
    """The features ``config``'s model uses and how each is handled; raises :class:`UnsupportedModelError` for a
    model type not in :data:`FAMILIES` or a feature the kernels cannot honour."""
    # The table is keyed by the model's own type: a multimodal wrapper ("gemma3") is not its text model
    # ("gemma3_text"), whose features are read below.
    cfg = _text_config(config)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"sbd_ext does not support model type {model_type!r}: its attention features are not in the table of "
            f"sbd_ext.families (supported: {_supported()}). A family is added there once the kernels honour "
            "everything its attention does."
        )
    features = {f: how for f, how in {**family, "bidirectional": REFUSE}.items() if _uses(cfg, f)}
    refused = [f for f, how in features.items() if how == REFUSE]
    if refused:
        raise UnsupportedModelError(
            f"sbd_ext cannot decode this {model_type!r} model exactly: "
            + "; ".join(FEATURES[f] for f in refused)
            + f". Supported: {_supported()}."
        )
    return features


def check_model(model) -> dict[str, str]:
    """:func:`check_config` of a model's config (the first thing :func:`sbd_ext.generate` does)."""
    return check_config(model.config)


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The output head as the family's ``ForCausalLM.forward`` applies it -- the head, then Gemma-2/3's final logit
    soft-capping (``tanh(logits / cap) * cap``) -- for code that runs the decoder and the head itself."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(_text_config(model.config), "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def reference_mask(config, n_clean: int, n_block: int, dtype: torch.dtype, device) -> Any:
    """The attention mask of one no-cache reference forward (:func:`sbd_ext.generate_reference`): ``n_clean`` clean
    rows (causal) then ``n_block`` set-block rows (the clean prefix and the whole block), at positions 0..n-1,
    additive ([1, 1, n, n]: 0 = attend, finfo.min = not) so that it means the same to every attention backend.

    Each sliding layer also hides the keys at positions <= p - W from the row at position p -- the kernels'
    definition (sbd/block_attention_params.h), set-block rows included. Returns one mask, or a {layer type: mask}
    dict for the families whose forward takes one when their layers differ.
    """
    n = n_clean + n_block
    i = torch.arange(n, device=device).view(n, 1)
    j = torch.arange(n, device=device).view(1, n)
    allowed = (j <= i) | ((i >= n_clean) & (j >= n_clean))
    zero = torch.zeros((), dtype=dtype, device=device)

    def additive(window: int | None) -> torch.Tensor:
        ok = allowed if window is None else allowed & (j > i - window)
        return torch.where(ok, zero, torch.finfo(dtype).min).view(1, 1, n, n)

    windows = set(layer_windows(config))
    if len(windows) == 1:
        return additive(windows.pop())
    model_type = getattr(_text_config(config), "model_type", None)
    if model_type not in _MASK_BY_LAYER_TYPE or len(windows - {None}) != 1:
        raise UnsupportedModelError(f"reference_mask: per-layer windows {sorted(windows, key=str)} of {model_type!r}")
    (window,) = windows - {None}
    return {"full_attention": additive(None), "sliding_attention": additive(window)}


def markdown_table() -> str:
    """The README's table of supported model families (python_tests/test_model_families.py keeps them equal)."""
    rows = [
        "| model type | sliding window | attention logit soft-capping | final logit soft-capping | refused |",
        "|---|---|---|---|---|",
    ]
    for model_type, feats in FAMILIES.items():
        refused = ", ".join(FEATURES[f].split(":")[0] for f, how in feats.items() if how == REFUSE)
        cells = ["kernel `window_left`" if feats.get("sliding_window") == KERNEL else "—"]
        cells.append("kernel `softcap`" if feats.get("softcap") == KERNEL else "—")
        cells.append("head (`lm_logits`)" if feats.get("final_softcap") == HEAD else "—")
        rows.append(f"| `{model_type}` | {' | '.join(cells)} | {refused or '—'} |")
    return "\n".join(rows)
