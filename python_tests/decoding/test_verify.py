"""Lossless SBD (``generate(..., verify=True)``): the output equals the model's own next-token decoding
(``mode="ntp"``) token for token, greedy and sampled, whatever k, sampler and gamma; the cache stays exact."""

from __future__ import annotations

import pytest
import torch
from sbd_models import (
    MASK_ID,
    random_prompts,
    single_thread,  # noqa: F401  (fixture)
    tiny_llama,
)
from transformers import DynamicCache
from utils import assert_close

from sbd_ext.decoding import SBDCache, generate, generate_reference

pytestmark = pytest.mark.usefixtures("single_thread")


CASES = [
    (1, "eb", 0.0),
    (2, "eb", 0.35),
    (3, "entropy", 0.5),
    (5, "confidence", 0.5),
    (8, "eb", 5.0),
    (16, "eb", 0.1),
    (16, "entropy", 2.0),
]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("k,sampler,gamma", CASES)
def test_verify_equals_ntp(models, k, sampler, gamma, temperature):
    """Ragged batch, EOS and the max_new_tokens budget: identical sequences to mode="ntp" with the same seed."""
    for i, m in enumerate(models):
        ids, mask = random_prompts([3, 9, 6], seed=10 + i)
        kw = dict(max_new_tokens=21, eos_token_id=[7, 11], seed=5, temperature=temperature)
        ntp = generate(m, ids, mask, mode="ntp", **kw)
        ver = generate(m, ids, mask, block_size=k, sampler=sampler, threshold=gamma, verify=True, **kw)
        assert torch.equal(ver.sequences, ntp.sequences), (i, ver.sequences, ntp.sequences)
        assert torch.equal(ver.num_generated, ntp.num_generated)
        assert torch.equal(ver.num_accepted + ver.num_corrected, ver.num_generated)


def test_verify_corrects_often_and_rolls_back(models):
    """A random model's block guesses are mostly wrong: many corrections (so the rollback path runs many times),
    yet the output is NTP's, and the trace lists exactly the output's generated positions."""
    m = models[0]
    ids, mask = random_prompts([4, 8], seed=3)
    kw = dict(max_new_tokens=40, eos_token_id=[])
    ntp = generate(m, ids, mask, mode="ntp", **kw)
    ver = generate(m, ids, mask, block_size=8, threshold=1.0, verify=True, **kw)
    assert torch.equal(ver.sequences, ntp.sequences)
    assert (ver.num_corrected >= 8).all(), ver.num_corrected
    for b in range(2):
        p, n = int(ver.prompt_lengths[b]), int(ver.num_generated[b])
        positions = sorted(q for _, pos, _ in ver.trace[b] for q in pos)
        assert positions == list(range(p, p + n))
        row = ver.sequences[b].tolist()
        assert all(row[q] == t for _, pos, tok in ver.trace[b] for q, t in zip(pos, tok, strict=True))
        assert set(ver.corrections[b]) <= set(positions) and len(ver.corrections[b]) == int(ver.num_corrected[b])


@pytest.mark.parametrize("k", [2, 5])
def test_verify_cache_equals_causal_prefill(models, k):
    """After a verified generation (with rollbacks) every cached row equals a fresh causal prefill of the output,
    and nothing past a sequence's length was read as valid."""
    m = models[1]
    ids, mask = random_prompts([5, 11, 8], seed=4)
    out = generate(m, ids, mask, block_size=k, threshold=1.0, max_new_tokens=17, verify=True, return_cache=True)
    cache = out.past_key_values
    assert isinstance(cache, SBDCache) and out.num_corrected.sum() > 0
    m.set_attn_implementation("sdpa")
    try:
        for b in range(ids.shape[0]):
            p, n = int(out.prompt_lengths[b]), int(out.num_generated[b])
            L = cache.seq_lens[b]
            assert p <= L <= p + n
            ref = DynamicCache(config=m.config)
            with torch.no_grad():
                m(out.sequences[b : b + 1, :L], past_key_values=ref, use_cache=True)
            for i, (layer, ref_layer) in enumerate(zip(cache.layers, ref.layers, strict=True)):
                assert_close(layer.keys[b, :, :L], ref_layer.keys[0], atol=1e-5, rtol=1e-5, msg=f"seq {b} layer {i} K")
                assert_close(layer.values[b, :, :L], ref_layer.values[0], atol=1e-5, rtol=1e-5, msg=f"V {b} {i}")
    finally:
        m.set_attn_implementation("sbd")


