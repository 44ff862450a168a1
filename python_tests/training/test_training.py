"""The SBD training objective (sbd_ext.training): the 2L mask, the loss, learning, the HF Trainer, the mask token.

Everything runs on small random LlamaConfig models on the CPU; nothing is downloaded.
"""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sbd_models import tiny_llama
from transformers import LlamaConfig, TrainingArguments

import sbd_ext
from sbd_ext.training import (
    HAS_FLEX_ATTENTION,
    IGNORE_INDEX,
    SBDTrainer,
    add_mask_token,
    mask_format_for,
    ntp_loss,
    objective_loss_fn,
    sbd_attention_mask,
    sbd_batch,
    sbd_loss,
    sbd_loss_from_logits,
    train_loop,
    train_sbd,
)

V = 16  # toy vocabulary; the mask token is id V
MASK = V


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: intra-op threads buy nothing, and on a loaded 2-core machine OpenMP threads waiting on
    each other made the training test ~10x slower (200 s vs 18 s wall measured here). Results do not depend on it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# The training tests' model: the shared tiny Llama with a 17-token vocabulary (mask id 16), small initial weights
# and the output head as initialised; a call overrides any of these keywords.
tiny = functools.partial(
    tiny_llama, attn="sdpa", vocab=V + 1, mask_id=MASK, init_range=0.02, lm_scale=1.0, max_positions=128
)


def brute_force_mask(L: int, k: int, length: int | None = None) -> torch.Tensor:
    """The SBD training mask (clean copy causal; the masked copy sees the clean blocks before its own and its whole
    block), written out one (q, kv) pair at a time; padding keys (position >= length) masked out."""
    length = L if length is None else length
    T = 2 * L
    m = torch.zeros(T, T, dtype=torch.bool)
    for q in range(T):
        for kv in range(T):
            clean_clean = q < L and kv < L and kv <= q
            noisy_noisy = q >= L and kv >= L and (q - L) // k == (kv - L) // k
            noisy_clean = q >= L and kv < L and (q - L) // k > kv // k
            pos_kv = kv if kv < L else kv - L
            m[q, kv] = (clean_clean or noisy_noisy or noisy_clean) and pos_kv < length
    return m


# --------------------------------------------------------------------------------------------------------
# the mask
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("L,k", [(1, 1), (1, 4), (5, 1), (6, 2), (7, 3), (8, 4), (10, 4), (6, 16), (13, 5)])
def test_mask_matches_definition(L, k):
    lengths = torch.tensor([L, max(1, L - 3), 1])
    dense = sbd_attention_mask(L, k, lengths, mask_format="bool")
    assert dense.shape == (3, 1, 2 * L, 2 * L) and dense.dtype == torch.bool
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(dense[b, 0], brute_force_mask(L, k, n)), f"L={L} k={k} length={n}"
    add = sbd_attention_mask(L, k, lengths, mask_format="additive", dtype=torch.bfloat16)
    assert add.dtype == torch.bfloat16
    assert torch.equal(add == 0, dense)
    assert torch.all(add[~dense] == torch.finfo(torch.bfloat16).min)
    # no padding: the same mask, batch of one
    assert torch.equal(sbd_attention_mask(L, k)[0, 0], brute_force_mask(L, k))


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 12), k=st.integers(1, 9), data=st.data())
def test_mask_matches_definition_random(L, k, data):
    n = data.draw(st.integers(1, L))
    dense = sbd_attention_mask(L, k, torch.tensor([n]))
    assert torch.equal(dense[0, 0], brute_force_mask(L, k, n))
    assert dense[0, 0].any(-1).all(), "every query row must keep at least one key"


@pytest.mark.skipif(not HAS_FLEX_ATTENTION, reason="torch without flex_attention")
def test_block_mask_matches_definition():
    from torch.nn.attention.flex_attention import create_mask

    L, k = 11, 4
    lengths = torch.tensor([11, 6])
    bm = sbd_attention_mask(L, k, lengths, mask_format="block")
    assert tuple(bm.shape) == (2, 1, 2 * L, 2 * L)
    dense = create_mask(bm.mask_mod, 2, 1, 2 * L, 2 * L, device="cpu")
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(dense[b, 0], brute_force_mask(L, k, n))


