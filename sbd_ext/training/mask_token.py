"""The mask token: :func:`add_mask_token` gives a model (and its tokenizer) the token SBD masks with."""

from __future__ import annotations

import torch

from ..metadata import DEFAULT_BLOCK_SIZE_RANGE, check_block_size_range, set_sbd_metadata
from ..quantization import Int8Linear, PackedLinear, quantized_scheme

__all__ = ["add_mask_token"]


@torch.no_grad()
def add_mask_token(model, tokenizer=None, token: str = "<|mask|>", block_size_range=DEFAULT_BLOCK_SIZE_RANGE) -> int:
    """Give ``model`` (and ``tokenizer``) a mask token and record the SBD metadata in ``model.config``.

    - tokenizer with a mask token already: that token is reused;
    - tokenizer without one: ``token`` is added as its ``mask_token`` special token;
    - no tokenizer: ``config.mask_token_id`` is reused when it is already set, else the new id is the current
      number of embedding rows.
    The input (and, when untied, output) embeddings grow when the id does not fit; a newly created token's rows are
    set to the mean of the existing tokens' rows, so the mask token starts as an "average" token and its output logit as
    the average logit. Sets ``config.mask_token_id`` and ``config.sbd_block_size_range``. Returns the id.
    A quantized model (:func:`sbd_ext.quantize`) whose untied output head holds packed / int8 weights is refused
    when a token is to be created (that head's rows cannot be edited); a tied head follows the embedding.
    """
    lo, hi = check_block_size_range(block_size_range)
    _check_head_editable(model, tokenizer)
    emb = model.get_input_embeddings()
    n_rows = emb.weight.shape[0]
    fresh = False  # a token that did not exist before this call: its embedding rows need initialising
    n_real = n_rows  # rows of real tokens, averaged for the new one (excludes a padded vocabulary's unused rows)
    if tokenizer is not None:
        n_real = min(n_rows, len(tokenizer))
        if tokenizer.mask_token is None or tokenizer.mask_token_id is None:
            before = len(tokenizer)
            tokenizer.add_special_tokens({"mask_token": token})
            fresh = len(tokenizer) > before
        mask_id = int(tokenizer.mask_token_id)
    else:
        existing = getattr(model.config, "mask_token_id", None)
        if existing is not None and 0 <= int(existing) < n_rows:
            mask_id = int(existing)
        else:
            mask_id, fresh = n_rows, True

    if mask_id >= n_rows:
        new_rows = max(mask_id + 1, len(tokenizer) if tokenizer is not None else 0)
        model.resize_token_embeddings(new_rows, mean_resizing=False)
        init_rows = list(range(n_rows, new_rows))
    else:
        init_rows = [mask_id] if fresh else []
    if init_rows:
        emb_w = model.get_input_embeddings().weight
        out = model.get_output_embeddings()
        tables = [emb_w]
        if out is not None and out.weight.data_ptr() != emb_w.data_ptr():  # untied output head
            tables.append(out.weight)
        for w in tables:
            w[init_rows] = w[:n_real].float().mean(0).to(w.dtype)
        out_bias = getattr(out, "bias", None)
        if out_bias is not None:
            out_bias[init_rows] = out_bias[:n_real].float().mean().to(out_bias.dtype)

    set_sbd_metadata(model, mask_id, (lo, hi))
    return mask_id


def _check_head_editable(model, tokenizer) -> None:
    """Refuse, before anything changes, a new token on a model whose untied output head is a converted layer."""
    out = model.get_output_embeddings()
    if not isinstance(out, (Int8Linear, PackedLinear)) or "weight" in out._parameters:
        return
    if tokenizer is not None:
        new = tokenizer.mask_token is None or tokenizer.mask_token_id is None
    else:
        existing = getattr(model.config, "mask_token_id", None)
        new = existing is None or not 0 <= int(existing) < model.get_input_embeddings().weight.shape[0]
    if new:
        scheme = quantized_scheme(model) or ("packed" if isinstance(out, PackedLinear) else "int8")
        raise ValueError(
            f"add_mask_token: the model's output head holds {scheme!r} weights (sbd_ext.quantize), whose rows the new "
            "token's cannot be written into: add the mask token to the fp32 model, then quantize"
        )
