"""Verify mode's branch (``generate(..., verify=True, branch=True)``): each forward that checks drafts also drafts
a second block behind the last verified token, used when the first draft is rejected. The output stays NTP's
token for token; the branch rows see exactly the rows before the branch point (checked against a separate
forward); a rejected first draft no longer costs a forward without drafts."""

from __future__ import annotations

import functools

import pytest
import torch
from sbd_models import (
    MASK_ID,
    random_drafter,
    random_prompts,
    single_thread,  # noqa: F401  (fixture)
)

from sbd_ext.decoding import GenerationSettings, SBDCache, generate
from sbd_ext.decoding import step as step_module
from sbd_ext.decoding.step import TwoForwardStep
from sbd_ext.drafter import gate_rows
from sbd_ext.drafter.sampler_head import SamplerHead

pytestmark = pytest.mark.usefixtures("single_thread")


def _generated_positions(out) -> list[list[int]]:
    P, G = out.prompt_lengths.tolist(), out.num_generated.tolist()
    return [list(range(p, p + g)) for p, g in zip(P, G, strict=True)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("k,gamma,lookup", [(2, 100.0, 0), (3, 0.5, 0), (4, 100.0, 5), (8, 2.0, 0), (16, 5.0, 20)])
def test_branch_equals_ntp(models, k, gamma, lookup, temperature):
    """Ragged batch, EOS and stop ids, the budget, lookup past the block: the sequences are NTP's, in at most NTP's
    forwards; every generated position is in the trace exactly once."""
    for i, m in enumerate(models):
        ids, mask = random_prompts([3, 9, 6], seed=30 + i)
        kw = dict(max_new_tokens=29, eos_token_id=[7], stop_token_ids=[11], seed=5, temperature=temperature)
        ntp = generate(m, ids, mask, mode="ntp", **kw)
        br = generate(
            m, ids, mask, block_size=k, threshold=gamma, verify=True, lookup=lookup, branch=True, return_trace=True,
            **kw,
        )  # fmt: skip
        case = (i, k, gamma, lookup, temperature)
        assert torch.equal(br.sequences, ntp.sequences), case
        assert (br.nfe <= ntp.nfe).all(), case
        assert torch.equal(br.num_accepted + br.num_corrected, br.num_generated), case
        for b, want in enumerate(_generated_positions(br)):
            got = sorted(p for _, pos, _ in br.trace[b] for p in pos)
            assert got == want, (case, b)


def _with_sampler_head(seed: int):
    """A tiny Llama with a random gated drafter and a random sampler head (verify rescores slot 1 with it)."""
    _, model = random_drafter(seed=seed)
    head = SamplerHead(model.config.hidden_size, hidden=32, topk=16)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.sbd_drafter.sampler_head = head.eval()
    return model


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_block_and_branch_revealed_in_one_pass_as_in_two(models, monkeypatch, temperature):
    """A branch of the block's size is revealed with the block in one pass over their rows: the same drafts as a
    pass each (``merge=False``) -- the same sequences, forwards and trace -- at batch 1 and ragged batches, with
    and without a sampler head, lookup and the draft's noise; and the one pass ran (2B rows at once)."""
    seen = []
    sample_rows = step_module.sample_rows
    monkeypatch.setattr(step_module, "sample_rows", lambda x, *a: seen.append(x.shape[0]) or sample_rows(x, *a))
    for i, m in enumerate([*models, _with_sampler_head(3)]):
        for lens, k, lookup in (([7], 2, 0), ([3, 9, 6], 3, 4), ([5, 4], 2, 6)):
            ids, mask = random_prompts(lens, seed=40 + i)
            kw = dict(max_new_tokens=25, seed=5, temperature=temperature, block_size=k, threshold=2.0, verify=True)
            kw |= dict(branch=True, lookup=lookup, return_trace=True)
            seen.clear()
            one = generate(m, ids, mask, **kw)
            assert 2 * len(lens) in seen, (i, lens)
            with monkeypatch.context() as mp:
                mp.setattr(step_module, "_reveal_blocks", functools.partial(step_module._reveal_blocks, merge=False))
                seen.clear()
                two = generate(m, ids, mask, **kw)
                assert 2 * len(lens) not in seen, (i, lens)
            case = (i, lens, k, lookup, temperature)
            assert torch.equal(one.sequences, two.sequences), case
            assert torch.equal(one.nfe, two.nfe) and one.trace == two.trace, case


def test_branch_rows_see_only_the_rows_before_the_branch_point(models):
    """One forward of committed rows [v, d1, d2], a block and a branch behind v: the branch rows' logits equal those
    of a separate forward whose block sits right after v (the same cache, v committed), and the other rows' logits
    equal the same forward without the branch. Two sequences, one without a branch."""
    m = models[0]
    ids, _ = random_prompts([5, 5], seed=4)
    g = torch.Generator().manual_seed(9)
    tail = torch.randint(0, MASK_ID, (2, 3), generator=g)  # v, d1, d2 of each sequence
    k = 3

    def run(rows, pos, n_commit, n_valid, branch=None):
        cache = SBDCache(m.config, 2, 32, torch.float32, torch.device("cpu"))
        with torch.no_grad():
            with cache.forward_plan([5, 5], [5, 5]) as plan:
                m(input_ids=ids, position_ids=torch.arange(5).expand(2, 5), past_key_values=cache, sbd_plan=plan)
            with cache.forward_plan(n_commit, n_valid, branch) as plan:
                return m(input_ids=rows, position_ids=pos, past_key_values=cache, sbd_plan=plan).logits

    masks = torch.full((2, k), MASK_ID)
    main = torch.cat([tail, masks], 1)
    main_pos = torch.arange(5, 5 + 3 + k).expand(2, -1)
    rows = torch.cat([main, masks], 1)
    pos = torch.cat([main_pos, torch.arange(6, 6 + k).expand(2, -1)], 1)
    with_branch = run(rows, pos, [3, 3], [3 + k, 3 + k], (k, [1, 0], [k, 0]))
    without = run(main, main_pos, [3, 3], [3 + k, 3 + k])
    torch.testing.assert_close(with_branch[:, : 3 + k], without, rtol=1e-5, atol=1e-5)
    alone = run(torch.cat([tail[:, :1], masks], 1), torch.arange(5, 6 + k).expand(2, -1), [1, 1], [1 + k, 1 + k])
    torch.testing.assert_close(with_branch[0, 3 + k :], alone[0, 1:], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(with_branch[0, 3 + k :], without[0, 3:], atol=1e-3)  # not the block's own logits


def test_branch_drafts_after_a_rejected_first_draft(models):
    """A random model's drafts are mostly wrong: with the branch, the forward after a correction checks drafts
    (the branch's) instead of none, so the same tokens take fewer forwards (k = 2: one draft per cycle)."""
    total = {False: 0, True: 0}
    for i, m in enumerate(models):
        ids, mask = random_prompts([4, 8, 6], seed=40 + i)
        for branch in (False, True):
            out = generate(m, ids, mask, max_new_tokens=48, eos_token_id=[], block_size=2, threshold=100.0,
                           verify=True, branch=branch)  # fmt: skip
            ntp = generate(m, ids, mask, max_new_tokens=48, eos_token_id=[], mode="ntp")
            assert torch.equal(out.sequences, ntp.sequences)
            total[branch] += int(out.nfe.sum())
    assert total[True] < total[False], total


@pytest.mark.slow
def test_compiled_branch_equals_eager_and_saves_forwards(models):
    """The compiled step (every forward carries the branch rows; the CPU's dynamic row count) gives eager decoding's
    tokens and forwards, NTP's sequences, and fewer forwards than verify without the branch."""
    import torch._dynamo

    import sbd_ext.decoding.compiled as compiled

    m = models[1]
    ids, mask = random_prompts([4, 8, 6], seed=41)
    kw = dict(max_new_tokens=40, eos_token_id=[], block_size=2, threshold=100.0, verify=True)
    calls = []
    real = compiled.StaticStep.__call__
    torch._dynamo.reset()  # compiled here, not decoded eagerly past the variant budget earlier tests used
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiled, "_VARIANTS", set())
        mp.setattr(compiled, "_EAGER", set())
        mp.setattr(compiled.StaticStep, "__call__", lambda self, fw: calls.append(fw.branch_rows) or real(self, fw))
        got = generate(m, ids, mask, branch=True, compile=True, return_trace=True, **kw)
    assert calls and set(calls) == {2}  # the static step ran, every forward with the branch's rows
    want = generate(m, ids, mask, branch=True, return_trace=True, **kw)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.nfe, want.nfe) and got.trace == want.trace
    assert torch.equal(got.sequences, generate(m, ids, mask, mode="ntp", max_new_tokens=40, eos_token_id=[]).sequences)
    assert got.nfe.sum() < generate(m, ids, mask, **kw).nfe.sum()