def test_verify_bad_input(models):
    ids = torch.randint(0, MASK_ID, (1, 4))
    with pytest.raises(ValueError, match="verify=True .* needs mode='sbd'"):
        generate(models[0], ids, mode="ntp", verify=True, max_new_tokens=4)
    with pytest.raises(TypeError, match="verify must be a bool"):
        generate(models[0], ids, verify=1, max_new_tokens=4)
    with pytest.raises(ValueError, match="generate_reference has no verify mode"):
        generate_reference(models[0], ids, verify=True, max_new_tokens=4)


def test_ntp_mode_noise_is_keyed_by_position(models):
    """NTP mode's sample at position p of row b uses Philox offset position_key(b, p): a sequence's sampled output
    does not depend on the other sequences of the batch (the stream of verify mode's checks is the same)."""
    m = models[0]
    ids, mask = random_prompts([6, 6], seed=8)
    kw = dict(mode="ntp", max_new_tokens=12, eos_token_id=[], temperature=1.0, seed=9)
    both = generate(m, ids, mask, **kw).sequences
    other = ids.clone()
    other[1] = torch.randint(0, MASK_ID, (6,), generator=torch.Generator().manual_seed(99))
    swapped = generate(m, other, mask, **kw).sequences
    assert torch.equal(both[0], swapped[0])  # row 0 draws the same noise whatever row 1 holds
    assert not torch.equal(generate(m, ids, mask, **{**kw, "seed": 10}).sequences, both)


@pytest.mark.slow
@pytest.mark.parametrize("task,n", [("arith", 100), ("sort", 100)])
def test_verify_on_embedded_models(task, n):
    """The embedded SBD models on held-out problems: verify mode returns exactly their NTP decoding (greedy), with
    far fewer forwards (the README's eval gives the full-size numbers)."""
    from sbd_ext.demo import models as demo_models
    from sbd_ext.demo import tasks
    from sbd_ext.demo.evaluate import decode, format_prompt

    name = f"sbd-{task}"
    model, tok = demo_models.load(name)
    tmpl = demo_models.demo_info(name).get("prompt_template")
    prompts = [format_prompt(p.prompt, tmpl) for p in tasks.problems("test", n, task=task)]
    ntp = decode(model, tok, prompts, mode="ntp", batch_size=50)
    ver = decode(model, tok, prompts, block_size=8, sampler="eb", threshold=0.1, verify=True, batch_size=50)
    assert ver["token_ids"] == ntp["token_ids"]
    assert sum(ntp["nfe"]) / sum(ver["nfe"]) >= (5.0 if task == "arith" else 3.0)


def test_first_from_ntp_reveals_block_start_from_commit_rows(models):
    """first_from_ntp=True (plain SBD): every block's first token is the next-token choice of the forward that
    committed what precedes it, so the first generated token is always NTP's; without it, the mask head decides."""
    m = models[1]
    ids, mask = random_prompts([4, 7, 5], seed=6)
    kw = dict(max_new_tokens=6, eos_token_id=[], block_size=6, threshold=5.0)
    ntp = generate(m, ids, mask, mode="ntp", max_new_tokens=1, eos_token_id=[])
    on = generate(m, ids, mask, first_from_ntp=True, **kw)
    off = generate(m, ids, mask, **kw)
    for b in range(3):
        p = int(on.prompt_lengths[b])
        assert on.sequences[b, p] == ntp.sequences[b, p]
    assert any(
        off.sequences[b, int(off.prompt_lengths[b])] != ntp.sequences[b, int(ntp.prompt_lengths[b])] for b in range(3)
    )


