"""The SBD sampling step (sbd_ext.decoding.sample_block): each sampler obeys its rule, stated here independently of
the kernels and the reference (paper Eq. 8 for EB), checked on random blocks with hypothesis."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sbd_models import single_thread  # noqa: F401  (fixture)

from sbd_ext import reference
from sbd_ext.decoding import sample_block

# A revealed/not-revealed decision this close to the threshold may go either way (the kernel sums in double in
# position order, a restatement in sorted order): the checks accept both sides there.
EPS = 1e-6

pytestmark = pytest.mark.usefixtures("single_thread")


@st.composite
def blocks(draw):
    B = draw(st.integers(1, 3))
    K = draw(st.integers(1, 16))
    V = draw(st.integers(2, 40))
    mask_id = draw(st.integers(0, V - 1))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    # Per-position logit scales from ~flat to ~one-hot: entropies spread over [0, ln V].
    scale = torch.exp(torch.empty(B, K, 1).uniform_(-2.0, 3.0, generator=g))
    logits = torch.randn(B, K, V, generator=g) * scale
    masked = torch.rand(B, K, generator=g) < draw(st.floats(0.2, 1.0))
    known = torch.randint(0, V, (B, K), generator=g)
    known[known == mask_id] = (mask_id + 1) % V
    block = torch.where(masked, torch.full_like(known, mask_id), known)
    return logits, block, mask_id


def _sorted_candidates(cand: list[int], key: list[float]) -> list[int]:
    return sorted(cand, key=lambda j: (key[j], j))


def _check_rule(rule, threshold, before, after, ent, pmax, tok, logits, mask_id):
    B, K = before.shape
    for b in range(B):
        masked = [j for j in range(K) if before[b, j] == mask_id]
        revealed = [j for j in range(K) if before[b, j] == mask_id and after[b, j] != mask_id]
        assert all(after[b, j] == before[b, j] for j in range(K) if j not in revealed)  # others untouched
        if not masked:
            assert revealed == []
            continue
        H = ent[b].double().tolist()
        P = pmax[b].double().tolist()
        for j in revealed:  # the proposal: the argmax with the mask token banned
            assert after[b, j] == tok[b, j] != mask_id
            row = logits[b, j].clone()
            row[mask_id] = float("-inf")
            assert row[tok[b, j]] == row.max()
        assert len(revealed) >= 1  # at least one, always
        if rule == "eb":
            order = _sorted_candidates(masked, H)
            s = len(revealed)
            assert sorted(order[:s]) == revealed, "EB reveals a prefix of the entropy-sorted positions"
            before_last = sum(max(H[j], 0.0) for j in order[: s - 1])
            assert before_last <= threshold + EPS  # sum of all but the last revealed entropy <= gamma
            if s < len(order):
                assert before_last + max(H[order[s - 1]], 0.0) > threshold - EPS  # ... and it is the largest prefix
        elif rule == "entropy":
            best = _sorted_candidates(masked, H)[0]
            for j in masked:
                if abs(H[j] - threshold) > EPS and j != best:
                    assert (j in revealed) == (H[j] < threshold)
            assert best in revealed
        else:
            best = _sorted_candidates(masked, [-p for p in P])[0]
            for j in masked:
                if abs(P[j] - threshold) > EPS and j != best:
                    assert (j in revealed) == (P[j] > threshold)
            assert best in revealed


@settings(max_examples=60, deadline=None)
@given(data=blocks(), rule=st.sampled_from(["eb", "entropy", "confidence"]), threshold=st.floats(0.0, 4.0))
def test_sampler_rules(data, rule, threshold):
    logits, block, mask_id = data
    if rule == "confidence":
        threshold = threshold / 4.0  # tau in [0, 1]
    before = block.clone()
    work = logits.clone()
    n_rev, n_rem, ent, pmax, tok = sample_block(work, block, mask_id, rule, threshold)
    assert torch.isneginf(work[..., mask_id]).all()  # the mask token is banned before proposing
    _check_rule(rule, threshold, before, block, ent, pmax, tok, logits, mask_id)
    masked = before == mask_id
    assert torch.equal(n_rev, (masked & (block != mask_id)).sum(1))
    assert torch.equal(n_rem, (block == mask_id).sum(1))
    # the statistics are those of softmax(logits) with the mask token banned
    ref_ent, ref_pmax, _ = reference.entropy_sample(work.view(-1, work.shape[-1]))
    torch.testing.assert_close(ent.view(-1), ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pmax.view(-1), ref_pmax, atol=1e-6, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(data=blocks(), gamma=st.floats(0.0, 3.0))
def test_eb_reveals_more_with_larger_gamma(data, gamma):
    logits, block, mask_id = data
    small, large = block.clone(), block.clone()
    n_small = sample_block(logits.clone(), small, mask_id, "eb", gamma)[0]
    n_large = sample_block(logits.clone(), large, mask_id, "eb", gamma + 1.0)[0]
    assert (n_large >= n_small).all()


def test_temperature_sampling_layout():
    """Temperature > 0: position j of row b draws Philox row b * K + j at (seed, offset); reproducible."""
    g = torch.Generator().manual_seed(0)
    B, K, V, mask_id = 3, 5, 50, 7
    logits = torch.randn(B, K, V, generator=g) * 2
    block = torch.full((B, K), mask_id)
    a, b2 = block.clone(), block.clone()
    out_a = sample_block(logits.clone(), a, mask_id, "eb", math.inf, temperature=0.9, seed=5, offset=3)
    sample_block(logits.clone(), b2, mask_id, "eb", math.inf, temperature=0.9, seed=5, offset=3)
    assert torch.equal(a, b2) and (a != mask_id).all()  # gamma = inf reveals everything
    banned = logits.clone()
    banned[..., mask_id] = float("-inf")
    _, _, want = reference.entropy_sample(banned.view(B * K, V), 0.9, 5, 3)
    assert torch.equal(out_a[4].view(-1), want)
    assert torch.equal(a.view(-1), want)
    greedy = block.clone()
    sample_block(logits.clone(), greedy, mask_id, "eb", math.inf)
    assert not torch.equal(greedy, a)  # it does sample
