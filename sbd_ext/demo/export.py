"""An embedded model saved as a transformers checkpoint that decodes with SBD wherever transformers decodes:
``model.generate``, streamers, ``pipeline("text-generation")`` and ``transformers serve`` (``sbd-ext export``).

The folder holds the weights, the tokenizer with a chat template (the model's own prompt format from its
``sbd_demo.json``, over any template the tokenizer had), ``generation_config.json`` with the model's recommended SBD
settings (``sbd_block_size``, ``sbd_sampler``, ``sbd_threshold``, ``sbd_verify``: from its ``sbd_demo.json``),
``custom_generate/`` (loaded by ``from_pretrained(dir, trust_remote_code=True)``), the ``sbd_demo.json`` (for
``sbd-ext generate --model DIR``) and a model card (``README.md``: how to load it). ``plain=True`` saves the same
files without ``custom_generate/`` and without SBD settings: the checkpoint as transformers serves any next-token
model (the NTP control, served plainly, for comparisons). Without ``plain`` the model must be an SBD model; the
destination must be a new or empty folder.

The chat template writes the BOS token as text, so the saved tokenizer maps special-token strings in a message to
the special tokens (``split_special_tokens`` off, as in most chat tokenizers); the embedded tokenizers themselves keep
typed ``<eos>`` as text.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import adapters, drafter
from ..integration import save_pretrained
from ..integration.chat import chat_template_for
from ..metadata import MASK_TOKEN_ATTR, set_sbd_metadata
from . import models

__all__ = ["export", "recommended_settings"]


def recommended_settings(info: dict) -> dict:
    """The ``sbd_*`` generation-config fields a model's ``sbd_demo.json`` recommends (objective "sbd" only)."""
    if info.get("objective", "sbd") != "sbd" or "block_size" not in info:
        return {}
    fields = {"sbd_block_size": int(info["block_size"]), "sbd_sampler": info.get("sampler", "eb")}
    if "gamma_low" in info:
        fields["sbd_threshold"] = float(info["gamma_low"])
    if info.get("verify"):
        fields["sbd_verify"] = True
    return fields


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def _check_dest(dest) -> Path:
    """``dest`` as a Path: a folder that does not exist yet or is empty (export never writes over files)."""
    if dest is None or not str(dest).strip():
        raise ValueError(f"export needs a destination folder, got {str(dest)!r}; name a new or empty folder")
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise FileExistsError(f"{dest} exists and is not a folder; choose a new or empty folder")
    if dest.is_dir():
        present = sorted(p.name for p in dest.iterdir())
        if "config.json" in present:
            raise FileExistsError(f"{dest} already holds a checkpoint (config.json); choose an empty folder")
        if present:
            shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
            raise FileExistsError(
                f"{dest} is not empty ({shown}): export would overwrite files there; choose a new or empty folder"
            )
    return dest


def _json_field(path: Path, key: str):
    """``key`` of the JSON object in ``path`` (None when the file is not one: its loader reports that)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data.get(key) if isinstance(data, dict) else None


_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json")


def _check_tokenizer_json(folder: Path) -> None:
    """The folder's JSON tokenizer files parse (the tokenizer's loader reports a bad one without its name)."""
    for name in _TOKENIZER_JSON:
        path = folder / name
        if not path.is_file():
            continue
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:
            link = f" (a link to {path.resolve()})" if path.is_symlink() else ""
            raise ValueError(
                f"{path}{link} is not a JSON file ({e}): copy the model's tokenizer files into {folder}"
            ) from e


def _check_source(name_or_path, info: dict, plain: bool) -> None:
    """Refuse, before anything is loaded or written, a checkpoint folder without a tokenizer, and (without
    ``plain``) a checkpoint or adapter artifact that was not trained for SBD. Other kinds of model folder are left
    to their loader."""
    folder = models.path(name_or_path)
    if (folder / "config.json").is_file():
        if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
            raise ValueError(
                f"{folder} has no tokenizer ({' / '.join(_TOKENIZER_FILES)}): copy the model's tokenizer files into it"
            )
        _check_tokenizer_json(folder)
        mask_id = _json_field(folder / "config.json", MASK_TOKEN_ATTR)
    elif adapters.is_artifact(folder):
        mask_id = _json_field(folder / "sbd_config.json", MASK_TOKEN_ATTR)
    else:
        return
    objective = info.get("objective", "sbd")
    if not plain and (objective != "sbd" or mask_id is None):
        why = f"sbd_demo.json objective {objective!r}" if objective != "sbd" else f"its config has no {MASK_TOKEN_ATTR}"
        raise ValueError(
            f"{name_or_path} is not an SBD model ({why}): SBD decoding would refuse it; export it with --plain "
            f"(plain=True) to serve it as a next-token model"
        )


def _adds_bos(tok) -> bool:
    """Whether the tokenizer puts its BOS token in front of encoded text (then the chat template writes it too)."""
    bos = getattr(tok, "bos_token_id", None)
    return bos is not None and tok("x")["input_ids"][:1] == [bos]


def _model_card(name: str, plain: bool, template: str | None, settings: dict) -> str:
    fmt = f"`{template!r}`" if template else "the tokenizer's chat template"
    if plain:
        return f"""# {name} (plain next-token checkpoint)