def test_mask_format_for():
    assert mask_format_for("sdpa") == "bool"
    assert mask_format_for("eager") == "additive"
    assert mask_format_for("flex_attention") == "block"
    assert mask_format_for("sbd") == "bool"  # sbd_ext's backend: SDPA fallback for custom 4D masks
    with pytest.raises(ValueError, match="FlashAttention"):
        mask_format_for("flash_attention_2")


# --------------------------------------------------------------------------------------------------------
# the batch
# --------------------------------------------------------------------------------------------------------
def test_batch_layout():
    x = torch.randint(0, V, (3, 10))
    am = torch.ones(3, 10, dtype=torch.long)
    am[1, 6:] = 0
    b = sbd_batch(x, MASK, 4, attention_mask=am, generator=torch.Generator().manual_seed(0))
    L = 10
    assert b.input_ids.shape == (3, 20) and b.position_ids.shape == (3, 20)
    assert torch.equal(b.input_ids[:, :L], x)
    assert torch.equal(b.position_ids[0], torch.cat([torch.arange(L), torch.arange(L)]))
    noisy = b.input_ids[:, L:]
    assert torch.equal(noisy == MASK, b.masked)
    assert torch.equal(noisy[~b.masked], x[~b.masked])
    assert not b.masked[1, 6:].any(), "padding is never masked"
    # aligned labels: clean t -> x[t+1]; noisy L+t -> x[t] where masked
    assert torch.equal(b.labels[0, : L - 1], x[0, 1:]) and b.labels[0, L - 1] == IGNORE_INDEX
    assert torch.equal(b.labels[1, :5], x[1, 1:6]) and (b.labels[1, 5:L] == IGNORE_INDEX).all()
    want = torch.where(b.masked, x, torch.full_like(x, IGNORE_INDEX))
    assert torch.equal(b.labels[:, L:], want)
    assert b.lengths.tolist() == [10, 6, 10]


def test_eta_is_drawn_per_sequence():
    B, L = 64, 400
    x = torch.randint(0, V, (B, L))
    b = sbd_batch(x, MASK, 8, generator=torch.Generator().manual_seed(3))
    assert b.eta.shape == (B,)
    frac = b.masked.float().mean(1)
    assert (frac - b.eta).abs().max() < 0.1, "each sequence is masked at its own rate eta"
    assert b.eta.min() < 0.15 and b.eta.max() > 0.85 and b.eta.std() > 0.2, "eta ~ U(0, 1), not one shared value"
    # an explicit eta; the extremes
    assert sbd_batch(x, MASK, 8, eta=0.0).masked.sum() == 0
    assert sbd_batch(x, MASK, 8, eta=1.0).masked.all()
    etas = torch.linspace(0, 1, B)
    frac = sbd_batch(x, MASK, 8, eta=etas, generator=torch.Generator().manual_seed(4)).masked.float().mean(1)
    assert (frac - etas).abs().max() < 0.1


def test_batch_is_reproducible_from_generator():
    x = torch.randint(0, V, (4, 12))
    a = sbd_batch(x, MASK, 3, generator=torch.Generator().manual_seed(7))
    b = sbd_batch(x, MASK, 3, generator=torch.Generator().manual_seed(7))
    c = sbd_batch(x, MASK, 3, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.input_ids, b.input_ids) and not torch.equal(a.input_ids, c.input_ids)


def test_sbd_loss_ids_beyond_the_vocabulary_are_a_clear_error():
    """Ids >= vocab in input_ids or labels (or a mask id beyond it): a ValueError naming the argument and the
    vocabulary (before: "index out of range in self" from the embedding, or a CE device assert on CUDA)."""
    model = tiny()
    vocab = model.config.vocab_size
    x = torch.randint(0, V, (2, 6))
    bad = x.clone()
    bad[1, 3] = vocab
    with pytest.raises(ValueError, match=rf"input_ids holds ids outside \[0, vocab_size={vocab}\)"):
        sbd_loss(model, bad, block_size=2)
    labels = x.clone()
    labels[0, 0] = -100  # ignore_index is fine
    sbd_loss(model, x, labels=labels, block_size=2)
    labels[1, 2] = vocab + 7
    with pytest.raises(ValueError, match="labels holds ids outside"):
        sbd_loss(model, x, labels=labels, block_size=2)
    with pytest.raises(ValueError, match="mask_token_id = 500"):
        sbd_loss(model, x, mask_token_id=500, block_size=2)


