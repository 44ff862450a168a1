"""SBD / NTP decoding: the exact cache, equality with the no-cache reference decoder, batching, EOS, the trace,
and clear errors on bad input."""

from __future__ import annotations

import pytest
import torch
from sbd_models import (
    MASK_ID,
    VOCAB,
    random_prompts,
    single_thread,  # noqa: F401  (fixture)
    tiny_llama,
)
from transformers import DynamicCache
from utils import assert_close

import sbd_ext
import sbd_ext.hf
from sbd_ext.decoding import SBDCache, generate, generate_reference, set_sbd_metadata

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(
        not sbd_ext.hf.kernel_available(torch.device("cpu")), reason="the block_attention CPU kernel is not built"
    ),
]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2, attn="sbd")


def _generated(out, b):
    p, n = int(out.prompt_lengths[b]), int(out.num_generated[b])
    return out.sequences[b, p : p + n].tolist()


def _check_output_invariants(out, prompts_ids, prompts_mask, max_new):
    """Shapes, prompt copy, padding, nfe/trace consistency: properties every run must have."""
    B = out.sequences.shape[0]
    for b in range(B):
        prompt = prompts_ids[b][prompts_mask[b].bool()].tolist()
        p, n = int(out.prompt_lengths[b]), int(out.num_generated[b])
        assert p == len(prompt) and out.sequences[b, :p].tolist() == prompt
        assert 1 <= n <= max_new
        assert int(out.nfe[b]) >= 1 and len(out.trace[b]) == int(out.nfe[b])
        assert out.tokens_per_forward[b].item() == pytest.approx(n / int(out.nfe[b]))
        shown = {}
        forwards = [t[0] for t in out.trace[b]]
        assert forwards == list(range(len(forwards)))  # a sequence takes part in every forward until it stops
        for _, positions, tokens in out.trace[b]:
            assert len(positions) == len(tokens)
            for pos, tok in zip(positions, tokens, strict=True):
                assert pos not in shown
                shown[pos] = tok
        assert shown == {p + i: t for i, t in enumerate(_generated(out, b))}  # each kept position revealed once


# ---------------------------------------------------------------------------------------------------------------
# the exact cache
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,block_size", [("sbd", 4), ("sbd", 1), ("ntp", 1)])
def test_cache_equals_causal_prefill_of_final_sequence(model, mode, block_size):
    ids, mask = random_prompts([5, 11, 8], seed=3)
    out = generate(
        model, ids, mask, block_size=block_size, threshold=1.0, max_new_tokens=14, mode=mode, return_cache=True
    )
    cache = out.past_key_values
    assert isinstance(cache, SBDCache)
    model.set_attn_implementation("sdpa")
    try:
        for b in range(ids.shape[0]):
            p, n = int(out.prompt_lengths[b]), int(out.num_generated[b])
            L = cache.seq_lens[b]
            # Everything but the last block (SBD) / the last token (NTP) was committed; nothing else was stored.
            last = n - (n - 1) // block_size * block_size if mode == "sbd" else 1
            assert L == p + n - last
            seq = out.sequences[b : b + 1, :L]
            ref = DynamicCache(config=model.config)
            with torch.no_grad():
                model(seq, past_key_values=ref, use_cache=True)
            for i, (layer, ref_layer) in enumerate(zip(cache.layers, ref.layers, strict=True)):
                assert_close(layer.keys[b, :, :L], ref_layer.keys[0], atol=1e-5, rtol=1e-5, msg=f"seq {b} layer {i} K")
                assert_close(layer.values[b, :, :L], ref_layer.values[0], atol=1e-5, rtol=1e-5, msg=f"V {b} {i}")
                assert not layer.keys[b, :, L:].any()  # mask slots were never stored
    finally:
        model.set_attn_implementation("sbd")