Exported by `sbd-ext export --plain` from `{name}`: no `custom_generate/` and no SBD settings. transformers decodes it
next-token like any causal LM: no remote code runs and `sbd_ext` is not involved.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("PATH")
```

Prompt format: {fmt} (the chat template renders a user message this way).
"""
    shown = ", ".join(f"`{k}={v!r}`" for k, v in settings.items()) or "the defaults"
    return f"""# {name} (Set Block Decoding checkpoint)

Exported by `sbd-ext export` from `{name}`. It decodes with Set Block Decoding (several tokens per forward) through
`custom_generate/`, which transformers only runs when the checkpoint is loaded with `trust_remote_code=True` and the
`sbd_ext` package is installed. Loaded without it, `model.generate` decodes next-token (transformers' own decoding,
slower and not what the settings below describe); with `sbd_ext` imported it warns when that happens.

```python
import sbd_ext  # registers attn_implementation="sbd" (without the import: transformers lists its own backends)
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("PATH", trust_remote_code=True, attn_implementation="sbd")
tok = AutoTokenizer.from_pretrained("PATH")
ids = tok.apply_chat_template([{{"role": "user", "content": "..."}}], add_generation_prompt=True,
                              return_dict=True, return_tensors="pt")
out = model.generate(**ids, max_new_tokens=160)
```

Serve it: `transformers serve PATH --trust-remote-code` (not `--continuous-batching`, which SBD cannot run).

- Recommended SBD settings (`generation_config.json`): {shown}; override them per call with `sbd_*` keywords or a
  request's `generation_config`.
- Prompt format: {fmt}; the chat template renders a user message this way (system messages are refused).
- The command line: `sbd-ext generate --model PATH "question"` uses the same settings and prompt format.
"""


def _drafter_fields(name_or_path) -> dict:
    """The SBD fields of the source drafter, as an exported checkpoint keeps them (its base is the checkpoint)."""
    sbd = dict(drafter.read_drafter_config(models.path(name_or_path))["sbd"])
    sbd.pop("mask_token_id", None)  # save_drafter writes the attached drafter's own
    sbd.pop("gated", None)
    return sbd


def _base_vocabulary(model) -> None:
    """Detach ``model``'s gated drafter (already saved) and give the base its original vocabulary back: the mask
    token's row, appended after the vocabulary when the drafter was made, lives in the drafter (its mask row), so
    the checkpoint is the unmodified model, which any Llama runtime (vLLM included) serves as it is. Loading the
    drafter onto it appends the row again (:func:`sbd_ext.drafter.load_weights`)."""
    mask_id = drafter.get_drafter(model).mask_token_id
    drafter.detach(model)
    if mask_id == model.get_input_embeddings().weight.shape[0] - 1:
        model.resize_token_embeddings(mask_id, mean_resizing=False)
        set_sbd_metadata(model, None, None)  # a plain config: the drafter carries the mask id and block sizes


def export(name_or_path: str | Path, dest: str | Path, plain: bool = False, dtype: torch.dtype = torch.float32) -> Path:
    """Save the embedded model ``name_or_path`` (or a model folder / SBD artifact) to ``dest`` as described in the
    module docstring; returns ``dest``. ``dest`` must be a new or empty folder; without ``plain`` the model must be
    an SBD model (a mask token in its config)."""
    dest = _check_dest(dest)
    info = models.demo_info(name_or_path)
    _check_source(name_or_path, info, plain)
    model, tok = models.load(name_or_path, dtype=dtype, attn_implementation="sdpa")
    template = info.get("prompt_template")
    if template:
        # The model's own prompt format, over a chat template the tokenizer brought (SmolLM2's ChatML was not what
        # the model was fine-tuned on).
        tok.chat_template = chat_template_for(template, bos_token=_adds_bos(tok))
        # The template writes the BOS token as text: it must map to the special token, not to its characters.
        tok.split_special_tokens = False
    elif not getattr(tok, "chat_template", None):
        raise ValueError(f"{name_or_path}: the tokenizer has no chat template and sbd_demo.json no prompt_template")
    gc = model.generation_config
    for key in [k for k in vars(gc) if k.startswith("sbd_")]:
        delattr(gc, key)
    # A generation config built from the model config is marked so, and transformers rebuilds such a config from the
    # model config on load, dropping every sbd_* field: this one is the checkpoint's own.
    gc._from_model_config = False
    fields = {} if plain else recommended_settings(info)
    gated = drafter.get_drafter(model) is not None
    if gated and not plain:  # the drafter's recommended settings (its adapter_config.json)
        fields = dict(drafter.read_drafter_config(models.path(name_or_path))["sbd"].get("generation", {}))
    if gated and not plain:  # saved beside the base, never merged into it
        drafter.save_drafter(model, dest / drafter.CHECKPOINT_SUBFOLDER, _drafter_fields(name_or_path))
    if gated:
        _base_vocabulary(model)
    if plain:
        model.save_pretrained(dest)
    else:
        for key, value in fields.items():
            setattr(gc, key, value)
        save_pretrained(model, dest)
    tok.save_pretrained(dest)
    if info:  # the prompt format, task and settings, for sbd-ext generate --model DEST
        (dest / "sbd_demo.json").write_text(json.dumps(info, indent=1) + "\n")
    name = Path(str(name_or_path)).name
    (dest / "README.md").write_text(_model_card(name, plain, template, fields))
    return dest
