"""``sbd-ext export``: an embedded model as a transformers checkpoint (SBD, or plain for the NTP control), and the
``sbd_compile`` generation-config field."""

from __future__ import annotations

import json

import pytest
from sbd_models import single_thread  # noqa: F401  (fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import sbd_ext
from sbd_ext.decoding.gen_config import sbd_fields
from sbd_ext.demo import cli, export, models, tasks
from sbd_ext.integration.chat import chat_template_for

pytestmark = pytest.mark.usefixtures("single_thread")


def test_plain_export_is_an_ordinary_checkpoint(tmp_path):
    """--plain: no custom_generate/, no sbd_* fields; transformers' own generate answers like the model does."""
    dest = export.export(models.CONTROL_MODEL, tmp_path / "ntp", plain=True)
    assert not (dest / "custom_generate").exists()
    assert not any(k.startswith("sbd_") for k in json.loads((dest / "generation_config.json").read_text()))
    model = AutoModelForCausalLM.from_pretrained(dest, trust_remote_code=True)
    assert "generate" not in vars(model)  # transformers' generate, not SBD's
    tok = AutoTokenizer.from_pretrained(dest)
    q = next(iter(tasks.problems("test", 1)))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": q.message}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    assert ids[0].tolist() == tok(q.prompt)["input_ids"]
    out = model.generate(ids, max_new_tokens=96, do_sample=False)
    assert tasks.extract_answer(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)) == q.answer


def test_sbd_export_generates_like_sbd_ext(tmp_path):
    dest = export.export(models.DEFAULT_MODEL, tmp_path / "sbd")
    model = AutoModelForCausalLM.from_pretrained(dest, trust_remote_code=True, attn_implementation="sbd")
    ref, tok = models.load(models.DEFAULT_MODEL)
    info = models.demo_info(models.DEFAULT_MODEL)
    ids = tok(next(iter(tasks.problems("test", 1))).prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=64, return_dict_in_generate=True)
    want = sbd_ext.generate(
        ref, ids, block_size=info["block_size"], threshold=info["gamma_low"], max_new_tokens=64, return_trace=False
    )
    n = int(want.num_generated[0])
    assert out.sequences[0, ids.shape[1] : ids.shape[1] + n].tolist() == want.sequences[0, -n:].tolist()
    assert int(out.nfe[0]) == int(want.nfe[0]) < n  # SBD: fewer forwards than tokens


def test_export_refuses_an_existing_checkpoint(tmp_path, capsys):
    dest = export.export(models.CONTROL_MODEL, tmp_path / "x", plain=True)
    with pytest.raises(FileExistsError):
        export.export(models.DEFAULT_MODEL, dest)
    assert cli.main(["export", str(dest)]) == 1
    assert "already holds a checkpoint" in capsys.readouterr().err


def test_cli_export(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path / "out"), "--model", "sbd-sort"]) == 0
    assert "--trust-remote-code" in capsys.readouterr().out
    gc = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert gc["sbd_block_size"] == models.demo_info("sbd-sort")["block_size"]


@pytest.mark.parametrize("bad", ["Q: {prompt} {prompt}", "no slot"])
def test_chat_template_needs_one_prompt_slot(bad):
    with pytest.raises(ValueError, match="exactly once"):
        chat_template_for(bad)


def test_sbd_compile_field():
    """sbd_compile is an sbd_* field like the others (mapped to GenerationSettings.compile, validated)."""
    assert sbd_fields(GenerationConfig(sbd_compile=True)) == {"compile": True}
    with pytest.raises(TypeError, match="sbd_compile"):
        sbd_fields(GenerationConfig(sbd_compile="yes"))