def test_cli_verify_marks_corrections_and_equals_ntp(capsys):
    """`sbd-ext generate --verify --show-steps` on a held-out sort problem where verification corrects a token:
    the completion is the NTP completion, the corrected token is marked `!`, the summary counts it."""
    from sbd_ext.demo import cli

    common = ["generate", "--model", "sbd-sort", "--example", "4", "--color", "never"]
    assert cli.main([*common, "--mode", "ntp"]) == 0
    ntp_completion = capsys.readouterr().out.split("\n\n")[0]
    args = [*common, "--verify", "--show-steps", "--block-size", "8", "--threshold", "0.35"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.split("\n\n")[0] == ntp_completion
    marks = [line for line in out.splitlines() if line.startswith(" " * 17 + "|")]
    assert sum(line.count("!") for line in marks) == 1
    assert "verified (1 corrections)" in out


def _frequent_ntp_token(m, ids, mask) -> int:
    """The token a model's unbanned NTP decoding generates most often (the mask token of the contract test)."""
    from sbd_ext.decoding import set_sbd_metadata

    set_sbd_metadata(m.config, None, None)
    out = generate(m, ids, mask, mode="ntp", max_new_tokens=24, eos_token_id=[])
    gen = torch.cat([out.sequences[b, int(out.prompt_lengths[b]) :] for b in range(ids.shape[0])])
    return int(torch.mode(gen).values)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_mask_token_is_never_generated(temperature):
    """The contract: the mask token is never generated, in NTP, SBD, verify and the reference decoder. With the
    mask id set to the token NTP decoding would generate most often, verify still equals mode="ntp" (before, NTP
    produced the mask token and verify's sampler filled that position with another token)."""
    m = tiny_llama(seed=3, lm_scale=8.0)
    ids, mask = random_prompts([3, 6, 5], seed=4)
    mask_id = _frequent_ntp_token(m, ids, mask)
    from sbd_ext.decoding import set_sbd_metadata

    set_sbd_metadata(m.config, mask_id, None)
    kw = dict(max_new_tokens=24, eos_token_id=[], temperature=temperature, seed=2)
    outs = {
        "ntp": generate(m, ids, mask, mode="ntp", **kw),
        "ntp_ref": generate_reference(m, ids, mask, mode="ntp", **kw),
        "sbd": generate(m, ids, mask, block_size=4, **kw),
        "sbd_ref": generate_reference(m, ids, mask, block_size=4, **kw),
        "verify": generate(m, ids, mask, block_size=4, threshold=1.0, verify=True, **kw),
    }
    for name, out in outs.items():
        for b in range(ids.shape[0]):
            assert mask_id not in out.sequences[b, int(out.prompt_lengths[b]) :].tolist(), name
    assert torch.equal(outs["verify"].sequences, outs["ntp"].sequences)
    assert torch.equal(outs["ntp_ref"].sequences, outs["ntp"].sequences)
    assert torch.equal(outs["sbd_ref"].sequences, outs["sbd"].sequences)


@pytest.mark.parametrize("seed", range(6))
def test_verify_never_takes_more_forwards_than_ntp(seed):
    """Random (untrained) models, whose block guesses are mostly wrong: verify returns NTP's tokens with, per
    sequence, at most NTP's forwards, whatever k, sampler and threshold (before: up to ~7x more)."""
    m = tiny_llama(seed=100 + seed, lm_scale=[2.0, 4.0, 8.0][seed % 3])
    ids, mask = random_prompts([2, 7, 4, 5], seed=seed)
    for k, sampler, gamma in [(4, "eb", 2.0), (16, "eb", 5.0), (8, "entropy", 1.5), (12, "confidence", 0.05)]:
        for temperature in (0.0, 1.0):
            kw = dict(max_new_tokens=40, eos_token_id=[3], seed=seed, temperature=temperature)
            ntp = generate(m, ids, mask, mode="ntp", **kw)
            ver = generate(m, ids, mask, block_size=k, sampler=sampler, threshold=gamma, verify=True, **kw)
            case = (k, sampler, gamma, temperature)
            assert torch.equal(ver.sequences, ntp.sequences), case
            assert (ver.nfe <= ntp.nfe).all(), (case, ver.nfe, ntp.nfe)


# --------------------------------------------------------------------------------------------------------------
# lookup: drafts from the context (prompt lookup) inside the verify cycle
# --------------------------------------------------------------------------------------------------------------
def _latest_follower(ctx: list[int], n_max: int, n_min: int, m: int) -> list[int]:
    """Brute force: the m tokens after the latest earlier occurrence of ctx's longest final n-gram."""
    for n in range(min(n_max, len(ctx)), n_min - 1, -1):
        suffix = ctx[len(ctx) - n :]
        for s in range(len(ctx) - n - 1, -1, -1):
            if ctx[s : s + n] == suffix:
                return ctx[s + n : s + n + m]
    return []


@pytest.mark.parametrize("n_max,n_min", [(1, 1), (2, 2), (4, 2), (6, 3)])
def test_ngram_index_equals_a_brute_force_search(n_max, n_min):
    """Grown a few tokens at a time (as verify's output grows), over a small alphabet (many repeats), every proposal
    equals a search from scratch."""
    from sbd_ext.decoding.lookup import NgramIndex

    g = torch.Generator().manual_seed(n_max * 10 + n_min)
    for trial in range(4):
        seq = torch.randint(0, 3 + trial, (160,), generator=g).tolist()
        index, L = NgramIndex(n_max, n_min), 1
        while L <= len(seq):
            for m in (0, 1, 3, 7):
                assert index.propose(seq[:L], m) == _latest_follower(seq[:L], n_max, n_min, m), (trial, L, m)
            L += int(torch.randint(1, 5, (1,), generator=g))
    with pytest.raises(ValueError, match="n_min <= n_max"):
        NgramIndex(2, 3)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("k,lookup", [(2, 1), (2, 8), (4, 3), (8, 20), (16, 8)])  # lookup > k - 1: past the block
def test_verify_with_lookup_equals_ntp(models, k, lookup, temperature):
    """Drafts from the context change only how many forwards verify takes: the sequences are NTP's (ragged batch,
    EOS and stop ids, the budget), in at most NTP's forwards."""
    for i, m in enumerate(models):
        ids, mask = random_prompts([3, 9, 6], seed=20 + i)
        kw = dict(max_new_tokens=33, eos_token_id=[7], stop_token_ids=[11], seed=5, temperature=temperature)
        ntp = generate(m, ids, mask, mode="ntp", **kw)
        ver = generate(m, ids, mask, block_size=k, threshold=1.0, verify=True, lookup=lookup, **kw)
        assert torch.equal(ver.sequences, ntp.sequences), (i, ver.sequences, ntp.sequences)
        assert (ver.nfe <= ntp.nfe).all()
        assert torch.equal(ver.num_accepted + ver.num_corrected, ver.num_generated)


@pytest.fixture
def lookup_always_wins(monkeypatch):
    """A random model's block rows are often sure of wrong tokens: let the lookup replace them anyway."""
    import sbd_ext.decoding.state as state

    monkeypatch.setattr(state, "LOOKUP_YIELD_BELOW", 2.0)


def test_lookup_drafts_repeated_text_in_fewer_forwards(models, lookup_always_wins):
    """A random model's greedy output falls into near-loops (9 5 9 5 ..., 8 14 13 38 8 14 13 38 ...): the block
    rows' guesses are mostly wrong, the context's continuation often right, so lookup needs fewer forwards for the
    same tokens (189 -> 160 here)."""
    m = models[0]
    ids, mask = random_prompts([4, 8], seed=3)
    kw = dict(max_new_tokens=96, eos_token_id=[], block_size=8, threshold=100.0, verify=True)
    plain = generate(m, ids, mask, **kw)
    looked = generate(m, ids, mask, lookup=4, **kw)
    assert torch.equal(looked.sequences, plain.sequences)
    assert int(looked.nfe.sum()) < 0.9 * int(plain.nfe.sum()), (looked.nfe, plain.nfe)


def test_lookup_drafts_past_the_block_and_the_static_steps_cap(lookup_always_wins):
    """On a looping output the lookup's drafts run past the block (a forward commits more than k rows); a step with
    ``max_drafts`` (the CUDA static step's 2k rows: k drafts) caps them at k. Same tokens either way."""
    from sbd_ext.decoding.step import EagerStep

    m = tiny_llama(seed=0, lm_scale=8.0)
    ids, mask = random_prompts([4, 8], seed=3)
    kw = dict(max_new_tokens=96, eos_token_id=[], block_size=4, threshold=100.0, verify=True, lookup=16)
    seen: dict[str, list[int]] = {"free": [], "capped": []}

    def recording(name, cap):
        class Step(EagerStep):
            max_drafts = cap

            def __call__(self, fw):
                seen[name].append(max(fw.n_commit))
                return super().__call__(fw)

        return Step

    free = generate(m, ids, mask, step_cls=recording("free", None), **kw)
    capped = generate(m, ids, mask, step_cls=recording("capped", 4), **kw)
    ntp = generate(m, ids, mask, mode="ntp", max_new_tokens=96, eos_token_id=[])
    assert torch.equal(free.sequences, ntp.sequences) and torch.equal(capped.sequences, ntp.sequences)
    assert max(seen["free"][1:]) > 4  # after the prefill: more drafts than the block
    assert max(seen["capped"][1:]) <= 4


def test_lookup_bad_input(models):
    ids = torch.randint(0, MASK_ID, (1, 4))
    for bad in (-1, 2**16 + 1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="lookup must be an int in"):
            generate(models[0], ids, verify=True, lookup=bad, max_new_tokens=4)


def test_lookup_does_nothing_outside_verify(models):
    """Plain SBD and NTP never take unchecked drafts from the context: lookup leaves their output as it is."""
    m = models[0]
    ids, mask = random_prompts([4, 8], seed=3)
    for kw in (dict(block_size=4, threshold=1.0), dict(mode="ntp")):
        kw |= dict(max_new_tokens=40, eos_token_id=[])
        a, b = generate(m, ids, mask, **kw), generate(m, ids, mask, lookup=4, **kw)
        assert torch.equal(a.sequences, b.sequences) and torch.equal(a.nfe, b.nfe)


def test_lookup_from_the_generation_config(models):
    """``sbd_lookup`` in the model's generation config is the default lookup (a checkpoint's recommended setting)."""
    m = models[1]
    ids, mask = random_prompts([5, 7], seed=6)
    kw = dict(max_new_tokens=40, eos_token_id=[], block_size=8, threshold=100.0, verify=True)
    want = generate(m, ids, mask, lookup=3, **kw)
    m.generation_config.sbd_lookup = 3
    try:
        got = generate(m, ids, mask, **kw)
        assert not torch.equal(generate(m, ids, mask, **kw, lookup=0).nfe, want.nfe)  # a keyword overrides it
    finally:
        del m.generation_config.sbd_lookup
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.nfe, want.nfe)


