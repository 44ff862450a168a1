"""The drafter's sampler head (sbd_ext.drafter.sampler_head): slot 1 rescored given slot 0's token. It changes which
tokens verify drafts, never what verify returns (the base's own tokens); the rescoring against a plain-torch
reference; the artifact; training learns a rule planted in the features."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from sbd_models import MASK_ID, VOCAB, broken_drafter, random_prompts, single_thread, tiny_llama  # noqa: F401

import sbd_ext
from sbd_ext import drafter
from sbd_ext.drafter import sampler_head as sh
from sbd_ext.drafter.artifact import ArtifactError

pytestmark = pytest.mark.usefixtures("single_thread")


def _with_drafter(seed: int = 0, head_std: float | None = 0.5, topk: int = 16):
    """(base, model): a tiny Llama and a copy with a random gated drafter and (unless ``head_std`` is None) a random
    sampler head large enough to change slot 1's ranking."""
    base = tiny_llama(seed=seed, block_size_range=(2, 8))
    model = copy.deepcopy(base)
    params = drafter.attach(model, MASK_ID, rank=4)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    if head_std is not None:
        head = sh.SamplerHead(model.config.hidden_size, hidden=32, topk=topk)
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * head_std)
        model.sbd_drafter.sampler_head = head.eval()
    return base, model


def test_rescore_matches_the_reference():
    _, model = _with_drafter(seed=3)
    head, emb = model.sbd_drafter.sampler_head, model.get_input_embeddings().weight.detach()
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, VOCAB, generator=g) * 3
    logits[:, MASK_ID] = -math.inf
    t0 = torch.randint(0, MASK_ID, (5,), generator=g)
    want = sh.rescore_reference(head, logits, t0, emb)
    got = head.rescore_(logits.clone(), t0, emb)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert int(torch.isfinite(got).sum(1).max()) == head.topk
    keep = torch.isfinite(want)
    torch.testing.assert_close(got[keep], want[keep].float(), rtol=1e-5, atol=1e-5)
    assert not torch.equal(got.argmax(1), logits.argmax(1))  # the head reorders (the test could fail)
    with pytest.raises(ValueError, match="logits"):
        head.rescore_(logits[0], t0, emb)


@pytest.mark.parametrize("rows", ["all", "some"])
def test_rescore_slot1_rescores_exactly_the_rows_it_should(rows):
    """verify's reveal (sbd_ext.decoding.rows.rescore_slot1) on a [B, K, V] view of a forward's logits: slot 1 of
    each row whose slot 0 holds a token and whose slot 1 is masked equals the reference's rescoring, every other
    entry is untouched (the mask id banned); "all" is a verify forward at batch 1 (rescored in place)."""
    from types import SimpleNamespace

    from sbd_ext.decoding.rows import rescore_slot1

    _, model = _with_drafter(seed=5)
    head, emb = model.sbd_drafter.sampler_head, model.get_input_embeddings().weight.detach()
    g = torch.Generator().manual_seed(6)
    B, K = (1, 3) if rows == "all" else (4, 3)
    out = torch.randn(B, K + 2, VOCAB, generator=g) * 3  # the forward's rows; the block is rows 1..K
    x = out[:, 1 : 1 + K]
    block = torch.full((B, K), MASK_ID)
    block[:, 0] = torch.randint(0, MASK_ID, (B,), generator=g)
    if rows == "some":
        block[1, 0] = MASK_ID  # slot 0 still masked: not rescored
        block[2, 1] = 7  # slot 1 already revealed: not rescored
    want = out.clone()
    want[:, 1 : 1 + K, MASK_ID] = -math.inf  # the block's rows only
    cond = (block[:, 0] != MASK_ID) & (block[:, 1] == MASK_ID)
    for b in range(B):
        if cond[b]:
            want[b, 2] = sh.rescore_reference(head, want[b, 2:3].clone(), block[b, :1], emb)[0].float()
    rescore_slot1(SimpleNamespace(sampler_head=(head, emb), mask_id=MASK_ID), x, block)
    assert int(cond.sum()) == (1 if rows == "all" else 2)
    assert torch.equal(torch.isinf(out), torch.isinf(want))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_rescore_keeps_each_tokens_direction_until_the_head_changes():
    """rescore_'s per-token cache of u (cached_direction): a batch with a repeated token, hits and misses, equals
    the reference; an in-place change of a parameter (an optimizer step) or of the embedding drops it."""
    _, model = _with_drafter(seed=5)
    head, emb = model.sbd_drafter.sampler_head, model.get_input_embeddings().weight.detach().clone()
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, VOCAB, generator=g) * 3
    logits[:, MASK_ID] = -math.inf

    def check(t0):
        x = logits[: len(t0)]
        want = sh.rescore_reference(head, x, t0, emb)
        got = head.rescore_(x.clone(), t0, emb)
        keep = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), keep)
        torch.testing.assert_close(got[keep], want[keep].float(), rtol=1e-5, atol=1e-5)
        return got

    t0 = torch.tensor([7, 7, 9, 11])
    first = check(t0)
    assert sorted(head.__dict__["_directions"][1]) == [7, 9, 11]
    assert torch.equal(check(t0), first)  # every token a hit: the same values
    assert torch.equal(check(t0[:1]), first[:1])  # one row, the cached u of its token
    with torch.no_grad():
        head.w2.add_(0.25)  # in place, as an optimizer step
    changed = check(t0)
    assert not torch.equal(changed, first)
    with torch.no_grad():
        emb[7].mul_(-1)
    assert not torch.equal(check(t0)[0], changed[0])
    head.train()
    assert head.cached_direction(emb, t0) is None  # dropout in training: never cached
    head.eval()


