"""sbd_ext.adapters: LoRA + the trainable mask row, their merge, the compact artifact, and train_loop's checkpoint of
trainable tensors only (resume, safe loading). Every comparison is against the plain model with the change written
into its weights by hand, not against the adapter code itself."""

from __future__ import annotations

import json
import random

import pytest
import torch
from sbd_models import tiny_llama
from transformers import LlamaForCausalLM

import sbd_ext.metadata
from sbd_ext import adapters, artifact_checks
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
    adapters.save_artifact(
        model, mask_row, "lora", tmp_path / "a", {"base_loader": "os:system", "sbd_block_size_range": [2, 8]}
    )
    with pytest.raises(ValueError, match="'os:system', which is not a known base loader"):
        adapters.load_artifact(tmp_path / "a")
    other = tiny_llama(vocab=V, hidden=48, intermediate=64, mask_id=None, init_range=0.02, lm_scale=1.0)
    with pytest.raises(ValueError, match=r"mask_row.safetensors: tensor 'mask_row' must be \[48\]"):
        adapters.apply_artifact(other, tmp_path / "a")


# ------------------------------------------------------------------------------------------------------------
# Malformed and untrusted artifacts (issue 35, items 10, 11, 13): an error naming the file and the field or tensor,
# before the model is changed; never a silent load, a KeyError, a ZeroDivisionError or a program run on import.
# ------------------------------------------------------------------------------------------------------------
def _artifact(tmp_path, method="lora", rank=4, tie=True, **config):
    model = tiny(tie)
    mask_row, params = adapters.prepare(model, MASK, method, rank=rank)
    _perturb(params)
    folder = tmp_path / "a"
    adapters.save_artifact(model, mask_row, method, folder, {"sbd_block_size_range": [2, 8], **config})
    return folder


def _edit_config(folder, **changes):
    cfg = json.loads((folder / adapters.CONFIG_FILE).read_text())
    for k, v in changes.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / adapters.CONFIG_FILE).write_text(json.dumps(cfg))


def _edit_tensors(folder, file, fn):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / file)
    fn(tensors)
    save_file(tensors, folder / file)


_DROP = object()


def _first(tensors, suffix):
    return next(k for k in sorted(tensors) if k.endswith(suffix))


def _assert_untouched(model, ref):
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), f"{n} was changed by a refused artifact"


def test_config_rank_must_match_the_factors(tmp_path):
    """sbd_config.json says rank 4 over rank-8 factors (item 10): refused, naming the file and the field (it
    loaded with the JSON's scale alpha / 4 before)."""
    folder = _artifact(tmp_path, rank=8)
    _edit_config(folder, rank=4)
    model, ref = tiny(True), tiny(True)
    with pytest.raises(
        adapters.ArtifactError, match=r"sbd_config.json: field 'rank' is 4, but the LoRA factors .*rank 8"
    ):
        adapters.apply_artifact(model, folder)
    _assert_untouched(model, ref)


@pytest.mark.parametrize(
    "file, edit, match",
    [
        ("adapter", lambda t: t[_first(t, ".lora_A")].__setitem__((0, 0), float("nan")), r"lora_A' holds 1 non-finite"),
        ("adapter", lambda t: t[_first(t, ".lora_B")].__setitem__((1, 1), float("inf")), r"lora_B' holds 1 non-finite"),
        ("mask_row", lambda t: t["mask_row"].__setitem__(3, float("nan")), r"mask_row.safetensors: tensor 'mask_row'"),
        ("config", {"alpha": float("nan")}, r"sbd_config.json: field 'alpha' must be a finite number"),
        ("config", {"alpha": float("inf")}, r"sbd_config.json: field 'alpha' must be a finite number"),
    ],
)
def test_non_finite_artifacts_are_refused_at_load(tmp_path, file, edit, match):
    """NaN / inf factors, alpha or mask row (item 10): refused when loaded, not found later by decoding."""
    folder = _artifact(tmp_path)
    if file == "config":
        _edit_config(folder, **edit)
    else:
        _edit_tensors(folder, adapters.ADAPTER_FILE if file == "adapter" else adapters.MASK_ROW_FILE, edit)
    model, ref = tiny(True), tiny(True)
    with pytest.raises(adapters.ArtifactError, match=match):
        adapters.apply_artifact(model, folder)
    _assert_untouched(model, ref)
    fresh = tiny(True)
    row, _ = adapters.prepare(fresh, MASK, "lora", rank=4)
    with pytest.raises(adapters.ArtifactError, match=match):
        adapters.load_trainable(fresh, row, folder)


def _drop_b(t):
    del t[_first(t, ".lora_B")]


def _rank_differs(t):
    k = _first(t, ".lora_A")
    t[k] = t[k][:2].contiguous()
    kb = k[: -len(".lora_A")] + ".lora_B"
    t[kb] = t[kb][:, :2].contiguous()