def test_huge_block_size_is_one_block():
    """block_size past the sequence (up to past int64): the batch of k = L (before: OverflowError from the mask)."""
    x = torch.randint(0, V, (2, 6))
    want = sbd_batch(x, MASK, 6, generator=torch.Generator().manual_seed(0))
    for k in (7, 2**40, 2**70):
        got = sbd_batch(x, MASK, k, generator=torch.Generator().manual_seed(0))
        assert torch.equal(got.attention_mask, want.attention_mask) and torch.equal(got.labels, want.labels)


def test_batch_bad_inputs():
    x = torch.randint(0, V, (2, 6))
    left = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="right-padded"):
        sbd_batch(x, MASK, 2, attention_mask=left)
    with pytest.raises(ValueError, match="at least one token"):
        sbd_batch(x, MASK, 2, attention_mask=torch.zeros(2, 6))
    with pytest.raises(ValueError, match="block_size"):
        sbd_batch(x, MASK, 0)
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        sbd_batch(x[0], MASK, 2)
    with pytest.raises(ValueError, match="eta"):
        sbd_batch(x, MASK, 2, eta=1.5)
    with pytest.raises(ValueError, match="labels"):
        sbd_batch(x, MASK, 2, labels=x[:, :3])
    with pytest.raises(ValueError, match="block_size_range"):
        sbd_loss(tiny(), x, block_size_range=(4, 2))
    model = tiny()
    del model.config.mask_token_id
    with pytest.raises(ValueError, match="mask_token_id"):
        sbd_loss(model, x)


# --------------------------------------------------------------------------------------------------------
# the mask inside a real model: what each output may see
# --------------------------------------------------------------------------------------------------------
def _logits(model, batch):
    with torch.no_grad():
        return model(**batch.model_inputs()).logits.float()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_clean_half_equals_causal_forward(attn):
    model = tiny(attn=attn)
    x = torch.randint(0, V, (3, 13), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(x)
    am[1, 9:] = 0
    am[2, 4:] = 0
    b = sbd_batch(
        x,
        MASK,
        5,
        attention_mask=am,
        eta=0.5,
        generator=torch.Generator().manual_seed(1),
        mask_format=mask_format_for(attn),
    )
    got = _logits(model, b)[:, :13]
    with torch.no_grad():
        want = model(input_ids=x, attention_mask=am).logits.float()
    valid = am.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)


def _changed(base, new, tol=1e-5):
    """Per position: did the logits move? [B, T] bool."""
    return (base - new).abs().amax(-1) > tol


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("L,k", [(10, 3), (8, 4), (7, 1)])
def test_perturbation_reaches_only_allowed_outputs(attn, L, k):
    """Changing one input token moves exactly the outputs that the SBD mask (closed over layers) lets see it.

    The three leaks this rules out: a noisy block seeing its own block's clean copy, seeing later blocks (clean or
    noisy), and the clean half seeing the noisy half.
    """
    model = tiny(attn=attn, init_range=0.2)  # larger weights: every allowed influence is far above fp32 noise
    x = torch.randint(0, V, (1, L), generator=torch.Generator().manual_seed(L))
    b = sbd_batch(x, MASK, k, eta=0.5, generator=torch.Generator().manual_seed(k), mask_format=mask_format_for(attn))
    base = _logits(model, b)
    blk = torch.arange(L) // k
    for j in range(2 * L):
        ids = b.input_ids.clone()
        ids[0, j] = (ids[0, j] + 1) % V  # a different real token (also replaces a mask token)
        new = _logits(model, type(b)(**{**b.__dict__, "input_ids": ids}))
        moved = _changed(base, new)[0]
        if j < L:  # clean token j: clean outputs at t >= j, noisy blocks strictly after j's block
            want = torch.cat([torch.arange(L) >= j, blk > blk[j]])
        else:  # noisy token j - L: only its own noisy block
            want = torch.cat([torch.zeros(L, dtype=torch.bool), blk == blk[j - L]])
        assert torch.equal(moved, want), (
            f"perturbing input {j}: moved {moved.int().tolist()}, want {want.int().tolist()}"
        )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_is_never_seen(attn):
    model = tiny(attn=attn, init_range=0.2)
    L = 9
    x = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(5))
    am = torch.ones_like(x)
    am[1, 5:] = 0
    b = sbd_batch(
        x,
        MASK,
        3,
        attention_mask=am,
        eta=0.5,
        generator=torch.Generator().manual_seed(2),
        mask_format=mask_format_for(attn),
    )
    base = _logits(model, b)
    valid = torch.cat([am, am], 1).bool()
    for j in [5, 8, L + 5, L + 8]:
        ids = b.input_ids.clone()
        ids[1, j] = (ids[1, j] + 3) % V
        new = _logits(model, type(b)(**{**b.__dict__, "input_ids": ids}))
        assert not _changed(base, new)[valid].any(), f"padding input {j} leaked into a real position"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_FLEX_ATTENTION, reason="torch without flex_attention")
