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


@pytest.fixture(scope="module")
def models():
    # lm_scale 8: peaky next-token distributions (argmax far from ties), and a random model's block guesses are
    # mostly wrong, so corrections and rollbacks are frequent.
    return [tiny_llama(seed=s, lm_scale=8.0) for s in range(2)]


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