def test_lookup_yields_to_a_sure_block_slot(models):
    """Per slot, a lookup proposal replaces the block's token unless the block is sure of a different one (its
    probability >= LOOKUP_YIELD_BELOW): from there the block's own tokens stay and nothing runs past the block. (A
    task drafter's sure slots beat a context match; a chat drafter's unsure ones do not.)"""
    from sbd_ext.decoding.settings import GenerationSettings, make_job
    from sbd_ext.decoding.state import LOOKUP_YIELD_BELOW, SequenceState

    prompt = [5, 6, 7, 8, 5, 6]  # after "5 6 7" the context continues "8 5 6 ..."
    ids = torch.tensor([prompt])
    job = make_job(models[0], ids, None, GenerationSettings(verify=True, lookup=8, block_size=4, max_new_tokens=50))
    sure, unsure = max(LOOKUP_YIELD_BELOW, 0.9), LOOKUP_YIELD_BELOW / 2
    cases = [
        ([1.0, sure, unsure, unsure], [7, 9, 9, 9], []),  # slot 1 sure of 9: the block's tokens
        ([1.0, unsure, sure, unsure], [7, 8, 9, 9], []),  # slot 2 sure of 9: lookup up to slot 1 only
        ([1.0, sure, unsure, unsure], [7, 8, 5, 6], [7, 8, 5, 6, 7]),  # (block 7 8 ..) sure and agreeing: on
        ([1.0, unsure, unsure, unsure], [7, 8, 5, 6], [7, 8, 5, 6, 7]),  # unsure everywhere: lookup, past the block
        (None, [7, 8, 5, 6], [7, 8, 5, 6, 7]),  # no confidence given: lookup
    ]
    for confidence, want_block, want_all in cases:
        block = [7, 8 if want_all and confidence and confidence[1] == sure else 9, 9, 9]
        seq = SequenceState(list(prompt), job)
        extra = seq._draft_from_context(block, 4, confidence)
        assert block == want_block, (confidence, block)
        assert block + extra == (want_all or want_block), (confidence, extra)