def test_flex_attention_block_mask_matches_sdpa():
    """The BlockMask path through transformers' flex_attention backend (forward only: torch has no FlexAttention
    backward on the CPU; on CUDA it trains)."""
    model = tiny(attn="sdpa")
    x = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(x)
    am[1, 7:] = 0
    kw = dict(mask_token_id=MASK, block_size=4, attention_mask=am, return_parts=True)
    with torch.no_grad():
        want_loss, want_parts = sbd_loss(model, x, generator=torch.Generator().manual_seed(1), **kw)
        want = _logits(
            model, sbd_batch(x, MASK, 4, attention_mask=am, eta=0.5, generator=torch.Generator().manual_seed(2))
        )
        model.set_attn_implementation("flex_attention")
        got_loss, got_parts = sbd_loss(model, x, generator=torch.Generator().manual_seed(1), **kw)
        b = sbd_batch(
            x, MASK, 4, attention_mask=am, eta=0.5, generator=torch.Generator().manual_seed(2), mask_format="block"
        )
        got = _logits(model, b)
    valid = torch.cat([am, am], 1).bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
    assert got_parts["num_masked"] == want_parts["num_masked"]


# --------------------------------------------------------------------------------------------------------
# the loss
# --------------------------------------------------------------------------------------------------------
def test_loss_equals_hand_computation():
    torch.manual_seed(0)
    B, L, Vt = 2, 5, 7
    x = torch.tensor([[1, 4, 2, 6, 3], [5, 0, 2, 2, 1]])
    am = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    b = sbd_batch(x, 6, 2, attention_mask=am, eta=torch.tensor([0.6, 0.9]), generator=torch.Generator().manual_seed(0))
    logits = torch.randn(B, 2 * L, Vt)
    loss, parts = sbd_loss_from_logits(logits, b)

    def nll(row, target):
        z = [float(v) for v in row]
        return math.log(sum(math.exp(v) for v in z)) - z[target]

    ntp, mlm, hits = [], [], 0
    lens = [5, 3]
    for s in range(B):
        for t in range(lens[s] - 1):
            ntp.append(nll(logits[s, t], int(x[s, t + 1])))
        for t in range(lens[s]):
            if b.masked[s, t]:
                mlm.append(nll(logits[s, L + t], int(x[s, t])))
                hits += int(logits[s, L + t].argmax()) == int(x[s, t])
    assert len(mlm) > 0
    assert parts["num_masked"] == len(mlm) and parts["block_size"] == 2
    assert math.isclose(float(parts["ntp_loss"]), sum(ntp) / len(ntp), rel_tol=1e-5)
    assert math.isclose(float(parts["mask_loss"]), sum(mlm) / len(mlm), rel_tol=1e-5)
    assert math.isclose(float(parts["mask_accuracy"]), hits / len(mlm), rel_tol=1e-6)
    assert math.isclose(float(loss), sum(ntp) / len(ntp) + sum(mlm) / len(mlm), rel_tol=1e-5)


