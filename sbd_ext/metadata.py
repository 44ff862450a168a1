"""The SBD fields of a model config: the one reader and writer.

An SBD-trained model is an ordinary HF causal LM plus two config attributes, kept on the **text (decoder)
config** (``config.get_text_config(decoder=True)``; for a plain Llama that is ``model.config`` itself, for a
composite model the language model's config), so ``save_pretrained`` / ``from_pretrained`` carry them:

``mask_token_id`` (int)
    The id of the mask token ``<m>``: a token of the model's vocabulary (``0 <= id < vocab_size``) that the SBD
    training objective put in masked positions. Required for SBD decoding and training; NTP decoding ignores it.
``sbd_block_size_range`` (``[lo, hi]``, inclusive, optional)
    The block sizes k the model was trained with (the paper draws k uniformly in [2, 16]). When present,
    :func:`sbd_ext.generate` refuses other block sizes unless ``strict_block_size=False``.

Everything in the package that reads or writes these goes through :func:`set_sbd_metadata` /
:func:`get_sbd_metadata` (training's ``add_mask_token``, ``sbd_loss``, ``train_sbd``, ``SBDTrainer``, decoding).
"""

from __future__ import annotations

__all__ = [
    "MASK_TOKEN_ATTR",
    "BLOCK_RANGE_ATTR",
    "DEFAULT_BLOCK_SIZE_RANGE",
    "text_config",
    "unwrap_model",
    "check_block_size_range",
    "set_sbd_metadata",
    "get_sbd_metadata",
    "require_mask_token_id",
]

MASK_TOKEN_ATTR = "mask_token_id"
BLOCK_RANGE_ATTR = "sbd_block_size_range"
DEFAULT_BLOCK_SIZE_RANGE = (2, 16)  # the paper's training range for k


def unwrap_model(model):
    """The transformers model (or config) under DDP / FSDP / torch.compile wrappers, which keep it as ``.module`` /
    ``._orig_mod`` (PEFT forwards ``.config`` itself): the package's one unwrapping helper."""
    for _ in range(8):
        if hasattr(model, "config") or hasattr(model, "get_text_config"):
            break
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            break
        model = inner
    return model


def text_config(config_or_model):
    """The config that holds the SBD fields: the decoder's text config of a config or of a model (wrappers such as
    DDP, FSDP, torch.compile and PEFT are looked through)."""
    obj = unwrap_model(config_or_model)
    if hasattr(obj, "get_text_config"):
        return obj.get_text_config(decoder=True)
    if hasattr(obj, "config") and hasattr(obj.config, "get_text_config"):
        return obj.config.get_text_config(decoder=True)
    raise TypeError(f"expected a transformers model or config, got {type(config_or_model).__name__}")


def check_block_size_range(block_size_range) -> tuple[int, int]:
    """``(lo, hi)`` as ints with ``1 <= lo <= hi``, or a ValueError naming the argument."""
    try:
        lo, hi = block_size_range
    except (TypeError, ValueError):
        raise ValueError(f"block_size_range must be two ints (k_min, k_max), got {block_size_range!r}") from None
    try:
        ok = not isinstance(lo, bool) and not isinstance(hi, bool) and int(lo) == lo and int(hi) == hi
    except (TypeError, ValueError, OverflowError):  # NaN, inf, strings, None
        ok = False
    if not ok:
        raise ValueError(f"block_size_range must be two ints (k_min, k_max), got {block_size_range!r}")
    lo, hi = int(lo), int(hi)
    if not 1 <= lo <= hi:
        raise ValueError(f"block_size_range must satisfy 1 <= k_min <= k_max, got {block_size_range!r}")
    return lo, hi


def set_sbd_metadata(
    config_or_model, mask_token_id: int | None, block_size_range: tuple[int, int] | None = DEFAULT_BLOCK_SIZE_RANGE
) -> None:
    """Record the SBD fields on the text config of ``config_or_model``; ``block_size_range=None`` removes the range.

    ``mask_token_id=None`` removes both fields (the model is no longer marked as trained for SBD), so
    ``set_sbd_metadata(m, *get_sbd_metadata(m))`` restores what was there, metadata or none."""
    cfg = text_config(config_or_model)
    if mask_token_id is None:
        if block_size_range is not None:
            raise ValueError("set_sbd_metadata: a block_size_range needs a mask_token_id (None removes both)")
        for attr in (MASK_TOKEN_ATTR, BLOCK_RANGE_ATTR):
            if hasattr(cfg, attr):
                delattr(cfg, attr)
        return
    vocab = getattr(cfg, "vocab_size", None)
    if (
        isinstance(mask_token_id, bool)
        or not isinstance(mask_token_id, int)
        or mask_token_id < 0
        or (vocab is not None and mask_token_id >= vocab)
    ):
        raise ValueError(f"mask_token_id must be a token id in [0, vocab_size={vocab}), got {mask_token_id!r}")
    setattr(cfg, MASK_TOKEN_ATTR, int(mask_token_id))
    if block_size_range is not None:
        setattr(cfg, BLOCK_RANGE_ATTR, list(check_block_size_range(block_size_range)))
    elif hasattr(cfg, BLOCK_RANGE_ATTR):
        delattr(cfg, BLOCK_RANGE_ATTR)


def get_sbd_metadata(config_or_model) -> tuple[int | None, tuple[int, int] | None]:
    """(mask token id or None, trained block-size range ``(lo, hi)`` or None) from a model or its config."""
    cfg = text_config(config_or_model)
    mask_id = getattr(cfg, MASK_TOKEN_ATTR, None)
    rng = getattr(cfg, BLOCK_RANGE_ATTR, None)
    if mask_id is not None:
        if isinstance(mask_id, bool) or not isinstance(mask_id, int) or mask_id < 0:
            raise ValueError(f"the model config's {MASK_TOKEN_ATTR} must be a token id (an int >= 0), got {mask_id!r}")
    if rng is not None:
        try:
            rng = check_block_size_range(rng)
        except ValueError as e:
            raise ValueError(f"the model config's {BLOCK_RANGE_ATTR} is invalid: {e}") from None
    return mask_id, rng


def require_mask_token_id(config_or_model, mask_token_id: int | None, who: str) -> int:
    """``mask_token_id`` if given, else the config's; a ValueError that says what to do when neither is set."""
    if mask_token_id is None:
        mask_token_id = get_sbd_metadata(config_or_model)[0]
    if mask_token_id is None:
        raise ValueError(
            f"{who}: no mask_token_id given and the model config has no {MASK_TOKEN_ATTR} "
            "(call sbd_ext.training.add_mask_token(model, tokenizer) first)"
        )
    return int(mask_token_id)
