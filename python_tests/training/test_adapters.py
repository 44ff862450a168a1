"""sbd_ext.adapters: LoRA + the trainable mask row, their merge, the compact artifact, and train_loop's checkpoint of
trainable tensors only (resume, safe loading). Every comparison is against the plain model with the change written
into its weights by hand, not against the adapter code itself."""

from __future__ import annotations

import random

import pytest
import torch
from sbd_models import tiny_llama
from transformers import LlamaForCausalLM

from sbd_ext import adapters
from sbd_ext.training import sbd_loss, train_loop

V, MASK = 64, 63


def tiny(tie: bool, seed: int = 0) -> LlamaForCausalLM:
    """The shared tiny Llama at hidden 32, vocabulary 64 (mask id 63, block sizes 2..8), the head as initialised."""
    return tiny_llama(
        attn="sdpa", seed=seed, tie=tie, vocab=V, mask_id=MASK, block_size_range=(2, 8), hidden=32,
        init_range=0.02, lm_scale=1.0, max_positions=2048,
    )  # fmt: skip


def _perturb(params, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _ids(seed=2, B=2, L=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (B, L), generator=g)
    ids[:, 3::4] = MASK
    return ids


@pytest.mark.parametrize("tie", [True, False])
def test_prepared_model_starts_equal_to_base(tie):
    base, model = tiny(tie), tiny(tie)
    adapters.prepare(model, MASK, "lora", rank=4)
    ids = _ids()
    torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("method", adapters.METHODS)
def test_merge_equals_adapted_model(tie, method):
    model = tiny(tie)
    mask_row, params = adapters.prepare(model, MASK, method, rank=4)
    _perturb(params)
    ids = _ids()
    adapted = model(ids).logits
    merged = adapters.merge(model, mask_row)
    assert not any(isinstance(m, adapters.LoRALinear) for m in merged.modules())
    assert not hasattr(merged, "sbd_mask_row")
    torch.testing.assert_close(merged(ids).logits, adapted, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_mask_row_is_the_one_table_row_that_changes(tie):
    """The hooks act exactly as the mask row written into the (tied or untied) tables would."""
    model, ref = tiny(tie), tiny(tie)
    mask_row, _ = adapters.prepare(model, MASK, "lora", rank=2)
    with torch.no_grad():
        mask_row.row.add_(1.0)
        if not tie:
            mask_row.out_row.sub_(0.5)
        ref.get_input_embeddings().weight[MASK] += 1.0
        if not tie:
            ref.get_output_embeddings().weight[MASK] -= 0.5
    ids = _ids()
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", adapters.METHODS)
def test_artifact_roundtrip(tmp_path, method):
    model = tiny(True)
    mask_row, params = adapters.prepare(model, MASK, method, rank=4)
    _perturb(params)
    size = adapters.save_artifact(model, mask_row, method, tmp_path / "a", {"objective": "sbd"})
    assert size == sum(f.stat().st_size for f in (tmp_path / "a").iterdir())
    assert adapters.is_artifact(tmp_path / "a")
    expected = adapters.merge(model, mask_row)(_ids()).logits
    fresh = tiny(True)
    meta = adapters.apply_artifact(fresh, tmp_path / "a")
    assert meta["method"] == method and meta["mask_token_id"] == MASK
    # bf16 storage of the adapter: the merged weights differ by bf16 rounding of the factors / tensors.
    torch.testing.assert_close(fresh(_ids()).logits, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("method", adapters.METHODS)
def test_load_trainable_continues_from_an_artifact(tmp_path, tie, method):
    """A prepared fresh model started from an artifact computes what the artifact applied to the base computes."""
    model = tiny(tie)
    mask_row, params = adapters.prepare(model, MASK, method, rank=4)
    _perturb(params)
    adapters.save_artifact(model, mask_row, method, tmp_path / "a", {"objective": "sbd"})
    applied = tiny(tie)
    adapters.apply_artifact(applied, tmp_path / "a")
    fresh = tiny(tie)
    fresh_row, fresh_params = adapters.prepare(fresh, MASK, method, rank=4)
    meta = adapters.load_trainable(fresh, fresh_row, tmp_path / "a")
    assert meta["method"] == method
    torch.testing.assert_close(fresh(_ids()).logits, applied(_ids()).logits, rtol=1e-4, atol=1e-4)
    assert all(p.requires_grad for p in fresh_params)
    other = tiny(tie)
    other_row, _ = adapters.prepare(other, MASK, method, rank=2)
    if method == "lora":  # another rank does not fit
        with pytest.raises(ValueError, match="lora_A"):
            adapters.load_trainable(other, other_row, tmp_path / "a")


def test_lora_artifact_holds_only_the_factors(tmp_path):
    from safetensors.torch import load_file

    model = tiny(True)
    mask_row, _ = adapters.prepare(model, MASK, "lora", rank=4)
    adapters.save_artifact(model, mask_row, "lora", tmp_path, {})
    stored = load_file(tmp_path / adapters.ADAPTER_FILE)
    loras = [m for m in model.modules() if isinstance(m, adapters.LoRALinear)]
    assert len(loras) == 2 * 7 and len(stored) == 2 * len(loras)
    assert sum(t.numel() for t in stored.values()) == sum(4 * (m.base.in_features + m.base.out_features) for m in loras)
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert set(load_file(tmp_path / adapters.MASK_ROW_FILE)) == {"mask_row"}  # tied: one row


def test_bad_arguments_and_artifacts(tmp_path):
    with pytest.raises(ValueError, match="method must be one of"):
        adapters.prepare(tiny(True), MASK, "qlora")
    with pytest.raises(ValueError, match="no nn.Linear"):
        adapters.prepare(tiny(True), MASK, "lora", targets=("nope",))
    with pytest.raises(ValueError, match="rank must be"):
        adapters.prepare(tiny(True), MASK, "lora", rank=0)
    with pytest.raises(FileNotFoundError, match="sbd_config.json"):
        adapters.read_artifact_config(tmp_path)
    model = tiny(True)
    mask_row, _ = adapters.prepare(model, MASK, "lora", rank=4)
    adapters.save_artifact(model, mask_row, "lora", tmp_path / "a", {"base_loader": "os:system"})
    with pytest.raises(ValueError, match="not part of sbd_ext"):
        adapters.load_artifact(tmp_path / "a")
    other = tiny_llama(vocab=V, hidden=48, intermediate=64, mask_id=None, init_range=0.02, lm_scale=1.0)
    with pytest.raises(ValueError, match="adapter"):
        adapters.apply_artifact(other, tmp_path / "a")


# ------------------------------------------------------------------------------------------------------------
# train_loop: a checkpoint holds the trainable tensors only; resume is exact; foreign files are refused
# ------------------------------------------------------------------------------------------------------------
def _lora_run(tmp_path, steps, interrupt_at=None):
    model = tiny(True)
    _, params = adapters.prepare(model, MASK, "lora", rank=4)
    data = [_ids(seed=s) for s in range(4)]
    k_rng, gen = random.Random(0), torch.Generator().manual_seed(0)

    def loss_fn(m, ids):
        return sbd_loss(m, ids, block_size=k_rng.randint(2, 4), generator=gen, mask_format="bool")

    def stop(rec):
        if interrupt_at is not None and rec["step"] == interrupt_at:
            raise KeyboardInterrupt

    try:
        train_loop(
            model,
            data,
            loss_fn,
            steps,
            lr=1e-2,
            params=params,
            log_every=1,
            progress=False,
            callback=stop,
            checkpoint=tmp_path / "ckpt.pt",
            checkpoint_every=2,
            rngs=(k_rng, gen),
        )
    except KeyboardInterrupt:
        return None
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_lora_checkpoint_holds_trainable_tensors_and_resumes_exactly(tmp_path):
    whole = _lora_run(tmp_path / "a", 5)
    assert _lora_run(tmp_path / "b", 5, interrupt_at=3) is None
    state = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)
    assert state["step"] == 2 and set(state["model"]) == set(whole)  # adapters + mask row, no base weight
    resumed = _lora_run(tmp_path / "b", 5)
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name


@pytest.mark.parametrize("content", [b"", b"not a checkpoint", "state_dict"])
def test_train_loop_refuses_foreign_checkpoints(tmp_path, content):
    path = tmp_path / "ckpt.pt"
    if content == "state_dict":
        torch.save(tiny(True).state_dict(), path)
    else:
        path.write_bytes(content)
    model = tiny(True)
    with pytest.raises(ValueError, match=f"{path.name} is not a train_loop checkpoint"):
        train_loop(model, [_ids()], lambda m, b: m(b).logits.mean(), 1, progress=False, checkpoint=path)


def test_train_loop_checkpoint_loading_executes_no_code(tmp_path):
    """A pickle that would run code when unpickled is refused by weights-only loading."""

    class Evil:
        def __reduce__(self):
            return (exec, (f"import pathlib; pathlib.Path({str(tmp_path / 'ran')!r}).write_text('ran')",))

    path = tmp_path / "ckpt.pt"
    torch.save({"step": 1, "model": Evil(), "optimizer": {}, "scheduler": {}, "history": [], "rngs": []}, path)
    with pytest.raises(ValueError, match="not a train_loop checkpoint"):
        train_loop(tiny(True), [_ids()], lambda m, b: m(b).logits.mean(), 1, progress=False, checkpoint=path)
    assert not (tmp_path / "ran").exists()


def test_train_loop_refuses_a_checkpoint_of_another_run(tmp_path):
    """A checkpoint saved with two generators, resumed with one: one clear error naming the file."""
    _lora_run(tmp_path, 2)
    model = tiny(True)
    _, params = adapters.prepare(model, MASK, "lora", rank=4)
    with pytest.raises(ValueError, match=r"ckpt.pt saved 2 generator state\(s\), this run passes 1"):
        train_loop(
            model,
            [_ids()],
            lambda m, b: m(b).logits.mean(),
            3,
            params=params,
            progress=False,
            checkpoint=tmp_path / "ckpt.pt",
            rngs=(random.Random(0),),
        )


def test_train_loop_empty_data_is_an_error():
    with pytest.raises(ValueError, match="data yielded no batch"):
        train_loop(tiny(True), [], lambda m, b: m(b).logits.mean(), 3, progress=False)


def test_train_loop_data_running_out_records_the_step_reached(tmp_path):
    """A one-shot iterator of 3 batches for 5 steps: a warning, and the checkpoint says step 3, so a resume with
    fresh data trains the 2 steps left."""
    model = tiny(True)
    loss_fn = lambda m, b: m(b).logits.float().pow(2).mean()  # noqa: E731
    with pytest.warns(UserWarning, match="data ran out after step 3 of 5"):
        hist = train_loop(
            model,
            iter([_ids(s) for s in range(3)]),
            loss_fn,
            5,
            progress=False,
            log_every=1,
            checkpoint=tmp_path / "ckpt.pt",
        )
    assert [h["step"] for h in hist] == [1, 2, 3]
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 3
    hist = train_loop(tiny(True), [_ids(7)], loss_fn, 5, progress=False, log_every=1, checkpoint=tmp_path / "ckpt.pt")
    assert [h["step"] for h in hist] == [1, 2, 3, 4, 5]
