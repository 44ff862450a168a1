"""Verify's alternates (``generate(..., verify=True, branch=True, alternates=A)``): beside the first draft, its A
runners-up are checked in the same forward, each a committed row of its own at the first draft's position (behind the
last verified token, as the branch) with a block behind it. When the correction is one of them, the cycle keeps the
correction, that row's next-token choice and its block's drafts. The output stays NTP's token for token; an
alternate's row is the row NTP computes (bit for bit), and the cache after the forward is the one without them."""

from __future__ import annotations

import copy

import pytest
import torch
from sbd_models import (
    MASK_ID,
    random_drafter,
    random_prompts,
    single_thread,  # noqa: F401  (fixture)
)

import sbd_ext.decoding.state as state
from sbd_ext.decoding import GenerationSettings, SBDCache, generate
from sbd_ext.drafter import gate_rows
from sbd_ext.linear import use_row_linear

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def taken(monkeypatch):
    """Counts the cycles that drafted from an alternate (the path under test must run)."""
    count = [0]
    real = state.SequenceState._take_alternate

    def spy(self, *args, **kw):
        count[0] += 1
        return real(self, *args, **kw)

    monkeypatch.setattr(state.SequenceState, "_take_alternate", spy)
    return count


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("k,lookup,A", [(2, 0, 3), (2, 4, 8), (3, 0, 2), (4, 5, 1)])
def test_alternates_equal_ntp(models, taken, k, lookup, A, temperature):
    """Ragged batch, EOS and stop ids, the budget, lookup past the block: the sequences are NTP's, in at most NTP's
    forwards and at most the branch's; every generated position is in the trace exactly once."""
    fewer = 0
    for i, m in enumerate(models):
        ids, mask = random_prompts([3, 9, 6], seed=30 + i)
        kw = dict(max_new_tokens=29, eos_token_id=[7], stop_token_ids=[11], seed=5, temperature=temperature)
        ntp = generate(m, ids, mask, mode="ntp", **kw)
        v = dict(block_size=k, threshold=100.0, verify=True, lookup=lookup, branch=True, **kw)
        out = generate(m, ids, mask, alternates=A, return_trace=True, **v)
        case = (i, k, lookup, A, temperature)
        assert torch.equal(out.sequences, ntp.sequences), case
        assert (out.nfe <= ntp.nfe).all(), case
        assert torch.equal(out.num_accepted + out.num_corrected, out.num_generated), case
        P, G = out.prompt_lengths.tolist(), out.num_generated.tolist()
        for b in range(len(P)):
            got = sorted(p for _, pos, _ in out.trace[b] for p in pos)
            assert got == list(range(P[b], P[b] + G[b])), (case, b)
        fewer += int(generate(m, ids, mask, **v).nfe.sum()) - int(out.nfe.sum())
    assert taken[0] > 0  # corrections were alternates
    assert fewer > 0


def _run(m, prompt, rows, pos, n_commit, n_valid, branch=None, alternates=None):
    """A prefill of ``prompt`` [B, P], then one forward of ``rows``: its logits and the cache after it."""
    B, P = prompt.shape
    cache = SBDCache(m.config, B, 32, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        with cache.forward_plan([P] * B, [P] * B) as plan:
            m(input_ids=prompt, position_ids=torch.arange(P).expand(B, P), past_key_values=cache, sbd_plan=plan)
        with cache.forward_plan(n_commit, n_valid, branch, alternates) as plan:
            logits = m(input_ids=rows, position_ids=pos, past_key_values=cache, sbd_plan=plan).logits
    return logits, cache


def test_alternate_rows_are_the_rows_ntp_computes(models):
    """One forward of committed rows [v, d1, d2], a block, the branch and two alternates behind v (sequence 0; none
    for sequence 1): each alternate's row and block give bit for bit the logits of a forward that commits [v, a]
    with the block behind a; the other rows' logits and the cache after the forward are those of the forward
    without the alternates."""
    m = copy.deepcopy(models[0])
    use_row_linear(m)  # the few-row kernel, as generate() switches an fp32 CPU model to: batch invariant
    prompt, _ = random_prompts([5, 5], seed=4)
    g = torch.Generator().manual_seed(9)
    tail = torch.randint(0, MASK_ID, (2, 3), generator=g)  # v, d1, d2 of each sequence
    alt = torch.randint(0, MASK_ID, (2,), generator=g)
    k, S = 2, 3
    masks = torch.full((2, k), MASK_ID)
    main = torch.cat([tail, masks], 1)
    main_pos = torch.arange(5, 5 + 3 + k).expand(2, -1)
    with_branch = torch.cat([main, masks], 1)
    branch_pos = torch.cat([main_pos, torch.arange(6, 6 + k).expand(2, -1)], 1)
    groups = [torch.cat([alt.view(2, 1) + j, masks], 1) for j in range(2)]
    rows = torch.cat([with_branch, *groups], 1)
    pos = torch.cat([branch_pos, torch.arange(6, 6 + S).expand(2, -1), torch.arange(6, 6 + S).expand(2, -1)], 1)
    branch, alternates = (k, [1, 0], [k, 0]), (S, [[S, 0], [S, 0]])
    got, cache = _run(m, prompt, rows, pos, [3, 3], [3 + k, 3 + k], branch, alternates)
    want, want_cache = _run(m, prompt, with_branch, branch_pos, [3, 3], [3 + k, 3 + k], branch)
    T0 = with_branch.shape[1]
    assert torch.equal(got[:, :T0], want)
    for layer, ref in zip(cache.layers, want_cache.layers, strict=True):
        assert torch.equal(layer.keys[:, :, :8], ref.keys[:, :, :8])
        assert torch.equal(layer.values[:, :, :8], ref.values[:, :, :8])
    assert cache.seq_lens == want_cache.seq_lens == [8, 8]
    for j in range(2):
        alone_rows = torch.cat([tail[:, :1], alt.view(2, 1) + j, masks], 1)
        alone, _ = _run(m, prompt, alone_rows, torch.arange(5, 7 + k).expand(2, -1), [2, 2], [2 + k, 2 + k])
        assert torch.equal(got[0, T0 + j * S : T0 + (j + 1) * S], alone[0, 1:])


@pytest.mark.slow
def test_compiled_alternates_equal_eager(models, taken):
    """The compiled step (every forward carries the branch's and the alternates' rows; the CPU's dynamic row
    count) gives eager decoding's tokens, forwards and trace, and NTP's sequences, in fewer forwards than the
    branch alone."""
    import torch._dynamo

    import sbd_ext.decoding.compiled as compiled

    m = models[1]
    ids, mask = random_prompts([4, 8, 6], seed=41)
    kw = dict(max_new_tokens=40, eos_token_id=[], block_size=2, threshold=100.0, verify=True, branch=True)
    calls = []
    real = compiled.StaticStep.__call__
    torch._dynamo.reset()  # compiled here, not decoded eagerly past the variant budget earlier tests used
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiled, "_VARIANTS", set())
        mp.setattr(compiled, "_EAGER", set())
        mp.setattr(compiled.StaticStep, "__call__", lambda self, fw: calls.append(fw.n_alt_groups) or real(self, fw))
        got = generate(m, ids, mask, alternates=3, compile=True, return_trace=True, **kw)
    assert calls and set(calls) == {3}  # the static step ran, every forward with the alternates' groups
    want = generate(m, ids, mask, alternates=3, return_trace=True, **kw)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.nfe, want.nfe) and got.trace == want.trace
    assert torch.equal(got.sequences, generate(m, ids, mask, mode="ntp", max_new_tokens=40, eos_token_id=[]).sequences)
    assert got.nfe.sum() < generate(m, ids, mask, **kw).nfe.sum()
    assert taken[0] > 0


