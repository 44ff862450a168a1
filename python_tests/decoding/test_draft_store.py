"""The drafter's draft store (sbd_ext.decoding.lookup.DraftStore): n-gram -> the token that most often followed it in
a corpus, verify's lookup drafts where the context has none. The table and its chains against brute force; it changes
how many forwards verify takes, never what verify returns; the artifact carries it and refuses a broken one."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch
from sbd_models import MASK_ID, VOCAB, broken_drafter, random_drafter, random_prompts, single_thread  # noqa: F401

import sbd_ext
from sbd_ext import drafter
from sbd_ext.decoding.lookup import DraftStore
from sbd_ext.drafter.artifact import ArtifactError

pytestmark = pytest.mark.usefixtures("single_thread")


def _reference_table(seqs, n_max, n_min, min_count, min_share) -> dict:
    """Brute force: for every distinct n-gram, every occurrence of it in every sequence counted by a scan."""
    grams = {tuple(s[i : i + n]) for s in seqs for n in range(n_min, n_max + 1) for i in range(len(s) - n)}
    table = {}
    for g in grams:
        follow: list[int] = []  # in order of appearance (ties go to the first seen)
        for s in seqs:
            follow += [s[i + len(g)] for i in range(len(s) - len(g)) if tuple(s[i : i + len(g)]) == g]
        tok, k = Counter(follow).most_common(1)[0]
        if k >= min_count and k >= min_share * len(follow):
            table[g] = tok
    return table


def _reference_chain(table, ctx, m, n_max, n_min) -> list[int]:
    out = []
    while len(out) < m:
        text = ctx + out
        hit = [
            table[tuple(text[-n:])] for n in range(n_max, n_min - 1, -1) if len(text) >= n and tuple(text[-n:]) in table
        ]
        if not hit:
            break
        out.append(hit[0])
    return out


@pytest.mark.parametrize("n_max,n_min,min_count,min_share", [(4, 2, 3, 0.6), (3, 1, 1, 0.0), (5, 3, 2, 0.9)])
def test_table_and_chains_equal_brute_force(n_max, n_min, min_count, min_share):
    g = torch.Generator().manual_seed(n_max * 100 + n_min)
    seqs = [
        torch.randint(0, 6, (int(torch.randint(0, 60, (1,), generator=g)),), generator=g).tolist() for _ in range(12)
    ]
    store = DraftStore.from_sequences(seqs, n_max, n_min, min_count, min_share)
    want = _reference_table(seqs, n_max, n_min, min_count, min_share)
    assert store._table == want and len(store) == len(want) > 0
    for _ in range(40):
        ctx = torch.randint(0, 6, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g).tolist()
        for m in (0, 1, 5, 17):
            assert store.propose(ctx, m) == _reference_chain(want, ctx, m, n_max, n_min), (ctx, m)
    keys, nxt = store.tensors()  # the stored form: int32, -1 left padding
    assert keys.dtype == nxt.dtype == torch.int32 and keys.shape == (len(store), n_max)
    assert DraftStore(keys, nxt, n_min=n_min, vocab=6)._table == want


def test_bad_tables_are_refused_clearly():
    keys, nxt = torch.tensor([[-1, 1, 2], [3, 4, 5]]), torch.tensor([3, 0])
    DraftStore(keys, nxt, n_min=2, vocab=6)
    cases = [
        ((keys[0], nxt), {}, "keys \\[N, n_max\\]"),
        ((keys, nxt[:1]), {}, "keys \\[N, n_max\\]"),
        ((keys.float(), nxt), {}, "integer"),
        ((keys, nxt), {"n_min": 4}, "n_min <= n_max"),
        ((keys, nxt), {"n_min": 3}, "left-padded"),  # the first key has 2 ids
        ((torch.tensor([[1, -1, 2], [3, 4, 5]]), nxt), {}, "left-padded"),
        ((torch.tensor([[-2, 1, 2], [3, 4, 5]]), nxt), {}, "token ids"),
        ((keys, nxt), {"vocab": 5}, "token ids in \\[0, 5\\)"),
        ((keys, torch.tensor([3, 6])), {"vocab": 6}, "next_ids must be token ids"),
        ((keys, torch.tensor([3, -1])), {}, "next_ids must be token ids"),
        ((torch.tensor([[-1, 1, 2], [-1, 1, 2]]), nxt), {}, "distinct"),
        (([[1, 2]], nxt), {}, "tensors"),
    ]
    for args, kw, msg in cases:
        with pytest.raises((ValueError, TypeError), match=msg):
            DraftStore(*args, **kw)
    with pytest.raises(ValueError, match="min_count"):
        DraftStore.from_sequences([[1, 2, 3]], min_count=0)


def _store_of_answers(model, ids, att, kw) -> DraftStore:
    """A store over the model's own NTP answers to these prompts: its chains are right wherever the answers' n-grams
    are unambiguous (the most a store can help)."""
    ref = sbd_ext.generate(model, ids, att, mode="ntp", **kw)
    answers = [s[ids.shape[1] :].tolist() for s in ref.sequences]
    return DraftStore.from_sequences(answers, n_max=4, n_min=2, min_count=1, min_share=0.0), ref


@pytest.mark.parametrize("extra", [{}, {"branch": True}, {"block_size": 4}])
def test_verify_with_a_store_equals_ntp_in_fewer_forwards(extra, monkeypatch):
    """(The compiled step's cycle asks the store from the same host code: sbd_ext.decoding.state.)"""
    import sbd_ext.decoding.state as state

    monkeypatch.setattr(state, "LOOKUP_YIELD_BELOW", 2.0)  # a random drafter is often sure of wrong tokens
    base, model = random_drafter(seed=21)
    ids, att = random_prompts([6, 9, 4], seed=22)
    kw = dict(max_new_tokens=40, eos_token_id=[])
    store, ref = _store_of_answers(base, ids, att, kw)
    run = dict(block_size=2, verify=True, lookup=8) | extra | kw
    plain = sbd_ext.generate(model, ids, att, **run)
    calls = []
    real = DraftStore.propose
    monkeypatch.setattr(DraftStore, "propose", lambda self, *a: calls.append(1) or real(self, *a))
    model.sbd_drafter.draft_store = store
    got = sbd_ext.generate(model, ids, att, **run)
    assert calls  # the store was asked
    assert torch.equal(got.sequences, ref.sequences) and torch.equal(plain.sequences, ref.sequences)
    assert int(got.nfe.sum()) < int(plain.nfe.sum()), (got.nfe, plain.nfe)
    # without lookup, and outside verify, the store is never asked
    calls.clear()
    for other in (dict(block_size=2, verify=True), dict(block_size=2, verify=False), dict(mode="ntp")):
        sbd_ext.generate(model, ids, att, **other | kw)
    assert not calls


def test_a_store_that_is_always_wrong_changes_nothing_but_forwards(monkeypatch):
    """Verify keeps the base's tokens whatever the store proposes (sampled too)."""
    base, model = random_drafter(seed=23)
    ids, att = random_prompts([5, 8], seed=24)
    kw = dict(max_new_tokens=32, eos_token_id=[], temperature=0.8, seed=3)
    ref = sbd_ext.generate(base, ids, att, mode="ntp", **kw)
    wrong = [[(t * 7 + 1) % (VOCAB - 1) for t in range(200)]]  # one arbitrary sequence: chains of junk
    model.sbd_drafter.draft_store = DraftStore.from_sequences(wrong, n_max=2, n_min=1, min_count=1, min_share=0.0)
    got = sbd_ext.generate(model, ids, att, block_size=2, verify=True, lookup=16, **kw)
    assert torch.equal(got.sequences, ref.sequences)
    model.sbd_drafter.draft_store = "not a store"
    with pytest.raises(TypeError, match="DraftStore or None"):
        sbd_ext.generate(model, ids, att, block_size=2, verify=True, lookup=16, **kw)


def test_artifact_round_trip_with_a_store_and_refusals(tmp_path):
    base, model = random_drafter(seed=25)
    seqs = [torch.randint(0, MASK_ID, (50,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
    seqs += [seqs[0][:30]] * 2  # repeats: entries with counts >= 3
    model.sbd_drafter.draft_store = DraftStore.from_sequences(seqs)
    n = len(model.sbd_drafter.draft_store)
    assert n > 0
    sbd = {"sbd_block_size_range": [2, 8], "draft_store": {"answers": 6}}
    drafter.save_drafter(model, tmp_path / "d", sbd)
    cfg = json.loads((tmp_path / "d" / drafter.CONFIG_FILE).read_text())
    assert cfg["sbd"]["draft_store"] == {"answers": 6, "entries": n, "n_max": 4, "n_min": 2}
    fresh = copy.deepcopy(base)
    drafter.load_weights(fresh, tmp_path / "d")
    assert fresh.sbd_drafter.draft_store._table == model.sbd_drafter.draft_store._table
    ids, att = random_prompts([6, 9], seed=26)
    kw = dict(block_size=2, verify=True, lookup=8, max_new_tokens=16, return_trace=True)
    a, b = sbd_ext.generate(model, ids, att, **kw), sbd_ext.generate(fresh, ids, att, **kw)
    assert torch.equal(a.sequences, b.sequences) and a.trace == b.trace
    _, plain = random_drafter(seed=25)  # without a store the config carries none (a stale one would be refused)
    drafter.save_drafter(plain, tmp_path / "p", sbd)
    assert "draft_store" not in json.loads((tmp_path / "p" / drafter.CONFIG_FILE).read_text())["sbd"]

    def broken(edit_cfg=None, edit_tensors=None):
        return broken_drafter(model, tmp_path, sbd, edit_cfg, edit_tensors)

    def put(key, fn):
        return lambda t: t.update({key: fn(t[key])})

    cases = [
        (broken(lambda c: c["sbd"].pop("draft_store")), "no 'sbd.draft_store'"),
        (broken(lambda c: c["sbd"]["draft_store"].update(entries=n + 1)), "draft store's tensors"),
        (broken(lambda c: c["sbd"]["draft_store"].update(entries=1 << 40)), "entries <="),
        (broken(lambda c: c["sbd"]["draft_store"].update(n_max=3)), "draft store's tensors"),
        (broken(lambda c: c["sbd"]["draft_store"].update(n_min=5)), "n_min <= n_max"),
        (broken(lambda c: c["sbd"]["draft_store"].update(n_min="2")), "n_min"),
        (broken(edit_tensors=lambda t: t.pop("sbd_draft_store.next")), "draft store's tensors"),
        (broken(edit_tensors=put("sbd_draft_store.next", lambda x: x.clone().fill_(MASK_ID))), "mask token"),
        (broken(edit_tensors=put("sbd_draft_store.next", lambda x: x.clone().fill_(VOCAB + 5))), "token ids"),
        (broken(edit_tensors=put("sbd_draft_store.keys", lambda x: x.float())), "integer"),
        (broken(edit_tensors=put("sbd_draft_store.keys", lambda x: x.clone().fill_(-1))), "left-padded"),
    ]
    for folder, word in cases:
        target = copy.deepcopy(base)
        with pytest.raises(ArtifactError, match=word):
            drafter.load_weights(target, folder)
        assert drafter.get_drafter(target) is None


def test_store_stage_writes_a_drafter_with_its_store(tmp_path):
    """The recipe's ``store`` stage: the answers of ``samples.pt`` files -> the drafter with a store, everything
    else copied; the stored table is the one built from those answers."""
    from sbd_ext.recipes.drafter.store import build_store

    _, model = random_drafter(seed=27)
    drafter.save_drafter(model, tmp_path / "art", {"sbd_block_size_range": [2, 8]}, dtype=torch.float32)
    (tmp_path / "art" / "ship_check.json").write_text("{}")
    g = torch.Generator().manual_seed(28)
    rows = [{"prompt_ids": [1, 2], "answer_ids": torch.randint(0, 5, (40,), generator=g).tolist()} for _ in range(6)]
    torch.save(rows[:4], tmp_path / "a.pt")
    torch.save(rows[4:], tmp_path / "b.pt")
    dest = build_store(tmp_path / "out", tmp_path / "art", [tmp_path / "a.pt", tmp_path / "b.pt"], limit=3)
    assert (dest / "ship_check.json").read_text() == "{}"
    spec = drafter.read_drafter_config(dest)["sbd"]["draft_store"]
    assert spec["answers"] == 5 and spec["answer_tokens"] == 200 and spec["min_count"] == 3
    want = DraftStore.from_sequences([r["answer_ids"] for r in rows[:3] + rows[4:]])
    fresh, _ = random_drafter(seed=27)
    drafter.load_weights(fresh, dest)
    assert fresh.sbd_drafter.draft_store._table == want._table and len(want) == spec["entries"] > 0
    for name, m in drafter.get_drafter(model).lora_modules(model):  # the factors as they were
        got = dict(drafter.get_drafter(fresh).lora_modules(fresh))[name]
        assert torch.equal(got.lora_A, m.lora_A) and torch.equal(got.lora_B, m.lora_B)
    # in place (the recipe's `store --artifact HEAD/artifact --out HEAD`), with other thresholds: replaced
    again = build_store(tmp_path / "out", dest, [tmp_path / "a.pt"], min_count=1, min_share=0.0)
    assert again == dest and (dest / "ship_check.json").read_text() == "{}"
    want = DraftStore.from_sequences([r["answer_ids"] for r in rows[:4]], min_count=1, min_share=0.0)
    fresh, _ = random_drafter(seed=27)
    drafter.load_weights(fresh, dest)
    assert fresh.sbd_drafter.draft_store._table == want._table
    assert drafter.read_drafter_config(dest)["sbd"]["draft_store"]["entries"] == len(want)