# ---------------------------------------------------------------------------------------------------------------
# cached decoder == no-cache reference decoder
# ---------------------------------------------------------------------------------------------------------------
SAMPLER_THRESHOLDS = {"eb": 1.0, "entropy": 0.5, "confidence": 0.7}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("sampler", ["eb", "entropy", "confidence"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_matches_reference_decoder(model, block_size, sampler, temperature):
    ids, mask = random_prompts([6, 3], seed=block_size)
    kw = dict(
        block_size=block_size,
        sampler=sampler,
        threshold=SAMPLER_THRESHOLDS[sampler],
        temperature=temperature,
        seed=1234,
        max_new_tokens=19,
    )
    got = generate(model, ids, mask, **kw)
    want = generate_reference(model, ids, mask, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.nfe, want.nfe)
    assert got.trace == want.trace
    _check_output_invariants(got, ids, mask, 19)
    if block_size > 1:
        assert (got.tokens_per_forward > 1).all()  # several positions per forward, not NTP in disguise


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 1)])
def test_matches_reference_decoder_gqa_ratios(n_heads, n_kv_heads):
    m = tiny_llama(n_heads=n_heads, n_kv_heads=n_kv_heads, layers=3, seed=2)
    ids, mask = random_prompts([9, 4, 6], seed=6)
    kw = dict(block_size=5, threshold=1.0, max_new_tokens=17)
    got, want = generate(m, ids, mask, **kw), generate_reference(m, ids, mask, **kw)
    assert torch.equal(got.sequences, want.sequences) and got.trace == want.trace


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_ntp_matches_reference_decoder(model, temperature):
    ids, mask = random_prompts([4, 7], seed=5)
    kw = dict(mode="ntp", temperature=temperature, seed=7, max_new_tokens=12)
    got, want = generate(model, ids, mask, **kw), generate_reference(model, ids, mask, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert got.trace == want.trace
    assert (got.nfe == 12).all() and (got.tokens_per_forward == 1).all()


def test_sampled_differs_from_greedy_and_depends_on_seed(model):
    ids, mask = random_prompts([6], seed=2)
    kw = dict(block_size=4, max_new_tokens=16)
    greedy = generate(model, ids, mask, **kw).sequences
    hot = [generate(model, ids, mask, temperature=1.5, seed=s, **kw).sequences for s in (0, 0, 1)]
    assert torch.equal(hot[0], hot[1])  # reproducible from the seed
    # Both must hold: a decoder that ignored the seed (hot[0] == hot[2]) or the temperature (hot[0] == greedy)
    # fails. At T = 1.5 over 16 tokens neither coincidence happens for this model (checked: all 3 runs differ).
    assert not torch.equal(hot[0], hot[2]), "the seed changed nothing"
    assert not torch.equal(hot[0], greedy), "sampling at temperature 1.5 gave the greedy sequence"


# ---------------------------------------------------------------------------------------------------------------
# batching
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,block_size", [("sbd", 4), ("sbd", 16), ("ntp", 1)])
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_batch_equals_one_at_a_time(model, mode, block_size, padding_side):
    lengths = [3, 12, 7, 1]
    ids, mask = random_prompts(lengths, seed=11, padding_side=padding_side)
    kw = dict(block_size=block_size, threshold=1.0, max_new_tokens=15, mode=mode)
    batch = generate(model, ids, mask, **kw)
    _check_output_invariants(batch, ids, mask, 15)
    for b in range(len(lengths)):
        row = ids[b : b + 1][mask[b : b + 1].bool()].view(1, -1)
        single = generate(model, row, **kw)
        assert _generated(batch, b) == _generated(single, 0), f"sequence {b}"
        assert int(batch.nfe[b]) == int(single.nfe[0])
        assert batch.trace[b] == single.trace[0]


def test_sequences_stop_independently(model):
    """Different budgets of progress: one sequence stops at EOS early while the others continue."""
    ids, mask = random_prompts([5, 5, 5], seed=21)
    free = generate(model, ids, mask, block_size=4, threshold=1.0, max_new_tokens=16, eos_token_id=[])
    eos = _generated(free, 0)[2]  # a token sequence 0 produces early
    out = generate(model, ids, mask, block_size=4, threshold=1.0, max_new_tokens=16, eos_token_id=eos, pad_token_id=0)
    for b in range(3):
        g_free, g = _generated(free, b), _generated(out, b)
        cut = g_free.index(eos) + 1 if eos in g_free else len(g_free)
        assert g == g_free[:cut], f"sequence {b}"
        assert out.sequences[b, int(out.prompt_lengths[b]) + len(g) :].eq(0).all()  # right-padded with pad id
    assert int(out.num_generated[0]) <= 3 < int(out.num_generated.max())


# ---------------------------------------------------------------------------------------------------------------
# NTP mode == HF generate
# ---------------------------------------------------------------------------------------------------------------
def test_ntp_equals_hf_generate(model):
    ids, mask = random_prompts([6, 9], seed=4)
    free = generate(model, ids, mask, mode="ntp", max_new_tokens=20, eos_token_id=[])
    eos = _generated(free, 1)[10]
    out = generate(model, ids, mask, mode="ntp", max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    try:
        for b in range(2):
            row = ids[b : b + 1][mask[b : b + 1].bool()].view(1, -1)
            hf = model.generate(
                row,
                max_new_tokens=20,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=0,
                suppress_tokens=[model.config.mask_token_id],  # the mask token is never generated
            )
            hf_gen = hf[0, row.shape[1] :].tolist()
            if eos in hf_gen:
                hf_gen = hf_gen[: hf_gen.index(eos) + 1]
            assert _generated(out, b) == hf_gen, f"sequence {b}"
            assert int(out.nfe[b]) == len(hf_gen)
    finally:
        model.set_attn_implementation("sbd")


# ---------------------------------------------------------------------------------------------------------------
# EOS inside a block
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_eos_truncates_and_waits_for_earlier_positions(model, block_size):
    ids, mask = random_prompts([7], seed=8)
    kw = dict(block_size=block_size, threshold=1.0, max_new_tokens=24)
    free = generate(model, ids, mask, eos_token_id=[], **kw)
    g = _generated(free, 0)
    eos = g[len(g) // 2]
    out = generate(model, ids, mask, eos_token_id=eos, **kw)
    cut = g.index(eos) + 1
    assert _generated(out, 0) == g[:cut]
    # It stopped at the first forward after which every position up to the first EOS was revealed.
    revealed_at = {pos: f for f, positions, _ in free.trace[0] for pos in positions}
    p = int(free.prompt_lengths[0])
    assert int(out.nfe[0]) == 1 + max(revealed_at[p + i] for i in range(cut))
    assert out.trace[0] == [
        (f, [q for q in pos if q < p + cut], [t for q, t in zip(pos, tok, strict=True) if q < p + cut])
        for f, pos, tok in free.trace[0][: int(out.nfe[0])]
    ]
    # stop_token_ids acts like an EOS id
    other = generate(model, ids, mask, eos_token_id=[], stop_token_ids=[eos], **kw)
    assert torch.equal(other.sequences, out.sequences)


def test_budget_not_multiple_of_block(model):
    ids, mask = random_prompts([4, 6], seed=9)
    out = generate(model, ids, mask, block_size=8, threshold=1.0, max_new_tokens=13)
    assert (out.num_generated == 13).all()
    assert out.sequences.shape[1] == 6 + 13


def test_default_eos_from_generation_config(model):
    ids, mask = random_prompts([5], seed=12)
    free = generate(model, ids, mask, block_size=4, threshold=1.0, max_new_tokens=16)
    eos = _generated(free, 0)[5]
    model.generation_config.eos_token_id = eos
    try:
        out = generate(model, ids, mask, block_size=4, threshold=1.0, max_new_tokens=16)
    finally:
        model.generation_config.eos_token_id = None
    g = _generated(free, 0)
    assert _generated(out, 0) == g[: g.index(eos) + 1]


def test_switches_attn_implementation_once_with_a_warning():
    """A model loaded with "sdpa" is switched to "sbd" for good (a per-call switch would race between threads),
    with a warning the first time only."""
    m = tiny_llama(attn="sdpa")
    ids, mask = random_prompts([5], seed=1)
    with pytest.warns(UserWarning, match="switched LlamaForCausalLM from attn_implementation='sdpa' to 'sbd'"):
        generate(m, ids, mask, block_size=4, max_new_tokens=6)
    assert m.config._attn_implementation == "sbd"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(m, ids, mask, block_size=4, max_new_tokens=6)
    assert sbd_ext.generate is generate


def test_concurrent_generate_on_one_model():
    """Four threads decoding different prompts on ONE model (loaded with "sdpa") each get exactly what a
    single-threaded call gives (a per-call switch to "sbd" and back would break the others)."""
    import threading

    m = tiny_llama(attn="sdpa")
    prompts = [random_prompts([3 + i, 6], seed=10 + i) for i in range(4)]
    kw = dict(block_size=4, threshold=0.5, max_new_tokens=24, eos_token_id=[])
    results, errors = [None] * 4, []

    def work(i):
        try:
            for _ in range(3):
                results[i] = generate(m, *prompts[i], **kw).sequences
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    with pytest.warns(UserWarning, match="switched"):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    for i in range(4):
        assert torch.equal(results[i], generate(m, *prompts[i], **kw).sequences)


def test_bfloat16_runs(model):
    m = tiny_llama(dtype=torch.bfloat16)
    ids, mask = random_prompts([5, 8], seed=1)
    out = generate(m, ids, mask, block_size=4, max_new_tokens=10)
    _check_output_invariants(out, ids, mask, 10)


# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------
def test_error_no_mask_token():
    m = tiny_llama(mask_id=None)
    ids = torch.randint(0, MASK_ID, (1, 4))
    with pytest.raises(ValueError, match="mask_token_id"):
        generate(m, ids, max_new_tokens=4)
    generate(m, ids, max_new_tokens=4, mode="ntp")  # NTP needs no mask token


def test_error_untrained_block_size():
    m = tiny_llama()
    set_sbd_metadata(m.config, MASK_ID, (2, 16))
    ids = torch.randint(0, MASK_ID, (1, 4))
    for k in (1, 17):
        with pytest.raises(ValueError, match=r"trained with .*\[2, 16\]"):
            generate(m, ids, block_size=k, max_new_tokens=4)
    generate(m, ids, block_size=1, max_new_tokens=4, strict_block_size=False)
    generate(m, ids, block_size=16, max_new_tokens=4)


def test_error_overflow(model):
    ids = torch.randint(0, MASK_ID, (1, 250))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, ids, max_new_tokens=7)
    cache = SBDCache(model.config, batch_size=2, max_cache_len=8)
    with pytest.raises(ValueError, match="overflow"):
        with cache.forward_plan([3, 9], [3, 9]):
            pass


def test_batch_view_forward_writes_the_parent_cache(model):
    """A forward over ``cache.batch_view(1, 3)`` appends into rows 1-2 of the parent's buffers (row 0 and 3
    untouched) and gives the logits a batch-2 cache of its own gives."""
    torch.manual_seed(0)
    ids = torch.randint(0, MASK_ID, (2, 6))
    pos = torch.arange(6)[None].expand(2, 6)
    parent = SBDCache(model.config, batch_size=4, max_cache_len=16)
    alone = SBDCache(model.config, batch_size=2, max_cache_len=16)
    view = parent.batch_view(1, 3)
    outs = []
    for cache in (view, alone):
        with torch.no_grad(), cache.forward_plan([4, 5], [6, 6]) as plan:
            outs.append(model(input_ids=ids, position_ids=pos, past_key_values=cache, sbd_plan=plan).logits)
    assert torch.equal(outs[0], outs[1])
    assert view.seq_lens == [4, 5] and parent.seq_lens == [0, 0, 0, 0]
    for pl, al in zip(parent.layers, alone.layers, strict=True):
        assert torch.equal(pl.keys[1:3], al.keys) and torch.equal(pl.values[1:3], al.values)
        assert not pl.keys[0].any() and not pl.keys[3].any()
    with pytest.raises(ValueError, match="batch_view"):
        parent.batch_view(2, 5)


@pytest.mark.parametrize(
    "ids,mask,match",
    [
        (torch.zeros(1, 0, dtype=torch.int64), None, "empty prompt"),
        (torch.zeros(0, 3, dtype=torch.int64), None, "empty prompt"),
        (torch.ones(2, 3, dtype=torch.int64), torch.tensor([[1, 1, 1], [0, 0, 0]]), "all padding"),
        (torch.ones(1, 3, dtype=torch.int64), torch.tensor([[1, 0, 1]]), "contiguous"),
        (torch.ones(1, 3, dtype=torch.int64), torch.tensor([[1, 2, 1]]), "only 0"),
        (torch.ones(1, 3, dtype=torch.int64), torch.ones(1, 4, dtype=torch.int64), "shape"),
        (torch.ones(3, dtype=torch.int64), None, "2-D"),
        (torch.full((1, 3), VOCAB, dtype=torch.int64), None, "outside"),
    ],
)
def test_error_bad_prompt(model, ids, mask, match):
    with pytest.raises(ValueError, match=match):
        generate(model, ids, mask, max_new_tokens=4)


def test_error_bad_types_and_devices(model):
    ids = torch.randint(0, MASK_ID, (1, 4))
    with pytest.raises(TypeError, match="integer"):
        generate(model, ids.float(), max_new_tokens=4)
    with pytest.raises(TypeError, match="attention_mask"):
        generate(model, ids, torch.ones(1, 4), max_new_tokens=4)
    with pytest.raises(ValueError, match="is on meta"):
        generate(model, ids.to("meta"), max_new_tokens=4)
    with pytest.raises(TypeError, match="torch.Tensor"):
        generate(model, [[1, 2, 3]], max_new_tokens=4)
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        generate(tiny_llama(dtype=torch.float64), ids, max_new_tokens=4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sampler="topk"), "sampler"),
        (dict(mode="ar"), "mode"),
        (dict(block_size=0), "block_size"),
        (dict(threshold=-0.1), "gamma"),
        (dict(threshold=float("nan")), "threshold"),
        (dict(temperature=-1.0), "temperature"),
        (dict(max_new_tokens=0), "max_new_tokens"),
    ],
)
@pytest.mark.parametrize("mode", ["sbd", "ntp"])
def test_error_bad_arguments(model, kwargs, match, mode):
    """Settings are validated whatever the mode: NTP mode refuses bad SBD arguments too."""
    ids = torch.randint(0, MASK_ID, (1, 4))
    kwargs = {"max_new_tokens": 4, "mode": mode, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(model, ids, **kwargs)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(eos_token_id="12"), TypeError, "eos_token_id must be an int or a list"),
        (dict(eos_token_id=["1", 2]), ValueError, "eos_token_id must hold token ids"),
        (dict(eos_token_id=[-1]), ValueError, "eos_token_id"),
        (dict(eos_token_id=1.0), TypeError, "eos_token_id"),
        (dict(stop_token_ids="3"), TypeError, "stop_token_ids"),
        (dict(eos_token_id=torch.tensor([1.0])), TypeError, "eos_token_id"),
        (dict(pad_token_id=-2), ValueError, "pad_token_id"),
        (dict(seed=2**63), ValueError, "seed"),
        (dict(seed=1.5), ValueError, "seed"),
        (dict(block_size=True), ValueError, "block_size"),
        (dict(threshold="0.1"), ValueError, "threshold"),
        (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(strict_block_size=1), TypeError, "strict_block_size"),
        (dict(max_new_tokens=2.0), ValueError, "max_new_tokens"),
        (dict(blocksize=4), TypeError, "unknown generation setting"),
    ],
)
def test_error_bad_settings(model, kwargs, exc, match):
    ids = torch.randint(0, MASK_ID, (1, 4))
    for mode in ("sbd", "ntp"):
        with pytest.raises(exc, match=match):
            generate(model, ids, **{"max_new_tokens": 4, "mode": mode, **kwargs})