@pytest.mark.parametrize(
    "kind, edit, match",
    [
        ("config", {"rank": _DROP}, r"sbd_config.json: field 'rank' is missing"),
        ("config", {"rank": 0}, r"sbd_config.json: field 'rank' must be an integer >= 1, got 0"),
        ("config", {"rank": "4"}, r"field 'rank' must be an integer >= 1, got '4'"),
        ("config", {"alpha": _DROP}, r"field 'alpha' is missing"),
        ("config", {"method": "qlora"}, r"field 'method' must be one of"),
        ("config", {"method": _DROP}, r"field 'method' is missing"),
        ("config", {"mask_token_id": _DROP}, r"field 'mask_token_id' is missing"),
        ("config", {"mask_token_id": 10**6}, r"field 'mask_token_id' is 1000000, outside the model's vocabulary"),
        ("config", {"mask_token_id": -1}, r"field 'mask_token_id' must be an integer >= 0"),
        ("config", {"sbd_block_size_range": [8, 2]}, r"field 'sbd_block_size_range' must be \[lo, hi\]"),
        ("config", {"generation": [1]}, r"field 'generation' must be a JSON object"),
        ("adapter", _drop_b, r"adapter.safetensors: layer '.*' has no .*lora_B tensor"),
        ("adapter", _rank_differs, r"adapter.safetensors: the LoRA layers have different ranks"),
        ("adapter", lambda t: t.__setitem__("stray", torch.zeros(2)), r"tensor 'stray' is neither"),
        ("mask_row", lambda t: t.__setitem__("mask_row", torch.zeros(31)), r"'mask_row' must be \[32\]"),
        ("mask_row", lambda t: t.__setitem__("row", t.pop("mask_row")), r"unexpected tensor\(s\) \['row'\]"),
        ("mask_row", lambda t: t.__setitem__("mask_row", torch.zeros(2, 32)), r"'mask_row' must be \[32\]"),
    ],
)
def test_malformed_artifacts_name_the_file_and_field(tmp_path, kind, edit, match):
    """Item 13: a KeyError / ZeroDivisionError / shape error naming nothing before; now one ArtifactError (a
    ValueError) naming the file and the field or tensor, for apply, load_trainable and load_artifact alike."""
    folder = _artifact(tmp_path)
    if kind == "config":
        _edit_config(folder, **edit)
    else:
        _edit_tensors(folder, adapters.ADAPTER_FILE if kind == "adapter" else adapters.MASK_ROW_FILE, edit)
    model, ref = tiny(True), tiny(True)
    with pytest.raises(adapters.ArtifactError, match=match):
        adapters.apply_artifact(model, folder)
    _assert_untouched(model, ref)
    fresh = tiny(True)
    row, _ = adapters.prepare(fresh, MASK, "lora", rank=4)
    with pytest.raises(adapters.ArtifactError, match=match):
        adapters.load_trainable(fresh, row, folder)


@pytest.mark.parametrize(
    "content, match",
    [
        ("[1, 2]", r"sbd_config.json: must hold a JSON object, got a JSON list"),
        ("{not json", r"sbd_config.json: not valid JSON"),
    ],
)
def test_config_that_is_not_an_object(tmp_path, content, match):
    folder = _artifact(tmp_path)
    (folder / adapters.CONFIG_FILE).write_text(content)
    with pytest.raises(adapters.ArtifactError, match=match):
        adapters.apply_artifact(tiny(True), folder)
    with pytest.raises(adapters.ArtifactError, match=match):
        adapters.load_artifact(folder)


@pytest.mark.parametrize("file", [adapters.ADAPTER_FILE, adapters.MASK_ROW_FILE])
def test_truncated_safetensors(tmp_path, file):
    folder = _artifact(tmp_path)
    data = (folder / file).read_bytes()
    (folder / file).write_bytes(data[: len(data) - 40])
    with pytest.raises(adapters.ArtifactError, match=rf"{file}: not a readable safetensors file"):
        adapters.apply_artifact(tiny(True), folder)


def test_load_artifact_needs_the_range_and_a_loader(tmp_path):
    folder = _artifact(tmp_path)
    _edit_config(folder, base_loader="sbd_ext.recipes.smollm2.checkpoint:load_base", sbd_block_size_range=_DROP)
    with pytest.raises(adapters.ArtifactError, match=r"field 'sbd_block_size_range' is missing"):
        adapters.load_artifact(folder)
    _edit_config(folder, base_loader=_DROP, sbd_block_size_range=[2, 8])
    with pytest.raises(adapters.ArtifactError, match=r"field 'base_loader' is missing"):
        adapters.load_artifact(folder)
    _edit_config(folder, base_loader="os.system")
    with pytest.raises(adapters.ArtifactError, match=r"field 'base_loader' must be 'module:function'"):
        adapters.load_artifact(folder)


