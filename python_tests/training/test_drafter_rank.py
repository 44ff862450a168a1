"""Issue 62 (the drafter's rank sweep): :func:`sbd_ext.drafter.grow_rank` raises a trained drafter's LoRA rank
without changing what it computes, so that a higher-rank run can continue the shipped drafter instead of starting
from zero; the new directions train, and the grown drafter saves and loads at its new rank."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from sbd_models import MASK_ID, VOCAB, random_drafter, random_prompts, single_thread  # noqa: F401

from sbd_ext import drafter
from sbd_ext.cache import SBDCache

pytestmark = pytest.mark.usefixtures("single_thread")


def _block_logits(model) -> torch.Tensor:
    """Logits of two prompts' committed rows and a 4-row block (masks and one revealed token) in one forward."""
    ids, _ = random_prompts([9, 9], seed=3)
    block = torch.full((2, 4), MASK_ID)
    block[0, 1] = 5
    x = torch.cat([ids, block], 1)
    pos = torch.arange(x.shape[1]).expand(2, -1)
    cache = SBDCache(model.config, 2, 32, torch.float32, "cpu")
    with torch.no_grad(), cache.forward_plan([9, 9], [13, 13]) as plan:
        return model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True, sbd_plan=plan).logits


def test_grown_drafter_computes_the_same_and_its_new_directions_train(tmp_path):
    base, model = random_drafter(seed=4, rank=4)
    before = _block_logits(model)
    old = {
        n: (m.lora_A.detach().clone(), m.lora_B.detach().clone(), m.scale)
        for n, m in drafter.get_drafter(model).lora_modules(model)
    }
    alpha = drafter.get_drafter(model).alpha
    params = drafter.grow_rank(model, 12)

    d = drafter.get_drafter(model)
    assert d.rank == 12 and d.alpha == pytest.approx(alpha * 3)
    for n, m in d.lora_modules(model):
        a, b, scale = old[n]
        assert m.rank == 12 and m.scale == scale
        assert m.lora_A.shape == (12, a.shape[1]) and m.lora_B.shape == (b.shape[0], 12)
        assert torch.equal(m.lora_A[:4], a) and torch.equal(m.lora_B[:, :4], b)
        assert not m.lora_B[:, 4:].any() and m.lora_A[4:].abs().max() > 0
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n or "mask_row" in n for n in names)
    assert {id(p) for p in params} == {id(p) for p in model.parameters() if p.requires_grad}
    # the same outputs: the base's on the committed rows, the rank-4 drafter's on the block rows (fp32 rounding)
    after = _block_logits(model)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    keep = torch.arange(VOCAB) != MASK_ID
    torch.testing.assert_close(after[:, :9][..., keep], _block_logits(base)[:, :9][..., keep], rtol=1e-5, atol=1e-5)

    # saved and loaded at rank 12, the same outputs
    drafter.save_drafter(model, tmp_path / "d", {"sbd_block_size_range": [2, 8]}, dtype=torch.float32)
    assert json.loads((tmp_path / "d" / drafter.CONFIG_FILE).read_text())["r"] == 12
    fresh = copy.deepcopy(base)
    drafter.load_weights(fresh, tmp_path / "d")
    torch.testing.assert_close(_block_logits(fresh), after, rtol=1e-6, atol=1e-6)

    # one distillation step reaches the new directions: B's new columns get a gradient and move
    x = torch.randint(0, MASK_ID, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = drafter.distill_loss(
        model, x, torch.ones_like(x, dtype=torch.bool), 4, generator=torch.Generator().manual_seed(2)
    )
    loss.backward()
    grads = [m.lora_B.grad[:, 4:].abs().max() for _, m in d.lora_modules(model)]
    assert all(g > 0 for g in grads)


def test_grow_rank_refuses_a_lower_rank_and_a_model_without_a_drafter():
    base, model = random_drafter(seed=5, rank=4)
    with pytest.raises(ValueError, match="lower rank 2"):
        drafter.grow_rank(model, 2)
    assert drafter.get_drafter(model).rank == 4
    with pytest.raises(ValueError, match="no gated drafter"):
        drafter.grow_rank(base, 8)
    same = drafter.grow_rank(model, 4)  # the same rank: nothing changes
    assert drafter.get_drafter(model).rank == 4 and same