def test_generation_settings_object(model):
    """One validated, frozen object: defaults resolved, keyword overrides on top, equal results either way."""
    import dataclasses

    from sbd_ext.decoding import DEFAULT_THRESHOLDS, GenerationSettings

    st = GenerationSettings(block_size=4, sampler="confidence", eos_token_id=[3, 5], max_new_tokens=12)
    assert st.threshold == DEFAULT_THRESHOLDS["confidence"] and st.eos_token_id == (3, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.block_size = 8
    assert GenerationSettings.of(st, threshold=0.95).threshold == 0.95 and st.threshold == 0.9
    ids, mask = random_prompts([4, 7], seed=2)
    a = generate(model, ids, mask, st).sequences
    b = generate(model, ids, mask, block_size=4, sampler="confidence", eos_token_id=[3, 5], max_new_tokens=12)
    assert torch.equal(a, b.sequences)
    with pytest.raises(TypeError, match="GenerationSettings"):
        generate(model, ids, mask, {"block_size": 4})


def test_error_nan_logits():
    m = tiny_llama()
    with torch.no_grad():
        m.lm_head.weight[3, 0] = float("nan")
    ids = torch.randint(0, MASK_ID, (1, 4))
    with pytest.raises(RuntimeError, match="revealed no token"):
        generate(m, ids, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="invalid next-token"):
        generate(m, ids, max_new_tokens=4, mode="ntp")


def test_cache_under_a_read_only_max_cache_len(model, monkeypatch):
    # transformers 5.17 (the GPU image's) defines Cache.max_cache_len as a read-only, deprecated property, so an
    # SBDCache that assigned the attribute could not be built there.
    from transformers.cache_utils import Cache

    monkeypatch.setattr(Cache, "max_cache_len", property(lambda self: self.get_max_length()), raising=False)
    cache = SBDCache(model.config, batch_size=2, max_cache_len=16)
    assert cache.max_cache_len == 16 and cache.layers[0].keys.shape[2] == 16


def test_error_cache_misuse(model):
    cache = SBDCache(model.config, batch_size=1, max_cache_len=16)
    ids = torch.randint(0, MASK_ID, (1, 4))
    with pytest.raises(RuntimeError, match="forward_plan"):
        with torch.no_grad():
            model(ids, past_key_values=cache)
    model.set_attn_implementation("sdpa")  # the plan never reaches an attention that is not "sbd"
    try:
        with pytest.raises(RuntimeError, match="reached the attention function of 0 of 2 layers"):
            with torch.no_grad(), cache.forward_plan([4], [4]) as plan:
                model(ids, position_ids=torch.arange(4)[None], past_key_values=cache, sbd_plan=plan)
    finally:
        model.set_attn_implementation("sbd")
    assert cache.seq_lens == [0]  # a failed forward does not advance the lengths