def test_mask_loss_ignores_unmasked_and_padding_positions():
    B, L, Vt = 3, 8, 9
    x = torch.randint(0, 8, (B, L), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(x)
    am[2, 5:] = 0
    b = sbd_batch(x, 8, 3, attention_mask=am, eta=0.5, generator=torch.Generator().manual_seed(1))
    logits = torch.randn(B, 2 * L, Vt)
    loss, _ = sbd_loss_from_logits(logits, b)
    # scramble every output that must not count: unmasked noisy positions, padding, the last clean position
    counts = b.labels != IGNORE_INDEX
    scrambled = torch.where(counts[..., None], logits, torch.randn_like(logits) * 10)
    loss2, _ = sbd_loss_from_logits(scrambled, b)
    torch.testing.assert_close(loss2, loss)
    # no masked token at all: the mask term is 0, not NaN
    b0 = sbd_batch(x, 8, 3, attention_mask=am, eta=0.0)
    loss0, parts0 = sbd_loss_from_logits(logits, b0)
    assert parts0["mask_loss"] == 0 and parts0["num_masked"] == 0 and torch.isfinite(loss0)


def test_labels_select_the_loss_tokens():
    """SFT-style labels: IGNORE_INDEX tokens (a prompt) are in neither loss."""
    x = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(0))
    labels = x.clone()
    labels[:, :4] = IGNORE_INDEX
    b = sbd_batch(x, MASK, 3, labels=labels, eta=1.0)
    assert (b.labels[:, :3] == IGNORE_INDEX).all() and torch.equal(b.labels[:, 3:9], x[:, 4:])
    assert (b.labels[:, 10:14] == IGNORE_INDEX).all() and torch.equal(b.labels[:, 14:], x[:, 4:])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sbd_loss_matches_manual_forward(attn):
    """sbd_loss = forward over sbd_batch's input + the hand loss; k drawn in range when not given."""
    model = tiny(attn=attn)
    x = torch.randint(0, V, (3, 12), generator=torch.Generator().manual_seed(0))
    loss, parts = sbd_loss(model, x, block_size=5, generator=torch.Generator().manual_seed(9), return_parts=True)
    b = sbd_batch(x, MASK, 5, generator=torch.Generator().manual_seed(9), mask_format=mask_format_for(attn))
    want, _ = sbd_loss_from_logits(_logits(model, b), b)
    torch.testing.assert_close(loss.detach(), want, atol=1e-5, rtol=1e-5)
    assert loss.requires_grad
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    ks = {
        sbd_loss(model, x, block_size_range=(3, 5), generator=torch.Generator().manual_seed(s), return_parts=True)[1][
            "block_size"
        ]
        for s in range(30)
    }
    assert ks == {3, 4, 5}
    model.config.sbd_block_size_range = [6, 6]  # the default range is the one recorded in the config
    assert sbd_loss(model, x, return_parts=True)[1]["block_size"] == 6