def test_branch_with_a_gated_drafter_keeps_the_base():
    """The branch rows are block rows: the drafter's gate covers them (and only them); the output is the base's."""
    base, model = random_drafter(seed=3, rank=4)
    ids, mask = random_prompts([3, 7], seed=2)
    kw = dict(max_new_tokens=30, eos_token_id=[])
    want = generate(base, ids, mask, mode="ntp", **kw)
    for lookup in (0, 4):
        got = generate(model, ids, mask, block_size=2, threshold=100.0, verify=True, branch=True, lookup=lookup, **kw)
        assert torch.equal(got.sequences, want.sequences)


def test_gate_rows_covers_the_branch():
    g = gate_rows(torch.tensor([1, 2]), torch.tensor([3, 4]), 8, "cpu", (6, torch.tensor([2, 0])))
    assert g.squeeze(-1).tolist() == [[0, 1, 1, 0, 0, 0, 1, 1], [0, 0, 1, 1, 0, 0, 0, 0]]


def test_branch_settings_and_refusals(models):
    m = models[0]
    ids, mask = random_prompts([4], seed=1)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="branch must be a bool"):
            GenerationSettings(branch=bad)
    with pytest.raises(ValueError, match="two-forward ablation has no branch"):
        generate(m, ids, mask, max_new_tokens=4, verify=True, branch=True, step_cls=TwoForwardStep)
    # outside verify mode it does nothing (a checkpoint may recommend it next to sbd_verify)
    kw = dict(max_new_tokens=12, eos_token_id=[], block_size=4)
    plain, with_branch = generate(m, ids, mask, **kw), generate(m, ids, mask, branch=True, **kw)
    assert torch.equal(plain.sequences, with_branch.sequences) and torch.equal(plain.nfe, with_branch.nfe)
    # the generation config's sbd_branch is the default
    m.generation_config.sbd_branch = True
    try:
        kw = dict(max_new_tokens=40, eos_token_id=[], block_size=2, threshold=100.0, verify=True)
        assert torch.equal(generate(m, ids, mask, **kw).nfe, generate(m, ids, mask, branch=True, **kw).nfe)
    finally:
        del m.generation_config.sbd_branch
    cache = SBDCache(m.config, 1, 16, torch.float32, torch.device("cpu"))
    for at, valid in ((0, 2), (4, 2), (1, 3), (1, -1)):
        with pytest.raises(ValueError, match="branch"):
            with cache.forward_plan([3], [5], (2, [at], [valid])):
                pass