def test_a_zero_initialised_head_keeps_the_drafters_drafts():
    base, model = _with_drafter(seed=5, head_std=None)
    ids, att = random_prompts([6, 9], seed=6)
    kw = dict(max_new_tokens=20, block_size=2, verify=True)
    plain = sbd_ext.generate(model, ids, att, **kw)
    model.sbd_drafter.sampler_head = sh.SamplerHead(model.config.hidden_size, hidden=32).eval()
    zero = sbd_ext.generate(model, ids, att, **kw)
    assert torch.equal(zero.sequences, plain.sequences) and torch.equal(zero.nfe, plain.nfe)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("extra", [{}, {"branch": True}, {"lookup": 4}, {"block_size": 4, "threshold": 0.35}])
def test_verify_with_a_head_equals_the_base(temperature, extra):
    base, model = _with_drafter(seed=7)
    ids, att = random_prompts([7, 11, 4], seed=8)
    kw = dict(max_new_tokens=24, temperature=temperature, seed=13)
    ref = sbd_ext.generate(base, ids, att, mode="ntp", **kw)
    calls = []
    real = sh.SamplerHead.rescore_
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sh.SamplerHead, "rescore_", lambda self, *a: calls.append(1) or real(self, *a))
        out = sbd_ext.generate(model, ids, att, **({"block_size": 2, "verify": True} | extra | kw))
    assert calls  # the head ran
    assert torch.equal(out.sequences, ref.sequences)
    without = copy.deepcopy(model)
    without.sbd_drafter.sampler_head = None
    plain = sbd_ext.generate(without, ids, att, **({"block_size": 2, "verify": True} | extra | kw))
    assert torch.equal(plain.sequences, ref.sequences)


def test_the_head_changes_the_drafts_and_plain_sbd_ignores_it():
    _, model = _with_drafter(seed=9, head_std=2.0)
    ids, att = random_prompts([8, 8], seed=10)
    without = copy.deepcopy(model)
    without.sbd_drafter.sampler_head = None
    from sbd_ext.decoding.state import SequenceState

    kw = dict(max_new_tokens=24, block_size=2, verify=True)
    real = SequenceState.after_sbd_forward

    def drafts_of(m):
        seen = []

        def spy(self, f, block, *a, **k):
            seen.append(list(block))
            return real(self, f, block, *a, **k)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(SequenceState, "after_sbd_forward", spy)
            return sbd_ext.generate(m, ids, att, **kw).sequences, seen

    (a, da), (b, db) = drafts_of(model), drafts_of(without)
    assert torch.equal(a, b) and da != db  # other drafts, the same tokens
    plain = dict(max_new_tokens=16, block_size=2, verify=False)
    assert torch.equal(
        sbd_ext.generate(model, ids, att, **plain).sequences, sbd_ext.generate(without, ids, att, **plain).sequences
    )


def test_a_wrong_head_is_refused_clearly():
    _, model = _with_drafter(seed=17)
    ids, att = random_prompts([5], seed=18)
    kw = dict(block_size=2, verify=True, max_new_tokens=4)
    model.sbd_drafter.sampler_head = torch.nn.Linear(4, 4)  # a module, not a head
    with pytest.raises(TypeError, match="SamplerHead or None"):
        sbd_ext.generate(model, ids, att, **kw)
    model.sbd_drafter.sampler_head = sh.SamplerHead(model.config.hidden_size + 1, hidden=8)
    with pytest.raises(ValueError, match="embeddings of size"):
        sbd_ext.generate(model, ids, att, **kw)
    sbd_ext.generate(model, ids, att, mode="ntp", verify=False, max_new_tokens=4)  # NTP never reads it


def test_compiled_verify_with_a_head_equals_the_base():
    base, model = _with_drafter(seed=11)
    ids, att = random_prompts([5, 8], seed=12)
    ref = sbd_ext.generate(base, ids, att, mode="ntp", max_new_tokens=16)
    for extra in ({}, {"branch": True}):
        out = sbd_ext.generate(model, ids, att, compile=True, verify=True, block_size=2, max_new_tokens=16, **extra)
        assert torch.equal(out.sequences, ref.sequences)


