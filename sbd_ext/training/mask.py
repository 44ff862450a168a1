"""The SBD training attention mask over the 2L input, as a FlexAttention ``mask_mod`` and as dense masks.

For a batch of sequences x [B, L] and a block size k, SBD trains ONE forward over the 2L-token input
``cat(x, x_hat)``, where x_hat replaces each token of x by the mask token with probability eta,
eta ~ U(0, 1) drawn once per sequence. Both halves use position ids 0..L-1. Indices q, kv below run over
the 2L input; blocks have size k; three parts of the attention mask are OR-ed:

- clean -> clean, causal:                      q < L, kv < L, kv <= q
- noisy -> noisy, same block, bidirectional:   q >= L, kv >= L, (q-L)//k == (kv-L)//k
- noisy -> clean, strictly earlier blocks:     q >= L, kv < L, (q-L)//k > kv//k

so a noisy block never sees the clean copy of its own block, and the clean half never sees the noisy half
(its outputs are exactly those of a plain causal forward of x). The loss is the next-token cross-entropy on the
clean half (the output at t predicts x[t+1]) plus the cross-entropy on the masked positions of the noisy half
(the output at L+t predicts x[t]; unmasked noisy positions are ignored): a plain sum of the two token-level means.

Right-padded batches are supported through a 2D ``attention_mask`` [B, L] (1 = token, 0 = padding): padding
positions of either half are never attended to, never masked and never in the loss.

How the custom mask reaches the attention function (transformers 5.x): ``create_causal_mask`` in
``transformers.masking_utils`` returns any 4D ``attention_mask`` (a tensor or a FlexAttention ``BlockMask``) as
is, whatever ``config._attn_implementation`` is, and the model hands it unchanged to every layer's attention
function. Each implementation wants a different kind of mask, which :func:`mask_format_for` picks:

- ``"sdpa"``: boolean [B, 1, 2L, 2L], True = may attend (``F.scaled_dot_product_attention(attn_mask=...)``);
- ``"eager"``: additive float [B, 1, 2L, 2L] in the model dtype, 0 or dtype-min (added to the scores; a boolean
  mask would be added as 0/1, silently wrong);
- ``"flex_attention"``: a ``BlockMask`` from ``create_block_mask`` with :func:`sbd_mask_mod` (its ``shape`` is 4D,
  so it passes the same early exit); on the CPU torch 2.13 has no FlexAttention backward (forward only);
- ``"sbd"`` (sbd_ext's backend) and any other registered implementation: boolean, as for SDPA (the sbd backend
  falls back to SDPA for a custom 4D mask);
- ``flash_attention_*``: refused, FlashAttention takes no arbitrary mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    HAS_FLEX_ATTENTION = True
except ImportError:  # pragma: no cover - torch < 2.5
    BlockMask = None
    create_block_mask = None
    HAS_FLEX_ATTENTION = False

__all__ = ["MASK_FORMATS", "HAS_FLEX_ATTENTION", "sbd_mask_mod", "sbd_attention_mask", "mask_format_for"]

MASK_FORMATS = ("bool", "additive", "block")


def sbd_mask_mod(seq_len: int, block_size: int, lengths: torch.Tensor | None = None, device=None) -> Callable:
    """The SBD mask as a FlexAttention ``mask_mod(b, h, q, kv) -> bool`` over the 2L input.

    ``lengths`` [B] (optional): valid tokens per right-padded sequence; key positions at or past it, in either half,
    are masked out. Works on broadcast index tensors too, which is how the dense masks are built from the same
    predicate. With ``device``, L and k are captured as 0-dim tensors instead of Python ints: torch.compile (which
    transformers wraps flex_attention in) then sees them as graph inputs rather than constants, so a new k each
    step does not recompile the attention kernel.
    """
    L, k = int(seq_len), int(block_size)
    if device is not None:
        L, k = torch.tensor(L, device=device), torch.tensor(k, device=device)

    def mask_mod(b, h, q, kv):
        q_clean, kv_clean = q < L, kv < L
        qn, kvn = q - L, kv - L
        clean_clean = q_clean & kv_clean & (kv <= q)
        noisy_noisy = ~q_clean & ~kv_clean & (qn // k == kvn // k)
        noisy_clean = ~q_clean & kv_clean & (qn // k > kv // k)
        allowed = clean_clean | noisy_noisy | noisy_clean
        if lengths is not None:
            allowed = allowed & (torch.where(kv_clean, kv, kvn) < lengths[b])
        return allowed

    return mask_mod


def sbd_attention_mask(
    seq_len: int,
    block_size: int,
    lengths: torch.Tensor | None = None,
    *,
    batch_size: int | None = None,
    mask_format: str = "bool",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
):
    """The SBD attention mask over the 2L input, in one of three forms.

    - ``"bool"``: [B, 1, 2L, 2L] bool, True = may attend (SDPA);
    - ``"additive"``: [B, 1, 2L, 2L] ``dtype``, 0 where allowed and ``finfo(dtype).min`` elsewhere (eager);
    - ``"block"``: a FlexAttention ``BlockMask`` of shape (B, 1, 2L, 2L), B = 1 without ``lengths``.
    B is ``len(lengths)`` when given, else ``batch_size`` (default 1); without ``lengths`` the dense masks are one
    [1, 1, 2L, 2L] mask expanded over the batch. Every query row keeps at least one key as
    long as each sequence has at least one token (its first clean token / the first noisy token of block 0), so no
    softmax row is empty.
    """
    if mask_format not in MASK_FORMATS:
        raise ValueError(f"mask_format must be one of {MASK_FORMATS}, got {mask_format!r}")
    if int(block_size) < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if int(seq_len) < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if lengths is not None:
        device = lengths.device if device is None else torch.device(device)
        lengths = lengths.to(device=device, dtype=torch.long)
        B = lengths.shape[0]
    else:
        B = 1 if batch_size is None else int(batch_size)
    device = torch.device("cpu") if device is None else torch.device(device)
    T = 2 * int(seq_len)

    if mask_format == "block":
        if not HAS_FLEX_ATTENTION:
            raise RuntimeError("mask_format='block' needs torch.nn.attention.flex_attention (torch >= 2.5)")
        mask_mod = sbd_mask_mod(seq_len, block_size, lengths, device=device)
        # Without padding one (1, 1, T, T) mask serves the whole batch (flex_attention broadcasts B=1).
        return create_block_mask(mask_mod, B if lengths is not None else 1, None, T, T, device=device)

    # Without padding the mask is built once and expanded over the batch (stride 0): T^2, not B * T^2, elements.
    idx = torch.arange(T, device=device)
    nb = B if lengths is not None else 1
    b = torch.arange(nb, device=device).view(nb, 1, 1, 1)
    allowed = sbd_mask_mod(seq_len, block_size, lengths)(b, None, idx.view(1, 1, T, 1), idx.view(1, 1, 1, T))
    if mask_format == "additive":
        allowed = torch.where(allowed, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)
    return allowed.expand(B, 1, T, T)


def mask_format_for(attn_implementation: str | None) -> str:
    """Which mask form a transformers attention implementation needs for a custom 4D mask (see module doc)."""
    impl = attn_implementation or "sdpa"
    if impl == "eager":
        return "additive"
    if impl == "flex_attention":
        return "block"
    if "flash" in impl:
        raise ValueError(
            f"attn_implementation={impl!r} cannot take the SBD attention mask (FlashAttention has no arbitrary mask); "
            "load the model with attn_implementation='sdpa', 'eager', 'flex_attention' or 'sbd' for SBD training"
        )
    return "bool"
