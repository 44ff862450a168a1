"""Checks of SBD artifacts, shared by every artifact format (:mod:`sbd_ext.adapters`' LoRA / attn / full artifact,
a peft-style drafter): a JSON config checked field by field, safetensors files read with an error naming them, LoRA
factor pairs (presence, 2-D, one rank, the config's rank, finite), mask rows, token ids, and the base loaders an
artifact may name (code that runs on load: only known ones, or with the user's opt-in; never a ``__main__``).

Every check raises :class:`ArtifactError` (a ValueError) naming the file and the field or tensor.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .metadata import set_sbd_metadata

__all__ = [
    "ArtifactError",
    "Field",
    "KNOWN_BASE_LOADERS",
    "load_on_base",
    "check_config",
    "check_finite",
    "check_lora_factors",
    "check_mask_rows",
    "check_token_id",
    "load_tensor_file",
    "lora_pairs",
    "tensor_shapes",
    "read_json_config",
    "register_base_loader",
    "resolve_base_loader",
]


class ArtifactError(ValueError):
    """A malformed artifact, or one naming a base loader that is not trusted: the message names the file and the
    field or tensor."""


@dataclass(frozen=True)
class Field:
    """What one field of a JSON config must be, for :func:`check_config`.

    kind: "int" (minimum: the least value), "number" (finite), "str", "choice" (one of ``choices``), "range" (two
    ints ``[lo, hi]``, ``minimum <= lo <= hi``), "dict", "str_list", "loader" (``"module:function"``)."""

    kind: str
    required: bool = True
    minimum: float | None = None
    choices: tuple = ()


_LOADER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_field(value, name: str, spec: Field, where: str):
    bad = f"{where}: field {name!r}"
    if spec.kind == "int":
        if not _is_int(value) or (spec.minimum is not None and value < spec.minimum):
            at_least = f" >= {int(spec.minimum)}" if spec.minimum is not None else ""
            raise ArtifactError(f"{bad} must be an integer{at_least}, got {value!r}")
    elif spec.kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ArtifactError(f"{bad} must be a finite number, got {value!r}")
    elif spec.kind == "str":
        if not isinstance(value, str) or not value:
            raise ArtifactError(f"{bad} must be a non-empty string, got {value!r}")
    elif spec.kind == "choice":
        if value not in spec.choices:
            raise ArtifactError(f"{bad} must be one of {list(spec.choices)}, got {value!r}")
    elif spec.kind == "range":
        lo_min = int(spec.minimum) if spec.minimum is not None else 0
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 2
            or not all(_is_int(v) for v in value)
            or not lo_min <= value[0] <= value[1]
        ):
            raise ArtifactError(f"{bad} must be [lo, hi], integers with {lo_min} <= lo <= hi, got {value!r}")
    elif spec.kind == "dict":
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ArtifactError(f"{bad} must be a JSON object, got {value!r}")
    elif spec.kind == "str_list":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ArtifactError(f"{bad} must be a list of strings, got {value!r}")
    elif spec.kind == "loader":
        if not isinstance(value, str) or not _LOADER_RE.match(value):
            raise ArtifactError(f"{bad} must be 'module:function', got {value!r}")
    else:  # pragma: no cover - a programming error in a spec
        raise ValueError(f"unknown field kind {spec.kind!r}")


def check_config(
    cfg, path: str | Path, fields: Mapping[str, Field], required_if: Mapping[str, Iterable[str]] = ()
) -> dict:
    """Check a loaded JSON config field by field against ``fields``; ``required_if`` maps ``"field=value"`` to the
    fields that value makes required (e.g. ``{"method=lora": ("rank", "alpha")}``). Returns ``cfg``. Raises
    :class:`ArtifactError` naming ``path`` and the field: a missing required field, a value of the wrong type or
    range. Fields not in ``fields`` are left alone."""
    if not isinstance(cfg, dict):
        raise ArtifactError(f"{path}: must hold a JSON object, got a JSON {type(cfg).__name__}")
    required = {name for name, spec in fields.items() if spec.required}
    for cond, names in dict(required_if).items():
        key, _, val = cond.partition("=")
        if str(cfg.get(key)) == val:
            required.update(names)
    for name in sorted(required):
        if name not in cfg:
            raise ArtifactError(f"{path}: field {name!r} is missing")
    for name, spec in fields.items():
        if name in cfg:
            _check_field(cfg[name], name, spec, str(path))
    return cfg


def read_json_config(path: str | Path, what: str = "an SBD artifact folder") -> dict:
    """A JSON object from ``path``: FileNotFoundError when absent, :class:`ArtifactError` (naming the file) when it
    is not JSON or not an object."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path.parent} is not {what}: {path.name} is missing") from None
    try:
        cfg = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ArtifactError(f"{path}: must hold a JSON object, got a JSON {type(cfg).__name__}")
    return cfg


