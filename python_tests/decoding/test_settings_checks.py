"""Issue 24, items 9 and 11 (decoding side): memory follows the effective block, absurd block sizes are refused up
front, NumPy numbers are accepted where Python numbers are, and the quiet acceptances are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sbd_models import (
    MASK_ID,
    VOCAB,
    random_prompts,
    single_thread,  # noqa: F401  (fixture)
    tiny_llama,
)

import sbd_ext.decoding.rows as rows_mod
from sbd_ext import reference
from sbd_ext.decoding import GenerationSettings, generate, generate_reference, get_sbd_metadata

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def test_memory_follows_the_effective_block(model, monkeypatch):
    """block_size far beyond max_new_tokens: the block's logits are [B, max_new_tokens, V], not [B, k, V] (before:
    k = 2*10**6 on the demo model allocated 2.3 GB), and the tokens are those of k = max_new_tokens."""
    ids, mask = random_prompts([3, 5])
    shapes = []
    real = rows_mod.sample_block  # every block's reveal (sample_rows) samples through it
    monkeypatch.setattr(
        rows_mod, "sample_block", lambda x, *a, **kw: shapes.append(tuple(x.shape)) or real(x, *a, **kw)
    )
    kw = dict(max_new_tokens=6, eos_token_id=[], strict_block_size=False)
    big = generate(model, ids, mask, block_size=50_000, **kw)
    assert shapes and all(s[1] <= 6 for s in shapes), shapes
    assert torch.equal(big.sequences, generate(model, ids, mask, block_size=6, **kw).sequences)
    assert torch.equal(big.sequences, generate_reference(model, ids, mask, block_size=50_000, **kw).sequences)


@pytest.mark.parametrize("k", [2**16 + 1, 2**40, 2**70])
def test_absurd_block_sizes_are_refused_up_front(k):
    with pytest.raises(ValueError, match=r"block_size must be an int in \[1, 65536\]"):
        GenerationSettings(block_size=k)


def test_numpy_numbers_are_settings(model):
    """NumPy integers and floats are accepted wherever Python numbers are (the ops accept them), normalised."""
    s = GenerationSettings(
        block_size=np.int64(4),
        threshold=np.float32(0.5),
        temperature=np.float64(0.7),
        seed=np.int32(3),
        max_new_tokens=np.int16(5),
        eos_token_id=[np.int64(7)],
        pad_token_id=np.uint8(0),
    )
    assert (s.block_size, s.seed, s.max_new_tokens, s.eos_token_id, s.pad_token_id) == (4, 3, 5, (7,), 0)
    assert type(s.block_size) is int and type(s.threshold) is float and type(s.temperature) is float
    ids, mask = random_prompts([3, 4])
    out = generate(model, ids, mask, s)
    same = generate(model, ids, mask, block_size=4, threshold=0.5, temperature=0.7, seed=3, max_new_tokens=5,
                    eos_token_id=7, pad_token_id=0)  # fmt: skip
    assert torch.equal(out.sequences, same.sequences)
    with pytest.raises(ValueError, match="block_size"):
        GenerationSettings(block_size=np.bool_(True))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(eos_token_id=VOCAB), "eos_token_id .* outside"),
        (dict(eos_token_id=[3, VOCAB + 5]), "eos_token_id .* outside"),
        (dict(stop_token_ids=[VOCAB]), "stop_token_ids .* outside"),
        (dict(pad_token_id=VOCAB), "pad_token_id"),
    ],
)
def test_ids_beyond_the_vocabulary_are_refused(model, kwargs, match):
    ids = torch.randint(0, MASK_ID, (1, 4))
    for mode in ("sbd", "ntp"):
        with pytest.raises(ValueError, match=match):
            generate(model, ids, max_new_tokens=3, mode=mode, **kwargs)


def test_first_from_ntp_needs_sbd():
    with pytest.raises(ValueError, match="first_from_ntp.*mode='sbd'"):
        GenerationSettings(mode="ntp", first_from_ntp=True)


def test_string_threshold_refused_by_the_reference_sampler():
    t = torch.full((1, 3), 9)
    args = (torch.tensor([[1, 2, 3]]), torch.zeros(1, 3), torch.ones(1, 3), 9, "eb")
    with pytest.raises(ValueError, match="threshold must be a number"):
        reference.mask_replace(t, *args, "0.5")


@pytest.mark.parametrize(
    "rng,match",
    [((float("nan"), 4), "two ints"), ([16, 2], "k_min <= k_max"), ([0], "two ints"), ("ab", "two ints")],
)
def test_bad_block_range_in_the_config_is_a_clear_error(rng, match):
    """A range written into the config by hand (or a bad JSON file): get_sbd_metadata names the field (before:
    "cannot convert float NaN to integer", an IndexError, or [16, 2] read as is)."""
    m = tiny_llama(seed=0)
    m.config.sbd_block_size_range = list(rng) if not isinstance(rng, str) else rng
    with pytest.raises(ValueError, match=f"sbd_block_size_range is invalid.*{match}"):
        get_sbd_metadata(m)
    with pytest.raises(ValueError, match="sbd_block_size_range"):
        generate(m, torch.randint(0, MASK_ID, (1, 4)), max_new_tokens=2)


def test_mask_token_in_config_must_be_an_id():
    m = tiny_llama(seed=0)
    m.config.mask_token_id = -3
    with pytest.raises(ValueError, match="mask_token_id must be a token id"):
        get_sbd_metadata(m)