# --------------------------------------------------------------------------------------------------------
# training learns
# --------------------------------------------------------------------------------------------------------
def _periodic(n, L, period, g):
    """Sequences that repeat a random pattern of `period` tokens: every masked token after the first period is
    determined by an earlier clean token at the same phase."""
    pat = torch.randint(0, V, (n, period), generator=g)
    return pat.repeat(1, L // period + 1)[:, :L]


def _eval_parts(model, x):
    model.eval()
    with torch.no_grad():
        runs = [
            sbd_loss(model, x, block_size=k, eta=0.5, generator=torch.Generator().manual_seed(5), return_parts=True)[1]
            for k in (2, 4, 8)
        ]
    model.train()
    return {n: sum(float(r[n]) for r in runs) / len(runs) for n in ("ntp_loss", "mask_loss", "mask_accuracy")}


@pytest.mark.slow
def test_training_learns_to_fill_masks():
    """A tiny Llama trained with the SBD loss on period-3 sequences learns to fill masks (held-out set, fixed k,
    fixed eta = 0.5): the mask loss falls below half its start and masked accuracy goes far above chance (1/16)."""
    L, B, steps = 24, 16, 150
    model = tiny(attn="sdpa", seed=0)
    g = torch.Generator().manual_seed(1)
    data = [_periodic(B, L, 3, g) for _ in range(steps)]
    held_out = _periodic(64, L, 3, torch.Generator().manual_seed(99))
    before = _eval_parts(model, held_out)
    history = train_sbd(
        model,
        data,
        steps,
        lr=3e-3,
        warmup_steps=20,
        block_size_range=(2, 8),
        generator=torch.Generator().manual_seed(2),
        log_every=25,
        progress=False,
    )
    after = _eval_parts(model, held_out)
    print(f"\nSBD toy training, {steps} steps: before {before}\nafter {after}")
    assert len(history) == steps // 25 and history[-1]["step"] == steps
    assert model.config.sbd_block_size_range == [2, 8] and model.config.mask_token_id == MASK
    assert before["mask_accuracy"] < 0.15
    assert after["mask_loss"] < 0.5 * before["mask_loss"]
    assert after["ntp_loss"] < 0.5 * before["ntp_loss"]
    assert after["mask_accuracy"] > 0.6
    assert history[-1]["mask_loss"] < history[0]["mask_loss"]


def test_train_sbd_dict_batches_and_plain_progress(capsys, monkeypatch):
    """dict batches with padding; when tqdm is missing, a plain periodic print; a one-shot iterator ends early."""
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    model = tiny(attn="eager")
    x = torch.randint(0, V, (4, 10))
    am = torch.ones_like(x)
    am[0, 6:] = 0
    batches = iter([{"input_ids": x, "attention_mask": am}] * 3)
    seen = []
    history = train_sbd(model, batches, 5, lr=1e-3, block_size_range=(2, 4), log_every=1, callback=seen.append)
    out = capsys.readouterr().out
    assert "[sbd] step 1/5" in out and "mask" in out
    assert [h["step"] for h in history] == [1, 2, 3] and seen == history
    assert all(math.isfinite(h["loss"]) for h in history)


# --------------------------------------------------------------------------------------------------------
# HF Trainer
# --------------------------------------------------------------------------------------------------------
class _ToyDataset(torch.utils.data.Dataset):
    def __init__(self, n, L, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = _periodic(n, L, 3, g)
        self.am = torch.ones_like(self.x)
        self.am[::3, L - 4 :] = 0  # some right-padded rows

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": self.am[i], "labels": self.x[i].clone()}


@pytest.mark.parametrize("scheme", ["packed", "int8"])
def test_training_a_quantized_base_is_refused(scheme, tmp_path):
    """train_sbd / SBDTrainer on a model whose linear weights are inference-only buffers (sbd_ext.quantize) would
    train only the embedding and norms: a clear error instead; a frozen quantized base (adapter training) passes."""
    model = sbd_ext.quantize(tiny(attn="sdpa"), scheme)
    x = torch.randint(0, V, (4, 10))
    with pytest.raises(ValueError, match=rf"train_sbd: this model's linear layers hold '{scheme}' weights"):
        train_sbd(model, [x], 2, block_size_range=(2, 4), progress=False)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[])
    with pytest.raises(ValueError, match=rf"SBDTrainer: this model's linear layers hold '{scheme}' weights"):
        SBDTrainer(model=model, args=args, train_dataset=[{"input_ids": x[0]}])
    for p in model.parameters():
        p.requires_grad_(False)  # the base frozen (as adapter training has it): nothing to refuse
    sbd_ext.quantization.check_trainable_weights(model, "train_sbd")


def test_sbd_trainer_runs_and_logs_parts(tmp_path):
    model = tiny(attn="sdpa")
    model.train()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        logging_steps=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = SBDTrainer(
        model=model,
        args=args,
        train_dataset=_ToyDataset(48, 12, 0),
        eval_dataset=_ToyDataset(16, 12, 1),
        block_size_range=(2, 6),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    for h in logs:
        assert math.isfinite(h["loss"]) and {"ntp_loss", "mask_loss", "mask_accuracy"} <= h.keys()
        # the logged total is (up to the Trainer's rounding) the sum of the two logged parts
        assert abs(h["loss"] - (h["ntp_loss"] + h["mask_loss"])) < 0.02 * h["loss"] + 1e-3
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and "eval_mask_loss" in metrics and "eval_ntp_loss" in metrics
    assert model.config.sbd_block_size_range == [2, 6] and model.config.mask_token_id == MASK


# --------------------------------------------------------------------------------------------------------
# mask token
# --------------------------------------------------------------------------------------------------------
def _word_tokenizer(n_words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(n_words - 1)}
    vocab["<unk>"] = n_words - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.mark.parametrize("tie", [False, True])
def test_add_mask_token_without_tokenizer(tie, tmp_path):
    model = tiny(vocab=V, tie=tie, mask_id=None)
    before = model.get_input_embeddings().weight.detach().clone()
    out_before = model.get_output_embeddings().weight.detach().clone()
    mid = add_mask_token(model, block_size_range=(2, 8))
    assert mid == V
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == V + 1 and model.config.vocab_size == V + 1
    assert model.get_output_embeddings().weight.shape[0] == V + 1
    torch.testing.assert_close(emb[:V], before)
    torch.testing.assert_close(emb[V], before.mean(0))
    torch.testing.assert_close(model.get_output_embeddings().weight[V], out_before.mean(0))
    assert model.config.mask_token_id == V and model.config.sbd_block_size_range == [2, 8]
    # a second call reuses the recorded id
    assert add_mask_token(model) == V and model.get_input_embeddings().weight.shape[0] == V + 1
    # the metadata survives save / load
    model.config.save_pretrained(tmp_path)
    cfg = LlamaConfig.from_pretrained(tmp_path)
    assert cfg.mask_token_id == V and list(cfg.sbd_block_size_range) == [2, 16]
    # and the model runs with it
    x = torch.randint(0, V, (2, 8))
    assert torch.isfinite(sbd_loss(model, x))


def test_add_mask_token_with_tokenizer():
    tok = _word_tokenizer(V)
    model = tiny(vocab=V, mask_id=None)
    assert tok.mask_token is None
    mid = add_mask_token(model, tok)
    assert len(tok) == V + 1 and tok.mask_token == "<|mask|>" and mid == tok.mask_token_id == V
    assert model.get_input_embeddings().weight.shape[0] == V + 1
    assert model.config.mask_token_id == V and model.config.sbd_block_size_range == [2, 16]
    assert tok("w1 <|mask|> w2").input_ids == [1, V, 2]
    # present already: reused, nothing grows
    assert add_mask_token(model, tok) == V
    assert len(tok) == V + 1 and model.get_input_embeddings().weight.shape[0] == V + 1


def test_add_mask_token_reuses_tokenizers_mask():
    tok = _word_tokenizer(V)
    tok.add_special_tokens({"mask_token": "[MASK]"})
    model = tiny(mask_id=None)
    before = model.get_input_embeddings().weight.detach().clone()
    assert add_mask_token(model, tok) == tok.mask_token_id == V
    assert tok.mask_token == "[MASK]" and len(tok) == V + 1
    torch.testing.assert_close(model.get_input_embeddings().weight, before)  # an existing token is left alone


def test_add_mask_token_into_padded_vocab():
    """Embedding tables are often larger than the tokenizer: the new id fits, no resize, its row is initialised."""
    tok = _word_tokenizer(V - 4)
    model = tiny(vocab=V, mask_id=None)
    before = model.get_input_embeddings().weight.detach().clone()
    mid = add_mask_token(model, tok)
    assert mid == V - 4 and model.get_input_embeddings().weight.shape[0] == V
    torch.testing.assert_close(model.get_input_embeddings().weight[mid], before[: V - 4].mean(0))


class _Interrupt(Exception):
    pass


def _resume_run(tmp_path, interrupt_at=None):
    """6 SBD steps with a checkpoint every 3; ``interrupt_at`` raises from the callback after that step."""
    model = tiny(attn="sdpa", seed=0)
    data = [torch.randint(0, V, (4, 12), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    gen = torch.Generator().manual_seed(3)

    def stop(rec):
        if rec["step"] == interrupt_at:
            raise _Interrupt

    hist = train_sbd(
        model,
        data,
        6,
        lr=1e-2,
        warmup_steps=2,
        block_size_range=(2, 4),
        generator=gen,
        log_every=1,
        progress=False,
        callback=stop,
        checkpoint=tmp_path / "ckpt.pt",
        checkpoint_every=3,
    )
    return model, hist


def test_train_loop_resume_matches_uninterrupted(tmp_path):
    """A run interrupted after step 4 (checkpoint at step 3) and resumed ends with bit-identical weights and the
    same history as an uninterrupted run: model, optimizer, schedule, the loss's generator and the data position
    are all restored."""
    ref_model, ref_hist = _resume_run(tmp_path / "a")
    (tmp_path / "b").mkdir()
    with pytest.raises(_Interrupt):
        _resume_run(tmp_path / "b", interrupt_at=4)
    model, hist = _resume_run(tmp_path / "b")
    strip = lambda h: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in h]  # noqa: E731
    assert strip(hist) == strip(ref_hist) and [r["step"] for r in hist] == [1, 2, 3, 4, 5, 6]
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_train_loop_schedule_and_clipping():
    """lr follows warm-up + cosine to min_lr_ratio; the loss_fn's parts are averaged per logging interval."""
    from sbd_ext.training import lr_factor

    w = torch.nn.Parameter(torch.tensor([1.0]))
    model = torch.nn.Module()
    model.w = w
    seen = []

    def loss_fn(m, batch):
        seen.append(batch)
        parts = {"aux": torch.tensor(float(batch))}
        if batch == 2.0:  # a part some steps leave out: averaged over the steps that report it
            parts["sometimes"] = torch.tensor(3.0)
        return (m.w * batch).sum() ** 2, parts

    hist = train_loop(
        model, [1.0, 2.0], loss_fn, 4, lr=0.1, warmup_steps=2, min_lr_ratio=0.1, log_every=2, progress=False
    )
    assert seen == [1.0, 2.0, 1.0, 2.0]  # a list is cycled
    assert [r["step"] for r in hist] == [2, 4] and hist[0]["aux"] == 1.5
    assert hist[0]["sometimes"] == 3.0 and hist[1]["sometimes"] == 3.0
    assert lr_factor(0, 4, 2) == 0.5 and lr_factor(1, 4, 2) == 1.0 and lr_factor(4, 4, 2, 0.1) == pytest.approx(0.1)
    assert hist[-1]["lr"] == pytest.approx(0.1 * lr_factor(4, 4, 2, 0.1))
    with pytest.raises(ValueError, match="steps"):
        train_loop(model, [1.0], loss_fn, -1)


def test_sbd_metadata_lives_on_the_text_config():
    """One writer: add_mask_token / train_sbd / set_sbd_metadata all write the text config, and get_sbd_metadata
    reads it back, also through a wrapper (torch.compile keeps the model as _orig_mod)."""
    from sbd_ext.metadata import get_sbd_metadata, set_sbd_metadata

    model = tiny(attn="sdpa")
    assert add_mask_token(model, block_size_range=(3, 5)) == MASK
    text = model.config.get_text_config(decoder=True)
    assert text.mask_token_id == MASK and text.sbd_block_size_range == [3, 5]
    wrapped = torch.nn.Module()
    wrapped._orig_mod = model
    assert get_sbd_metadata(wrapped) == (MASK, (3, 5))
    set_sbd_metadata(model, MASK, None)
    assert get_sbd_metadata(model.config) == (MASK, None)
    for bad in (-1, V + 1, True, 1.5):
        with pytest.raises(ValueError, match="mask_token_id"):
            set_sbd_metadata(model, bad)
    with pytest.raises(ValueError, match="block_size_range"):
        set_sbd_metadata(model, MASK, (4, 2))
    # None removes both fields (a restore of "no metadata"); a range without a mask id is refused
    with pytest.raises(ValueError, match="needs a mask_token_id"):
        set_sbd_metadata(model, None, (2, 4))
    set_sbd_metadata(model, MASK, (2, 4))
    set_sbd_metadata(model, None, None)
    assert get_sbd_metadata(model) == (None, None) and not hasattr(text, "mask_token_id")
    with pytest.raises(ValueError, match="not trained for SBD|mask"):
        sbd_ext.generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=2)


def test_objective_loss_fn_is_ntp_loss_or_sbd_loss():
    """The one objective driver: "ntp" is the model's causal-LM loss, "sbd" is sbd_loss with k from k_rng."""
    model = tiny(attn="sdpa")
    x = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(2))
    labels = x.clone()
    labels[:, :3] = IGNORE_INDEX
    batch = {"input_ids": x, "labels": labels, "attention_mask": torch.ones_like(x)}
    loss, parts = objective_loss_fn("ntp", generator=torch.Generator(), k_rng=random.Random(0))(model, batch)
    assert torch.equal(loss, model(input_ids=x, labels=labels).loss) and torch.equal(parts["ntp_loss"], loss)
    assert torch.equal(ntp_loss(model, batch)[0], loss)
    fn = objective_loss_fn(
        "sbd", generator=torch.Generator().manual_seed(5), k_rng=random.Random(1), block_size_range=(2, 5)
    )
    loss, parts = fn(model, batch)
    k = random.Random(1).randint(2, 5)
    want = sbd_loss(model, x, labels=labels, attention_mask=batch["attention_mask"], block_size=k,
                    generator=torch.Generator().manual_seed(5), return_parts=True)  # fmt: skip
    assert parts["block_size"] == k and torch.equal(loss, want[0])
    with pytest.raises(ValueError, match="objective must be one of"):
        objective_loss_fn("mlm", generator=torch.Generator(), k_rng=random.Random(0))