def load_tensor_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file: FileNotFoundError naming it when absent, :class:`ArtifactError` naming it
    when it cannot be read (truncated, not safetensors)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path.parent}: {path.name} is missing")
    try:
        return load_file(path)
    except Exception as e:  # safetensors' SafetensorError (truncated / corrupt header), an OS error while reading
        raise ArtifactError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of a safetensors file, read from its header (nothing is loaded): shapes a config
    names are checked against these before anything is built. Errors as :func:`load_tensor_file`'s."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path.parent}: {path.name} is missing")
    try:
        with safe_open(path, framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors' SafetensorError (truncated / corrupt header), an OS error while reading
        raise ArtifactError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def lora_pairs(
    tensors: Mapping[str, torch.Tensor], path: str | Path, a_suffix: str = ".lora_A", b_suffix: str = ".lora_B"
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer: (A, B)}`` from tensors named ``<layer><a_suffix>`` / ``<layer><b_suffix>`` (this module's
    ``.lora_A``; peft's ``.lora_A.weight``). Raises :class:`ArtifactError` naming ``path`` and the tensor for a
    name of neither form or a layer with one factor only."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        for part, suffix in (("A", a_suffix), ("B", b_suffix)):
            if key.endswith(suffix):
                out.setdefault(key[: -len(suffix)], {})[part] = t
                break
        else:
            raise ArtifactError(f"{path}: tensor {key!r} is neither a {a_suffix} nor a {b_suffix} LoRA factor")
    for layer, parts in out.items():
        for part, suffix in (("A", a_suffix), ("B", b_suffix)):
            if part not in parts:
                raise ArtifactError(f"{path}: layer {layer!r} has no {layer + suffix} tensor")
    if not out:
        raise ArtifactError(f"{path}: holds no LoRA factors")
    return {layer: (parts["A"], parts["B"]) for layer, parts in sorted(out.items())}


def check_lora_factors(
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    path: str | Path,
    rank: int | None = None,
    rank_field: str = "rank",
    config_path: str | Path | None = None,
    suffixes: tuple[str, str] = (".lora_A", ".lora_B"),
    dtype: torch.dtype | None = None,
) -> int:
    """Check LoRA factor pairs (A [r, in], B [out, r]): 2-D, the same r in A and B and across every layer, equal to
    the config's ``rank`` when given, every value finite (once cast to ``dtype``, the dtype they are loaded in, when
    given). Returns r. :class:`ArtifactError` names the file and the tensor (``<layer><suffix>``; or the config file
    and its ``rank_field``)."""
    ranks: dict[int, str] = {}
    for layer, (a, b) in pairs.items():
        if a.dim() != 2 or b.dim() != 2:
            raise ArtifactError(
                f"{path}: layer {layer!r}: LoRA factors must be 2-D (A [r, in], B [out, r]), got A "
                f"{tuple(a.shape)}, B {tuple(b.shape)}"
            )
        if a.shape[0] != b.shape[1] or a.shape[0] < 1:
            raise ArtifactError(
                f"{path}: layer {layer!r}: A {tuple(a.shape)} and B {tuple(b.shape)} do not share a rank >= 1 "
                "(A [r, in], B [out, r])"
            )
        ranks.setdefault(int(a.shape[0]), layer)
    if len(ranks) > 1:
        seen = ", ".join(f"{r} ({layer})" for r, layer in ranks.items())
        raise ArtifactError(f"{path}: the LoRA layers have different ranks: {seen}")
    (r,) = ranks
    if rank is not None and r != rank:
        raise ArtifactError(
            f"{config_path or path}: field {rank_field!r} is {rank}, but the LoRA factors in {path} have rank {r}"
        )
    check_finite({layer + suffixes[0]: a for layer, (a, _) in pairs.items()}, path, dtype)
    check_finite({layer + suffixes[1]: b for layer, (_, b) in pairs.items()}, path, dtype)
    return r


def check_finite(tensors: Mapping[str, torch.Tensor], path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Every value of every tensor finite (no NaN / inf), else :class:`ArtifactError` naming the file and tensor.
    ``dtype``: the floating dtype the tensors are loaded in; each is checked once cast to it (a value finite in fp32
    can overflow to inf in bf16 / fp16)."""
    for name, t in tensors.items():
        if not t.is_floating_point():
            continue
        cast = t if dtype is None or t.dtype == dtype else t.to(dtype)
        if not bool(torch.isfinite(cast).all()):
            bad = int((~torch.isfinite(cast)).sum())
            how = "" if cast is t else f" once cast from {t.dtype} to {dtype} (the load dtype)"
            raise ArtifactError(f"{path}: tensor {name!r} holds {bad} non-finite value(s) (NaN or inf){how}")


def check_mask_rows(
    rows: Mapping[str, torch.Tensor], path: str | Path, hidden: int | None = None
) -> dict[str, torch.Tensor]:
    """The mask row file's tensors: ``mask_row`` (required) and ``mask_out_row`` (optional), each 1-D [hidden] and
    finite; no other tensor. Returns ``rows``; :class:`ArtifactError` names the file and the tensor."""
    unknown = sorted(set(rows) - {"mask_row", "mask_out_row"})
    if unknown:
        raise ArtifactError(f"{path}: unexpected tensor(s) {unknown}; expected 'mask_row' (and 'mask_out_row')")
    if "mask_row" not in rows:
        raise ArtifactError(f"{path}: tensor 'mask_row' is missing")
    for name, t in rows.items():
        if t.dim() != 1 or (hidden is not None and t.shape[0] != hidden):
            want = f"[{hidden}] (the model's hidden size)" if hidden is not None else "1-D"
            raise ArtifactError(f"{path}: tensor {name!r} must be {want}, got shape {tuple(t.shape)}")
    check_finite(rows, path)
    return dict(rows)


def check_token_id(token_id: int, vocab: int, path: str | Path, field: str = "mask_token_id") -> int:
    """``token_id`` in [0, vocab), else :class:`ArtifactError` naming the file and field."""
    if not _is_int(token_id) or not 0 <= token_id < vocab:
        raise ArtifactError(
            f"{path}: field {field!r} is {token_id!r}, outside the model's vocabulary (ids 0..{vocab - 1})"
        )
    return token_id


# The base loaders an artifact may name without the user's opt-in: sbd_ext's own (the SmolLM2 recipe's base). A
# loader is code that runs on load; any other one needs load_artifact(..., trust_base_loader=True) or
# register_base_loader(name) by the program that loads the artifact.
KNOWN_BASE_LOADERS: set[str] = {
    "sbd_ext.recipes.smollm2.checkpoint:load_base",
    "sbd_ext.recipes.smollm2.checkpoint:load_control",
}


def register_base_loader(name: str) -> None:
    """Allow artifacts to name the base loader ``"module:function"`` (as :data:`KNOWN_BASE_LOADERS`)."""
    _check_field(name, "base_loader", Field("loader"), "register_base_loader")
    KNOWN_BASE_LOADERS.add(name)


def resolve_base_loader(name: str, path: str | Path, trust: bool = False) -> Callable:
    """The function a ``"module:function"`` base loader names, imported only if it is known
    (:data:`KNOWN_BASE_LOADERS`) or ``trust`` is set; a ``__main__`` module (whose import runs a program) is never
    imported. :class:`ArtifactError` names the file and the loader; an import that fails (or exits) is one too."""
    _check_field(name, "base_loader", Field("loader"), str(path))
    module, _, func = name.partition(":")
    if module == "__main__" or module.endswith(".__main__"):
        raise ArtifactError(
            f"{path}: field 'base_loader' names {name!r}, a __main__ module (importing it runs a program); refusing"
        )
    if name not in KNOWN_BASE_LOADERS and not trust:
        raise ArtifactError(
            f"{path}: field 'base_loader' names {name!r}, which is not a known base loader "
            f"({', '.join(sorted(KNOWN_BASE_LOADERS))}); importing it would run its code. If you trust this "
            "artifact, pass trust_base_loader=True to load_artifact (or call "
            "sbd_ext.artifact_checks.register_base_loader with its name)"
        )
    try:
        fn = getattr(importlib.import_module(module), func)
    except (Exception, SystemExit) as e:  # SystemExit: a module that exits on import must not end the caller
        raise ArtifactError(
            f"{path}: field 'base_loader' {name!r} cannot be imported ({type(e).__name__}: {e})"
        ) from None
    if not callable(fn):
        raise ArtifactError(f"{path}: field 'base_loader' {name!r} is not a function")
    return fn


def load_on_base(
    meta: dict,
    cfg_path: Path,
    apply,
    dtype: torch.dtype,
    attn_implementation: str,
    device,
    trust_base_loader: bool,
    loader: Callable | None = None,
):
    """``(model, tokenizer)`` of an artifact over a base model (the LoRA artifact here, the gated drafter in
    :mod:`sbd_ext.drafter`): the base from ``loader`` or else ``meta["base_loader"]`` (resolved by
    :func:`resolve_base_loader`; a loader that exits is an :class:`ArtifactError`), ``apply(model)``, the SBD
    metadata (``mask_token_id``, ``sbd_block_size_range``), the recommended settings (``generation``) on
    ``model.generation_config``, ``dtype`` / ``device``, eval mode."""
    if loader is None:
        loader = resolve_base_loader(meta.get("base_loader", ""), cfg_path, trust=trust_base_loader)
    try:
        model, tok = loader(attn_implementation=attn_implementation)
    except SystemExit as e:  # a loader that exits must not end the caller
        raise ArtifactError(f"{cfg_path}: base loader {meta.get('base_loader')!r} exited ({e})") from None
    apply(model)
    set_sbd_metadata(model, int(meta["mask_token_id"]), tuple(meta["sbd_block_size_range"]))
    for key, value in meta.get("generation", {}).items():  # the recommended SBD settings: sbd_block_size, ...
        setattr(model.generation_config, key, value)
    model.to(dtype)
    if device is not None:
        model.to(device)
    return model.eval(), tok