def test_alternates_with_a_gated_drafter_keep_the_base(taken):
    """The alternates' blocks are block rows (the drafter's gate covers them), their own rows are the base's."""
    base, model = random_drafter(seed=3, rank=4, lm_scale=8.0)
    ids, mask = random_prompts([3, 7], seed=2)
    kw = dict(max_new_tokens=30, eos_token_id=[])
    want = generate(base, ids, mask, mode="ntp", **kw)
    for lookup in (0, 4):
        v = dict(block_size=2, threshold=100.0, verify=True, branch=True, lookup=lookup, **kw)
        got = generate(model, ids, mask, alternates=6, **v)
        assert torch.equal(got.sequences, want.sequences)
    assert taken[0] > 0


def test_gate_rows_cover_the_alternates_blocks_only():
    alts = (8, 3, (torch.tensor([3, 0]), torch.tensor([3, 3])))
    g = gate_rows(torch.tensor([1, 2]), torch.tensor([3, 4]), 14, "cpu", (6, torch.tensor([2, 0])), alts)
    assert g.squeeze(-1).tolist() == [
        [0, 1, 1, 0, 0, 0, 1, 1, 0, 1, 1, 0, 1, 1],
        [0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1],
    ]


def test_alternates_settings_and_refusals(models):
    for bad in (-1, 9, 1.5, "2", None):
        with pytest.raises(ValueError, match="alternates must be an int"):
            GenerationSettings(alternates=bad)
    m = models[0]
    ids, mask = random_prompts([4], seed=1)
    kw = dict(max_new_tokens=12, eos_token_id=[], block_size=2, threshold=100.0)
    # outside verify mode, and in verify without the branch, it does nothing (a checkpoint may recommend it next to
    # sbd_verify and sbd_branch, and a caller turn those off)
    for extra in ({}, dict(verify=True)):
        plain, with_alts = generate(m, ids, mask, **kw, **extra), generate(m, ids, mask, alternates=3, **kw, **extra)
        assert torch.equal(plain.sequences, with_alts.sequences) and torch.equal(plain.nfe, with_alts.nfe)
    # the generation config's sbd_alternates is the default
    m.generation_config.sbd_alternates = 3
    try:
        v = dict(kw, max_new_tokens=40, verify=True, branch=True)
        assert torch.equal(generate(m, ids, mask, **v).nfe, generate(m, ids, mask, alternates=3, **v).nfe)
    finally:
        del m.generation_config.sbd_alternates
    cache = SBDCache(m.config, 1, 16, torch.float32, torch.device("cpu"))
    bad_plans = [
        ((2, [1], [2]), (3, [[2]])),  # a group neither empty nor whole
        ((2, [1], [2]), (1, [[1]])),  # a group without a block
        (None, (3, [[3]])),  # no branch to sit behind
        ((2, [1], [2]), (3, [[3, 3]])),  # one entry per sequence
    ]
    for branch, alternates in bad_plans:
        with pytest.raises(ValueError, match="alternates"):
            with cache.forward_plan([3], [5], branch, alternates):
                pass
    with pytest.raises(ValueError, match="commit the first draft"):
        with cache.forward_plan([1], [3], (2, [1], [2]), (3, [[3]])):
            pass
