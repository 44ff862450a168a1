"""llama.cpp as the peer on the same weights (``llama-cpp-python``, the ``peers`` extra: ``CMAKE_ARGS="-DGGML_NATIVE=ON"
pip install ".[peers]"``): the shipped SmolLM2 GGUF requantized by llama.cpp itself to F32 (the fp32 values sbd_ext
runs) and Q8_0 (what llama.cpp users run), cached in ``~/.cache/sbd_ext/gguf/`` (``SBD_GGUF_DIR``), and its greedy
decoding of token ids. Used by ``bench/bench_cpu_peers.py`` and ``bench/report.py``.

On an Intel CPU with AMX the native build (llama-cpp-python 0.3.36, ``GGML_NATIVE=ON``, which compiles llama.cpp's
AMX path) crashed (SIGSEGV) on a Q8_0 prompt batch on the Xeon of 2026-12-03; F32 and BF16 ran. There the peer is
built with the AVX-512 flags and AMX off, what a user of that CPU is left with::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install ".[peers]"

:func:`system_info` (recorded with the chat suite's results) names the features a build has."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from sbd_ext.recipes.smollm2 import checkpoint

GGUF_DIR = Path(os.environ.get("SBD_GGUF_DIR", Path.home() / ".cache" / "sbd_ext" / "gguf"))
KINDS = ("f32", "bf16", "q8_0")


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def requantize(src: Path, out: Path, kind: str, threads: int = 1) -> None:
    """llama.cpp's ``llama_model_quantize`` of ``src`` to ``kind`` ("f32", "bf16" or "q8_0") into ``out``."""
    import llama_cpp

    ftypes = {
        "f32": llama_cpp.LLAMA_FTYPE_ALL_F32,
        "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
        "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    }
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftypes[kind]
    params.allow_requantize = True
    params.nthread = threads
    tmp = out.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {kind} failed ({rc})")
    tmp.rename(out)


def gguf(kind: str, threads: int = 1) -> Path:
    """The shipped SmolLM2 GGUF requantized by llama.cpp to ``kind`` (cached)."""
    out = GGUF_DIR / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if not out.exists():
        GGUF_DIR.mkdir(parents=True, exist_ok=True)
        requantize(checkpoint.gguf_path(), out, kind, threads)
    return out


def llama(kind: str, threads: int = 1, logits_all: bool = False, path: Path | None = None):
    """A ``llama_cpp.Llama`` on ``path`` (default: :func:`gguf` of ``kind``), ``threads`` for decode and batch."""
    import llama_cpp

    return llama_cpp.Llama(
        model_path=str(path or gguf(kind, threads)),
        n_ctx=1024,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        verbose=False,
    )


def system_info() -> str:
    """llama.cpp's own line of the CPU features it was built with (``llama_print_system_info``)."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode().strip()


def greedy(llm, prompt: list[int], eos: int, max_new: int) -> list[int]:
    """llama.cpp's greedy completion of token ids (top_k 1, no penalties), up to and including EOS or ``max_new``."""
    llm.reset()
    out = []
    for t in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(t))
        if t == eos or len(out) == max_new:
            break
    return out