def test_unknown_base_loaders_are_refused_unless_trusted(tmp_path, monkeypatch):
    """Item 11: a loader that is not known is not imported (its import would run code) unless the user opts in;
    a __main__ module never is; a loader that exits does not end the caller (SystemExit is not an Exception)."""
    import sys
    import types

    ran = []
    folder = _artifact(tmp_path, base_loader="sbd_ext.demo.__main__:main")
    with pytest.raises(adapters.ArtifactError, match=r"'sbd_ext.demo.__main__:main', a __main__ module"):
        adapters.load_artifact(folder)
    with pytest.raises(adapters.ArtifactError, match=r"a __main__ module"):
        adapters.load_artifact(folder, trust_base_loader=True)  # trusted or not: importing it runs a program
    assert "sbd_ext.demo.__main__" not in sys.modules

    mod = types.ModuleType("sbd_test_loaders")
    mod.exits = lambda **kw: sys.exit(3)

    def base(**kw):
        ran.append(kw)
        return tiny(True), None

    mod.base = base
    monkeypatch.setitem(sys.modules, "sbd_test_loaders", mod)
    _edit_config(folder, base_loader="sbd_test_loaders:base")
    with pytest.raises(adapters.ArtifactError, match=r"not a known base loader .*trust_base_loader=True"):
        adapters.load_artifact(folder)
    assert ran == []
    model, _ = adapters.load_artifact(folder, trust_base_loader=True)
    assert len(ran) == 1 and sbd_ext.metadata.get_sbd_metadata(model) == (MASK, (2, 8))

    _edit_config(folder, base_loader="sbd_test_loaders:exits")
    with pytest.raises(adapters.ArtifactError, match=r"base loader 'sbd_test_loaders:exits' exited"):
        adapters.load_artifact(folder, trust_base_loader=True)

    monkeypatch.setattr(artifact_checks, "KNOWN_BASE_LOADERS", set(artifact_checks.KNOWN_BASE_LOADERS))
    _edit_config(folder, base_loader="sbd_test_loaders:base")
    artifact_checks.register_base_loader("sbd_test_loaders:base")
    adapters.load_artifact(folder)
    assert len(ran) == 2


def test_base_loader_that_exits_on_import(tmp_path, monkeypatch):
    """A trusted loader module whose import raises SystemExit: an ArtifactError, the caller goes on."""
    pkg = tmp_path / "pkgs"
    pkg.mkdir()
    (pkg / "sbd_exiting_mod.py").write_text("import sys\nsys.exit('bye')\ndef load(**kw):\n    pass\n")
    monkeypatch.syspath_prepend(str(pkg))
    folder = _artifact(tmp_path, base_loader="sbd_exiting_mod:load")
    with pytest.raises(adapters.ArtifactError, match=r"cannot be imported \(SystemExit: bye\)"):
        adapters.load_artifact(folder, trust_base_loader=True)


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


@pytest.mark.parametrize(
    "change, match",
    [
        ({"optimizer": {}}, r"'optimizer' has no 'state'"),  # item 17: was KeyError 'param_groups'
        ({"optimizer": {"state": {}, "param_groups": []}}, r"its 'optimizer' state does not fit"),
        ({"scheduler": {}}, r"its 'scheduler' state does not fit this run's scheduler \(missing key"),
        ({"step": "2"}, r"'step' must be an int >= 0, got str"),
        ({"step": -1}, r"'step' must be >= 0"),
        ({"history": None}, r"'history' must be a list"),
        ({"rngs": None}, r"'rngs' must be a list of generator states"),
        ({"model": {"x": 1}}, r"'model' must map parameter names to tensors"),
    ],
)
def test_train_loop_refuses_a_damaged_checkpoint(tmp_path, change, match):
    """A checkpoint with every key but a damaged value: one ValueError naming the file and the key, and the model
    left as it was (no KeyError, no half-loaded model)."""
    _lora_run(tmp_path, 2)
    path = tmp_path / "ckpt.pt"
    state = torch.load(path, weights_only=True)
    state.update(change)
    torch.save(state, path)
    model = tiny(True)
    _, params = adapters.prepare(model, MASK, "lora", rank=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    k_rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=rf"train_loop: {path}: .*{match}"):
        train_loop(
            model, [_ids()], lambda m, b: m(b).logits.mean(), 3, params=params, progress=False, checkpoint=path,
            rngs=(k_rng, gen),
        )  # fmt: skip
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


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


@pytest.mark.parametrize(
    "edit", [{"rank": _DROP}, {"sbd_block_size_range": _DROP}, {"base_loader": "sbd_ext.demo.__main__:main"}]
)
def test_cli_names_the_field_of_a_malformed_artifact(tmp_path, capsys, monkeypatch, edit):
    """`sbd-ext generate --model <artifact folder>` (item 13): one line naming the file and the field, exit 1, no
    traceback and no program run (a __main__ loader would have run the CLI again with the host's argv)."""
    from sbd_ext.demo import cli

    monkeypatch.delenv("SBD_EXT_TRACEBACK", raising=False)
    folder = _artifact(tmp_path, base_loader="sbd_ext.recipes.smollm2.checkpoint:load_base")
    _edit_config(folder, **edit)
    assert cli.main(["generate", "--model", str(folder), "--max-new-tokens", "4", "1+1="]) == 1
    err = capsys.readouterr().err
    field = next(iter(edit))
    assert "Traceback" not in err and f"sbd_config.json: field '{field}'" in err, err