def test_lookup_cap_doubles_in_a_streak_and_resets_after_a_miss(models):
    """The lookup's drafts per cycle start at LOOKUP_START (a row of the next forward each), double after a cycle
    whose lookup drafts filled the cap and were all accepted (up to ``lookup``), and are back to the start after a
    rejected lookup draft; a miss in the block's own tokens, or a short proposal, leaves the cap."""
    from sbd_ext.decoding.settings import GenerationSettings, make_job
    from sbd_ext.decoding.state import LOOKUP_START, SequenceState

    prompt = [5, 6, 7, 8] * 10  # the context repeats: the lookup proposes "5 6 7 8 ..." as far as it may
    settings = GenerationSettings(verify=True, lookup=16, block_size=2, max_new_tokens=200)
    job = make_job(models[0], torch.tensor([prompt]), None, settings)
    seq = SequenceState(list(prompt), job)
    assert seq.lookup_cap == LOOKUP_START == 4

    def cycle(looked: int, wrong_at: int | None = None) -> int:
        """Drafts: slot 0, then ``looked`` lookup tokens, then one of the block's own; the NTP choices agree up to
        ``wrong_at`` (an index into the drafts). Returns the cap after their check."""
        seq.gen, seq.n_looked = [], looked
        drafts = [9] + [10 + i for i in range(looked)] + [99]
        seq.pending, seq.n_draft = list(drafts), len(drafts)
        ntp = drafts[1:] + [42]  # ntp[r]: the choice after row r, which checks draft r + 1
        if wrong_at is not None:
            ntp[wrong_at - 1] = 77
        seq._verify(0, ntp)
        return seq.lookup_cap

    assert cycle(4) == 8 and cycle(8) == 16 and cycle(16) == 16  # a streak: doubled, bounded by lookup
    assert cycle(16, wrong_at=17) == 16  # the block's own token (after the lookup's) was wrong: no change
    assert cycle(16, wrong_at=3) == 4  # a lookup draft was wrong: back to the start
    assert cycle(3) == 4  # a shorter proposal than the cap, all right: no change
    # the cap bounds the proposal: slot 1 and 3 more past the block at cap 4, recorded as the lookup's
    seq.gen, seq.pending, seq.n_draft = [], [], 0
    block = [5, 0]
    extra = seq._draft_from_context(block, 2, None)
    assert block == [5, 6] and extra == [7, 8, 5] and seq.n_looked == 4
