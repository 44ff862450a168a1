"""Issue 61 (hardening round 5), the drafter's artifact and verify decoding: a mask id that is an ordinary token of
the base it is loaded over is refused (item 2); the config's sampler-head size is checked against the stored shapes
before anything is built (item 8); the factors must be finite in the load dtype, and a drafter whose block rows give
NaN / inf logits costs only its drafts in verify mode (item 9); a relative ``base_model_name_or_path`` is relative to
the drafter's folder (item 11).

The folder bases are copies of the embedded ``ntp-arith`` Llama (3 MB, 238 tokens, its tokenizer's mask token id 3)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from sbd_models import MASK_ID, broken_drafter, random_prompts, single_thread, tiny_llama  # noqa: F401

import sbd_ext
from sbd_ext import drafter
from sbd_ext.artifact_checks import ArtifactError
from sbd_ext.demo import models
from sbd_ext.drafter import artifact

pytestmark = pytest.mark.usefixtures("single_thread")

ARITH_VOCAB = 238


def _arith(folder):
    return shutil.copytree(models.path("ntp-arith"), folder, ignore=shutil.ignore_patterns("train_log.json"))


def _drafter_over(base_dir, dest, seed=0, **save_kw):
    """A drafter over the folder base ``base_dir`` whose mask token is a new row (id = the base's vocabulary size)."""
    model, _ = drafter.load_folder_base(base_dir)
    assert model.get_input_embeddings().weight.shape[0] == ARITH_VOCAB
    model.resize_token_embeddings(ARITH_VOCAB + 1, mean_resizing=False)
    params = drafter.attach(model, ARITH_VOCAB, rank=2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    drafter.save_drafter(model, dest, {"sbd_block_size_range": [2, 4]}, dtype=torch.float32, **save_kw)
    return dest


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    """(B1: the base the drafter was made over, B2: a base of 300 tokens (62 added), the drafter folder)."""
    root = tmp_path_factory.mktemp("arith")
    b1 = _arith(root / "b1")
    b2 = _arith(root / "b2")
    model, tok = drafter.load_folder_base(b2)
    tok.add_tokens([f"extra{i}" for i in range(300 - ARITH_VOCAB)])
    model.resize_token_embeddings(300, mean_resizing=False)
    assert len(tok) == 300
    model.save_pretrained(b2)
    tok.save_pretrained(b2)
    return b1, b2, _drafter_over(b1, root / "d", base_model_name_or_path=str(b1))


# ---------------------------------------------------------------------------------------------------- item 2
def test_a_mask_id_that_is_an_ordinary_token_of_the_base_is_refused(arith):
    _, b2, d = arith
    model, _ = drafter.load_drafter(d)  # over its own base: the row is appended
    assert model.get_input_embeddings().weight.shape[0] == ARITH_VOCAB + 1
    with pytest.raises(ArtifactError, match=r"adapter_config.json: field 'sbd.mask_token_id' is 238.*size 300"):
        drafter.load_drafter(d, base=b2)
    with pytest.raises(ArtifactError, match="sbd.mask_token_id"):  # the same through load_weights
        drafter.load_weights(drafter.load_folder_base(b2)[0], d)


def test_a_mask_id_the_base_names_is_accepted(arith, tmp_path):
    _, b2, d = arith
    named = shutil.copytree(b2, tmp_path / "named")
    cfg = json.loads((named / "config.json").read_text())
    (named / "config.json").write_text(json.dumps({**cfg, "mask_token_id": ARITH_VOCAB}))
    model, _ = drafter.load_drafter(d, base=named)  # id 238 is the base's own mask token: no row appended
    assert model.get_input_embeddings().weight.shape[0] == 300 and drafter.get_drafter(model).mask_token_id == 238


# ---------------------------------------------------------------------------------------------------- item 8
@pytest.mark.parametrize("hidden", [10**9, 8])
def test_the_sampler_head_size_is_checked_before_anything_is_built(tmp_path, monkeypatch, hidden):
    base = tiny_llama(seed=1, block_size_range=(2, 8))
    model = copy.deepcopy(base)
    drafter.attach(model, MASK_ID, rank=2)
    drafter.get_drafter(model).sampler_head = drafter.SamplerHead(64, hidden=16, topk=4)
    sbd = {"sbd_block_size_range": [2, 8]}
    folder = broken_drafter(model, tmp_path, sbd, lambda c: c["sbd"]["sampler_head"].update(hidden=hidden))

    def built(*a, **k):
        raise AssertionError("a sampler head was built before its size was checked")

    def loaded(*a, **k):
        raise AssertionError("the tensors were loaded before the shapes were checked")

    monkeypatch.setattr(artifact.SamplerHead, "__init__", built)
    monkeypatch.setattr(artifact, "load_tensor_file", loaded)
    with pytest.raises(ArtifactError, match=r"adapter_config.json: field 'sbd.sampler_head.hidden' is " + str(hidden)):
        drafter.load_weights(base, folder)
    assert drafter.get_drafter(base) is None


# ---------------------------------------------------------------------------------------------------- item 9
@pytest.mark.parametrize("dtype, value", [(torch.bfloat16, 3.4e38), (torch.float16, 1e5)])  # finite in fp32 only
def test_factors_must_be_finite_in_the_load_dtype(tmp_path, dtype, value):
    base = tiny_llama(seed=3, block_size_range=(2, 8))
    model = copy.deepcopy(base)
    drafter.attach(model, MASK_ID, rank=2)
    sbd = {"sbd_block_size_range": [2, 8]}
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"

    def big(t):
        t[key] = t[key].float()
        t[key][0, 0] = value

    folder = broken_drafter(model, tmp_path, sbd, edit_tensors=big)
    drafter.load_weights(copy.deepcopy(base), folder)  # fp32: finite
    for target, kw in ((copy.deepcopy(base), {"dtype": dtype}), (copy.deepcopy(base).to(dtype), {})):
        where = r"adapter_model.safetensors: tensor '.*q_proj.lora_B.weight'"
        with pytest.raises(ArtifactError, match=rf"{where}.*{dtype}"):
            drafter.load_weights(target, folder, **kw)
        assert drafter.get_drafter(target) is None


def test_load_drafter_checks_finiteness_in_its_dtype(arith, tmp_path):
    _, _, d = arith
    bad = shutil.copytree(d, tmp_path / "bad")
    from safetensors.torch import load_file, save_file

    t = load_file(bad / drafter.WEIGHTS_FILE)
    t["sbd_mask_row"][3] = 3.4e38
    save_file(t, bad / drafter.WEIGHTS_FILE)
    drafter.load_drafter(bad)  # fp32
    with pytest.raises(ArtifactError, match=r"tensor 'sbd_mask_row' .*torch.bfloat16"):
        drafter.load_drafter(bad, dtype=torch.bfloat16)


def _non_finite_drafter(base, value: float):
    """``base`` with a drafter whose last layer's MLP adapter sends every block row to ``value`` (inf / NaN): the
    block rows' logits are non-finite, the committed rows are the base's."""
    model = copy.deepcopy(base)
    drafter.attach(model, MASK_ID, rank=2)
    with torch.no_grad():
        m = model.model.layers[-1].mlp.down_proj
        m.lora_A.fill_(1.0)
        m.lora_B.fill_(value)
    return model


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_with_non_finite_drafts_returns_the_base_answer(value, temperature):
    base = tiny_llama(seed=2, block_size_range=(2, 8))
    model = _non_finite_drafter(base, value)
    kw = dict(max_new_tokens=16, temperature=temperature, seed=11)
    for lengths in ([7, 11, 4], [9]):  # a batch (a 0/1 gate over the rows) and one sequence (a row range)
        ids, att = random_prompts(lengths, seed=5)
        ref = sbd_ext.generate(base, ids, att, mode="ntp", **kw)
        for extra in ({}, {"lookup": 4}, {"branch": True}):
            out = sbd_ext.generate(model, ids, att, block_size=4, verify=True, **kw, **extra)
            assert torch.equal(out.sequences, ref.sequences), (lengths, extra)
            assert (out.nfe <= ref.nfe).all()
    with pytest.raises(RuntimeError, match="NaN or \\+inf"):  # unverified SBD has nothing to fall back on
        sbd_ext.generate(model, ids, att, block_size=4, max_new_tokens=8)


# ---------------------------------------------------------------------------------------------------- item 11
def test_a_relative_base_path_is_relative_to_the_drafter_folder(arith, tmp_path, monkeypatch):
    _, _, d = arith
    ship = tmp_path / "ship"
    _arith(ship / "base")
    shipped = shutil.copytree(d, ship / "drafter")
    cfg = json.loads((shipped / drafter.CONFIG_FILE).read_text())
    (shipped / drafter.CONFIG_FILE).write_text(json.dumps({**cfg, "base_model_name_or_path": "../base"}))
    work = tmp_path / "work"
    decoy = _arith(work / "base")  # what "../base" names from the working directory below
    (work / "cwd").mkdir()
    monkeypatch.chdir(work / "cwd")
    assert drafter.base_folder(drafter.read_drafter_config(shipped), shipped) == shipped / "../base"
    model, _ = drafter.load_drafter(shipped)
    assert (shipped / model.name_or_path).resolve() == (ship / "base").resolve() != decoy.resolve()
    with pytest.raises(ArtifactError, match="relative path '../base'"):
        drafter.base_folder(drafter.read_drafter_config(shipped))
