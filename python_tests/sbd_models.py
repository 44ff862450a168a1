"""Small random Llama models for the HF-backend and decoding tests (no weights are downloaded)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sbd_ext.decoding import set_sbd_metadata

VOCAB = 100
MASK_ID = VOCAB - 1  # a random model has no trained mask token; any id works for comparing implementations


def tiny_llama(
    n_heads: int = 4,
    n_kv_heads: int = 2,
    layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn: str = "sbd",
    lm_scale: float = 8.0,
    mask_id: int | None = MASK_ID,
    max_positions: int = 256,
    vocab: int = VOCAB,
    init_range: float = 0.1,
    tie: bool = False,
    hidden: int = 64,
    intermediate: int | None = None,
    block_size_range: tuple[int, int] | None = None,
    **config_kwargs,
) -> LlamaForCausalLM:
    """A random LlamaForCausalLM (hidden ``hidden``, default 64, MLP ``intermediate``, default 2 x hidden, vocab
    ``vocab``, default 100) in eval mode.

    ``lm_scale`` multiplies the output head so that next-token entropies spread over roughly [0, 2] nats, like a
    trained model's, instead of all sitting near ln(100): the samplers then reveal varying numbers of positions
    (1.0 leaves the head as initialised, as the training tests want). ``mask_id`` is recorded as the SBD mask token
    (None: no SBD metadata), with ``block_size_range`` when given; ``init_range`` is the config's initializer_range;
    ``tie`` ties the output head to the input embeddings.
    """
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden if intermediate is None else intermediate,
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=init_range,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **config_kwargs,
    )
    cfg._attn_implementation = attn
    model = LlamaForCausalLM(cfg).eval()
    if lm_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_scale)
    if mask_id is not None:
        set_sbd_metadata(model.config, mask_id, block_size_range)
    return model.to(dtype)


def random_prompts(lengths: list[int], seed: int = 1, padding_side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of ragged random prompts (ids avoid the mask token), padded on one side."""
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.zeros(len(lengths), P, dtype=torch.int64)
    mask = torch.zeros(len(lengths), P, dtype=torch.int64)
    for b, n in enumerate(lengths):
        row = torch.randint(0, MASK_ID, (n,), generator=g)
        sl = slice(P - n, P) if padding_side == "left" else slice(0, n)
        ids[b, sl] = row
        mask[b, sl] = 1
    return ids, mask


@contextlib.contextmanager
def num_threads(threads: int):
    """torch on ``threads`` intra-op threads inside the block, the previous setting restored after it."""
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def one_thread():
    """torch on one intra-op thread inside the block, the previous setting restored after it (for fixtures of any
    scope)."""
    return num_threads(1)


@pytest.fixture
def record_threads():
    """Run a test with every core it may use as intra-op threads, restoring the setting afterwards: SmolLM2's
    record checks decode 50 sequences per forward, where a second thread pays (the 100-problem record of
    smollm2-sbd: 241 s on one thread, 113 s on two, AMD EPYC Zen 3). The tiny models' tests keep one thread
    (:func:`single_thread`)."""
    with num_threads(len(os.sched_getaffinity(0))):
        yield


@pytest.fixture
def single_thread():
    """Run a test with one intra-op thread, restoring the setting afterwards.

    These models are tiny (hidden 64): threads only add synchronisation, and on a loaded 2-core machine OpenMP's
    spin-waiting made the HF/decoding tests ~10x slower (255 s vs 9 s for the three files, measured here).
    """
    with one_thread():
        yield


def broken_drafter(model, tmp_path, sbd: dict, edit_cfg=None, edit_tensors=None):
    """A drafter folder of ``model`` (a new one under ``tmp_path``) with its config and/or tensors edited in place."""
    import json

    from sbd_ext import drafter as sbd_drafter

    d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
    sbd_drafter.save_drafter(model, d, sbd)
    if edit_cfg:
        c = json.loads((d / sbd_drafter.CONFIG_FILE).read_text())
        edit_cfg(c)
        (d / sbd_drafter.CONFIG_FILE).write_text(json.dumps(c))
    if edit_tensors:
        from safetensors.torch import load_file, save_file

        t = load_file(d / sbd_drafter.WEIGHTS_FILE)
        edit_tensors(t)
        save_file(t, d / sbd_drafter.WEIGHTS_FILE)
    return d


def random_drafter(seed: int = 0, rank: int = 4, std: float = 0.3, **kw):
    """(base, model): a tiny Llama (``tiny_llama(seed, block_size_range=(2, 8), **kw)``) and a copy with a gated
    drafter whose factors are random (normal, ``std``) and large enough to change every block row's output."""
    import copy

    from sbd_ext import drafter as sbd_drafter

    base = tiny_llama(seed=seed, block_size_range=(2, 8), **kw)
    model = copy.deepcopy(base)
    params = sbd_drafter.attach(model, MASK_ID, rank=rank)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return base, model


def refused_alike(op: str, wrapper, args: dict, exc: type, match: str) -> None:
    """The Python wrapper ``wrapper(**args)``, the binding behind ``torch.ops.sbd_ext.<op>`` and its fake kernel all
    raise ``exc`` matching ``match`` for these arguments."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    binding = getattr(torch.ops.sbd_ext, op)
    with pytest.raises(exc, match=match):
        wrapper(**args)
    with pytest.raises(exc, match=match):
        binding(*args.values())
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(exc, match=match):
        binding(*args.values())