def test_artifact_round_trip_with_a_head_and_refusals(tmp_path):
    base, model = _with_drafter(seed=12)
    sbd = {"sbd_block_size_range": [2, 8], "sampler_head": {"epochs": 3}}
    drafter.save_drafter(model, tmp_path / "d", sbd, dtype=torch.float32)
    cfg = json.loads((tmp_path / "d" / drafter.CONFIG_FILE).read_text())
    assert cfg["sbd"]["sampler_head"] == {"epochs": 3, "hidden": 32, "topk": 16}
    fresh = copy.deepcopy(base)
    drafter.load_weights(fresh, tmp_path / "d")
    got, want = fresh.sbd_drafter.sampler_head.state_dict(), model.sbd_drafter.sampler_head.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    ids, att = random_prompts([6, 9], seed=13)
    kw = dict(block_size=2, verify=True, max_new_tokens=12, return_trace=True)
    a, b = sbd_ext.generate(model, ids, att, **kw), sbd_ext.generate(fresh, ids, att, **kw)
    assert torch.equal(a.sequences, b.sequences) and a.trace == b.trace
    # without a head, the config carries no sampler_head (a stale one would be refused on load)
    _, plain = _with_drafter(seed=12, head_std=None)
    drafter.save_drafter(plain, tmp_path / "p", sbd)
    assert "sampler_head" not in json.loads((tmp_path / "p" / drafter.CONFIG_FILE).read_text())["sbd"]

    def broken(edit_cfg=None, edit_tensors=None):
        return broken_drafter(model, tmp_path, sbd, edit_cfg, edit_tensors)

    cases = [
        (broken(lambda c: c["sbd"].pop("sampler_head")), "no 'sbd.sampler_head'"),
        (broken(lambda c: c["sbd"]["sampler_head"].update(hidden=8)), "sampler head's tensors"),
        (broken(lambda c: c["sbd"]["sampler_head"].update(topk=0)), "topk"),
        (broken(edit_tensors=lambda t: t.pop("sbd_sampler_head.w2")), "sampler head's tensors"),
        (broken(edit_tensors=lambda t: t.update({"sbd_sampler_head.b1": t["sbd_sampler_head.b1"] * math.nan})), "NaN"),
    ]
    for folder, word in cases:
        target = copy.deepcopy(base)
        with pytest.raises(ArtifactError, match=word):
            drafter.load_weights(target, folder)
        assert drafter.get_drafter(target) is None


def test_collect_slot1_counts_what_slot_accuracy_counts():
    """Slot 1's candidates are the drafter's: their top-1 accuracy is slot_accuracy's slot 1 (even prompt lengths:
    every slot-1 position has its slot 0 in the answer)."""
    base, model = _with_drafter(seed=14, head_std=None)
    ids, _ = random_prompts([6, 8, 10], seed=15)
    prompts = [ids[i].tolist() for i in range(3)]
    out = sbd_ext.generate(base, ids, mode="ntp", max_new_tokens=12)
    answers = [out.sequences[i, ids.shape[1] :].tolist() for i in range(3)]
    prompts = [p[-n:] for p, n in zip(prompts, [6, 8, 10], strict=True)]
    feats = sh.collect_slot1(
        model, [{"prompt_ids": p, "answer_ids": a} for p, a in zip(prompts, answers, strict=True)], topk=8, log=None
    )
    assert feats["top_i"].shape == (3 * 6, 8) and feats["top_l"].shape == (3 * 6, 8)
    emb = model.get_input_embeddings().weight.detach()
    want = drafter.slot_accuracy(model, prompts, answers, 2)[1]
    assert sh.accuracy(None, emb, feats) == pytest.approx(want, abs=1e-6)
    t0 = torch.tensor([a[j - 1] for a in answers for j in range(1, 12, 2)])
    assert torch.equal(feats["t0"].long(), t0)


def test_fit_learns_a_rule_planted_in_the_features():
    """The base's token is the candidate c maximising E[c] . M E[t0] (a fixed random M): the drafter's order gets
    about 1/K, a trained head most of them."""
    g = torch.Generator().manual_seed(16)
    H, N, K = 16, 4096, 8
    emb = torch.randn(VOCAB, H, generator=g)
    M = torch.randn(H, H, generator=g)
    top_i = torch.stack([torch.randperm(VOCAB - 1, generator=g)[:K] for _ in range(N)]).int()
    top_l = torch.sort(torch.randn(N, K, generator=g), descending=True).values.half()
    t0 = torch.randint(0, VOCAB - 1, (N,), generator=g).int()
    rule = torch.einsum("nkh,hg,ng->nk", emb[top_i.long()], M, emb[t0.long()])
    tgt = top_i.gather(1, rule.argmax(1, keepdim=True)).view(N)
    feats = {"top_i": top_i, "top_l": top_l, "t0": t0, "tgt": tgt}
    head = sh.SamplerHead(H, hidden=64, topk=K, dropout=0.0)
    before = sh.accuracy(head, emb, feats)
    assert before == sh.accuracy(None, emb, feats) < 0.2  # zero-initialised: the drafter's order
    sh.fit(head, emb, feats, epochs=20, lr=3e-3, log=None)
    assert sh.accuracy(head, emb, feats) > 0.7
    with pytest.raises(ValueError, match="missing"):
        sh.fit(head, emb, {"top_i": top_i}, log=None)
