"""``generate(..., compile=True)``: the compiled step returns eager decoding's tokens, forward for forward, on the
embedded models (SBD, NTP, ragged batch, EOS, temperature sampling, verify mode), with no graph break (fullgraph)
and no recompilation between generations of the same batch size and k.

Compiling is slow on a 2-core CPU (~50 s per graph, cold), so the tests share graphs: every SBD test decodes a batch
of 3 ragged prompts with the embedded model's k (one graph), NTP and verify mode one graph each.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import sbd_ext
import sbd_ext.hf
import sbd_ext.linear
from sbd_ext.cache import SBDCache
from sbd_ext.decoding import GenerationSettings, c_shims, compile_options, generate
from sbd_ext.decoding import compiled as compiled_mod
from sbd_ext.demo import models, tasks
from sbd_ext.demo.evaluate import format_prompt

pytestmark = pytest.mark.skipif(
    not sbd_ext.hf.kernel_available(torch.device("cpu")), reason="the block_attention CPU kernel is not built"
)

B = 3  # every test's batch: one compiled graph per mode


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add synchronisation
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def sbd():
    model, tok = models.load(models.DEFAULT_MODEL)
    return model, tok, models.demo_info(models.DEFAULT_MODEL)


def _batch(tok, info, start: int, n: int = B, device="cpu", preamble: str = ""):
    """n ragged held-out prompts (left padding), from problem ``start`` on, each after ``preamble``."""
    probs = list(tasks.problems("test", start + n))[start:]
    texts = [preamble + format_prompt(p.prompt, info.get("prompt_template")) for p in probs]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    assert len(set(enc.attention_mask.sum(1).tolist())) > 1, "the prompts should be ragged"
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def _settings(tok, info, **kw) -> GenerationSettings:
    base = dict(
        block_size=info["block_size"],
        sampler=info["sampler"],
        threshold=info["gamma_high"],
        max_new_tokens=48,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return GenerationSettings(**{**base, **kw})


def _assert_same(compiled, eager):
    assert torch.equal(compiled.sequences, eager.sequences), (compiled.sequences, eager.sequences)
    assert torch.equal(compiled.nfe, eager.nfe)
    assert compiled.trace == eager.trace  # same positions revealed by the same forwards
    assert torch.equal(compiled.num_accepted, eager.num_accepted)
    assert torch.equal(compiled.num_corrected, eager.num_corrected)


def _compiled_and_eager(model, ids, mask, settings):
    got = generate(model, ids, mask, settings, compile=True)
    want = generate(model, ids, mask, settings)
    _assert_same(got, want)
    return got


@pytest.mark.slow
def test_sbd_compiled_equals_eager_and_never_recompiles(sbd):
    """Greedy SBD at the model's gamma_high on a ragged batch; then new prompts (other lengths, so other prefill
    widths and cache sizes) run without any new graph: dynamo's error_on_recompile would raise. That includes a
    prefill wider than the linear layers' ROW_LIMIT (32 rows), where the row_linear op switches to the GEMM inside
    itself: a branch on the row count in the layer would be a guard, and a second graph for long prompts."""
    model, tok, info = sbd
    s = _settings(tok, info)
    out = _compiled_and_eager(model, *_batch(tok, info, 0), s)
    assert (out.tokens_per_forward > 1).all()  # several tokens per forward: the block rows were read right
    graphs = counters["stats"]["unique_graphs"]
    long = "Worked examples: " + " ".join(f"{a} + {a + 1} = {2 * a + 1}." for a in range(10, 22)) + "\n"
    with torch._dynamo.config.patch(error_on_recompile=True):
        for start in (3, 6):
            _compiled_and_eager(model, *_batch(tok, info, start), s)
        ids, mask = _batch(tok, info, 9, preamble=long)
        assert int(mask.sum(1).min()) > sbd_ext.linear.ROW_LIMIT  # every prefill row count is past the limit
        _compiled_and_eager(model, ids, mask, s)
    assert counters["stats"]["unique_graphs"] == graphs
    assert not counters["graph_break"]


@pytest.mark.slow
def test_sbd_compiled_equals_eager_eos_and_budget(sbd):
    """Sequences stop at EOS at different forwards (finished rows stay as padding) or at a budget that is not a
    multiple of k (the last block is shortened); also gamma_low (fewer tokens per forward)."""
    model, tok, info = sbd
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = _compiled_and_eager(model, *_batch(tok, info, 24), _settings(tok, info, max_new_tokens=64))
        assert (out.sequences == tok.eos_token_id).any(dim=1).all()  # every sequence ended at its EOS
        assert len(set(out.nfe.tolist())) > 1  # ... after different numbers of forwards
        _compiled_and_eager(model, *_batch(tok, info, 12), _settings(tok, info, max_new_tokens=13, eos_token_id=[]))
        _compiled_and_eager(model, *_batch(tok, info, 15), _settings(tok, info, threshold=info["gamma_low"]))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_sbd_compiled_equals_eager_sampled(sbd, seed):
    """Temperature sampling: the draws happen outside the graph from the same logits, so the samples agree."""
    model, tok, info = sbd
    s = _settings(tok, info, temperature=1.5, seed=seed, eos_token_id=[])
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = _compiled_and_eager(model, *_batch(tok, info, 18), s)
    greedy = generate(model, *_batch(tok, info, 18), s, temperature=0.0)
    assert not torch.equal(out.sequences, greedy.sequences)  # the sampling path really ran


@pytest.mark.slow
def test_ntp_compiled_equals_eager(sbd):
    """NTP mode: [B, 1] forwards after an eager prefill; sampled too (position-keyed noise, outside the graph)."""
    model, tok, info = sbd
    for start, temperature in ((0, 0.0), (3, 0.8)):
        s = _settings(tok, info, mode="ntp", temperature=temperature, seed=3)
        out = _compiled_and_eager(model, *_batch(tok, info, start), s)
        assert (out.tokens_per_forward <= 1).all()


@pytest.mark.slow
def test_verify_compiled_equals_eager_and_ntp(sbd):
    """Verify mode reads the committed rows' logits too (no block-row gather) and rolls the cache back after a
    correction: the compiled run equals the eager one and both equal NTP decoding. k = 16 with a greedy gamma: the
    model's far-right guesses are often wrong, so corrections (rollbacks) happen."""
    model, tok, info = sbd
    for start, temperature, lookup in ((0, 0.0, 0), (3, 0.8, 0), (0, 0.0, 4)):  # lookup: host-side, the same graph
        ids, mask = _batch(tok, info, start)
        s = _settings(tok, info, block_size=16, threshold=2.0, temperature=temperature, seed=5, eos_token_id=[])
        out = _compiled_and_eager(model, ids, mask, GenerationSettings.of(s, verify=True, lookup=lookup))
        assert out.num_corrected.sum() > 0
        ntp = generate(model, ids, mask, s, mode="ntp")
        assert torch.equal(out.sequences, ntp.sequences)


@pytest.mark.slow
def test_verify_branch_compiled_equals_eager_and_ntp(sbd):
    """Verify with the branch: every compiled forward carries the branch's rows (one graph, used or not); the run
    equals the eager one (which adds the rows only where a sequence has a branch) and NTP decoding (k = 16 with a
    greedy gamma: the model's far guesses are corrected; test_branch.py checks the forwards the branch saves)."""
    model, tok, info = sbd
    ids, mask = _batch(tok, info, 6)
    s = _settings(tok, info, block_size=16, threshold=2.0, eos_token_id=[], max_new_tokens=40)
    for temperature in (0.0, 0.8):
        v = GenerationSettings.of(s, verify=True, temperature=temperature, seed=2)
        out = _compiled_and_eager(model, ids, mask, GenerationSettings.of(v, branch=True))
        assert torch.equal(out.sequences, generate(model, ids, mask, v, mode="ntp", verify=False).sequences)
        assert out.num_corrected.sum() > 0


@pytest.mark.slow
def test_concurrent_compiled_generations(sbd):
    """Threads running compiled generations (and an eager one) at once each get eager decoding's tokens: compiled
    runs are serialised (the guard-skipping stance they use is process-global), eager ones are not held up."""
    import concurrent.futures

    model, tok, info = sbd
    s = _settings(tok, info)
    batches = [_batch(tok, info, start) for start in (0, 3, 6)]
    want = [generate(model, ids, mask, s) for ids, mask in batches]
    with torch._dynamo.config.patch(error_on_recompile=True):
        generate(model, *batches[0], s, compile=True)  # compiled (or cached) before the threads start
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            jobs = [pool.submit(generate, model, ids, mask, s, compile=True) for ids, mask in batches]
            jobs.append(pool.submit(generate, model, *batches[1], s))
            got = [j.result() for j in jobs]
    for g, w in zip(got, want + [want[1]], strict=True):
        _assert_same(g, w)


def test_compile_setting_validated():
    with pytest.raises(TypeError, match="compile must be a bool"):
        GenerationSettings(compile="yes")
    assert GenerationSettings.of(None, compile=True).compile


@pytest.mark.skipif(
    not (torch.cuda.is_available() and sbd_ext.hf.kernel_available(torch.device("cuda"))),
    reason="needs a GPU and the CUDA kernels",
)
def test_cuda_graph_step_equals_eager():
    """On CUDA the step is a CUDA graph (mode="reduce-overhead", [B, 2k] rows): same tokens as eager, the graph
    was not skipped, and a second generation records no new dynamo graph."""
    model, tok = models.load(models.DEFAULT_MODEL)
    info = models.demo_info(models.DEFAULT_MODEL)
    model = model.to("cuda")
    s = _settings(tok, info)
    _compiled_and_eager(model, *_batch(tok, info, 0, device="cuda"), s)
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        _compiled_and_eager(model, *_batch(tok, info, 3, device="cuda"), s)
        _compiled_and_eager(model, *_batch(tok, info, 3, device="cuda"), GenerationSettings.of(s, temperature=0.8))
    assert counters["stats"]["unique_graphs"] == graphs
    # verify with the branch: [B, 2k + k] rows, the branch's block_attention call inside the graph
    v = GenerationSettings.of(s, verify=True, branch=True, eos_token_id=[])
    out = _compiled_and_eager(model, *_batch(tok, info, 6, device="cuda"), v)
    ntp = generate(model, *_batch(tok, info, 6, device="cuda"), v, mode="ntp", verify=False)
    assert torch.equal(out.sequences, ntp.sequences)
    assert not counters["inductor"]["cudagraph_skips"]


_USER_K = 1


def test_compiled_generation_leaves_the_users_compiled_code_alone(sbd, monkeypatch):
    """A user's torch.compile function called by another thread while a compiled step runs still checks its guards:
    after the global it reads changes, it recompiles instead of returning a stale result (the step skips its own
    guards only while no other thread exists: the skipping stance is process-wide)."""
    import queue
    import threading

    import sbd_ext.decoding.compiled as compiled

    model, tok, info = sbd
    ids, mask = _batch(tok, info, 40)
    # The step must compile here: compiled variants left by earlier tests in the process (e.g. test_drafter.py's,
    # run before this file) can exhaust the variant budget and decode this one eagerly, never calling the hook below.
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "_VARIANTS", set())
    monkeypatch.setattr(compiled, "_EAGER", set())
    # every call through the compiled function (a replayed graph call sets no process-wide stance: nothing to see)
    monkeypatch.setattr(compiled, "DIRECT_CALLS", False)

    @torch.compile(backend="eager")
    def user(x):
        return x + _USER_K

    assert user(torch.ones(1)).item() == 1.0 + _USER_K
    assert user(torch.ones(2)).sum().item() == 2.0 * (1 + _USER_K)  # a second graph: diff guards exist
    requests, seen = queue.Queue(), []

    def other_thread():  # the user's code, run when the step asks, while the step's compiled call is under way
        global _USER_K
        while (k := requests.get()) is not None:
            try:
                _USER_K = k
                seen.append(user(torch.ones(1)).item() - k)
            except Exception as e:  # e.g. dynamo refusing to recompile under a guard-skipping stance
                seen.append(repr(e))
            finally:
                requests.task_done()

    worker = threading.Thread(target=other_thread, daemon=True)
    worker.start()
    real = compiled._compiled_forward

    def with_user_code(device):
        fn = real(device)

        def run(*args):
            requests.put(len(seen) + 10)  # another thread's state changes and its compiled code runs
            requests.join()
            return fn(*args)

        return run

    monkeypatch.setattr(compiled, "_compiled_forward", with_user_code)
    try:
        generate(model, ids, mask, _settings(tok, info), compile=True)
    finally:
        requests.put(None)
        worker.join()
    assert len(seen) > 2 and set(seen) == {1.0}, seen  # x + K, never a stale K


@pytest.mark.slow
def test_more_variants_than_dynamos_limit_keep_working():
    """20 variants (batch size, k, mode) in one process, past dynamo's recompile limit (8): every compiled
    generation returns eager decoding's tokens (before: FailOnRecompileLimitHit from the 9th variant on); those past
    the bound decode eagerly, with one warning."""
    import warnings

    from sbd_models import random_prompts, tiny_llama

    model = tiny_llama(seed=7)
    n = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mode in ("sbd", "ntp"):
            for k in (2, 4) if mode == "sbd" else (1,):
                for b in range(1, 11 if mode == "ntp" else 6):
                    ids, mask = random_prompts([3 + i % 4 for i in range(b)], seed=b)
                    kw = dict(mode=mode, max_new_tokens=5, eos_token_id=[], strict_block_size=False)
                    if mode == "sbd":
                        kw["block_size"] = k
                    got = generate(model, ids, mask, compile=True, **kw)
                    assert torch.equal(got.sequences, generate(model, ids, mask, **kw).sequences), (mode, k, b)
                    n += 1
    assert n == 20
    fallback = [w for w in caught if "decode eagerly" in str(w.message)]
    assert len(fallback) <= 1


@pytest.mark.slow
def test_linear_layer_switch_is_its_own_compiled_variant():
    """Switching a model's linears (RowLinear <-> nn.Linear) between compiled generations: dynamo guards on the
    layers' class, so each state is its own graph (counted as a variant); every generation equals eager decoding,
    and switching back reuses the first graph."""
    from sbd_models import random_prompts, tiny_llama

    from sbd_ext.linear import RowLinear, use_row_linear

    model = tiny_llama(seed=11)
    ids, mask = random_prompts([4, 6], seed=3)
    kw = dict(block_size=4, max_new_tokens=6, eos_token_id=[], strict_block_size=False)
    outs = []
    for on in (True, False, True):
        use_row_linear(model, on)
        got = generate(model, ids, mask, compile=True, **kw)
        assert (type(model.lm_head) is RowLinear) == on
        assert torch.equal(got.sequences, generate(model, ids, mask, **kw).sequences), on
        outs.append(got.sequences)
    assert torch.equal(outs[0], outs[2])


@pytest.mark.slow
def test_recompile_limit_hit_anyway_falls_back_to_eager(monkeypatch):
    """Graphs the variant accounting cannot see (another thread count, a user's guard) can still exhaust dynamo's
    limit: the generation that hits it finishes uncompiled with eager's tokens and one warning (before: a hard
    FailOnRecompileLimitHit from inside generate), and that variant stays eager."""
    import warnings

    from sbd_models import random_prompts, tiny_llama

    from sbd_ext.decoding import compiled

    model = tiny_llama(seed=13)
    monkeypatch.setattr(compiled, "_compiled_variant_ok", lambda *a: True)  # as if the accounting missed graphs
    monkeypatch.setattr(compiled, "_FALLBACK_WARNED", False)
    monkeypatch.setattr(compiled, "_EAGER", set())  # restored after: no other test inherits this model's key
    kw = dict(block_size=4, max_new_tokens=6, eos_token_id=[], strict_block_size=False)
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in (1, 2):  # batch 2 needs a second graph of the same function
            ids, mask = random_prompts([3 + i for i in range(b)], seed=b)
            got = generate(model, ids, mask, compile=True, **kw)
            assert torch.equal(got.sequences, generate(model, ids, mask, **kw).sequences), b
    assert len([w for w in caught if "decode eagerly" in str(w.message)]) == 1
    assert len(compiled._EAGER) >= 1


def test_compiled_calls_put_the_op_schemas_in_inductors_cache_key(monkeypatch):
    """inductor's on-disk cache key does not cover a custom op's schema: code compiled against an older sbd_ext
    (row_linear without ``scale``) was loaded and called the op with the old arguments, a segfault. Every compiled
    call now carries a tag of the schemas (a user's own tag kept), so an upgrade compiles afresh."""
    seen = []
    monkeypatch.setattr(compile_options, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda *a: seen.append(torch.compiler.config.cache_key_tag))
    fn = compiled_mod._compiled_forward(torch.device("cpu"))
    # every op the extension defines (a new op left out of the tag would keep stale compiled code)
    ops = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("sbd_ext::"))
    want = {"block_attention", "entropy_sample", "gated_lora_linear", "mask_replace", "row_linear", "topk_logsumexp"}
    want.add("screened_head")
    assert want <= set(ops)
    schemas = "|".join(str(getattr(torch.ops.sbd_ext, op).default._schema) for op in ops)
    assert "Tensor? scale=None" in schemas
    schemas += "|c_shims"  # the graphs call the ops' C functions (sbd_ext.decoding.c_shims): compiled apart
    assert c_shims.shims_available()
    tag = "sbd_ext-" + hashlib.sha256(schemas.encode()).hexdigest()[:16]
    fn(1, 2)
    with torch.compiler.config.patch(cache_key_tag="mine"):
        fn(1, 2)
    assert seen == [tag, f"mine|{tag}"] and torch.compiler.config.cache_key_tag == ""


@pytest.mark.slow
def test_compiled_step_follows_changes_deep_in_the_model(sbd):
    """The step's guards are built with recursive dict tags (a module whose __dict__ is unchanged skips its
    subtree's guards): a changed attribute of one attention layer, or a hook added to one MLP, must still reach the
    compiled forwards (equal to eager with the change, unlike before it). The hook failed before 2026-11-26 (dynamo's
    default skips hook guards: the stale graph decoded other tokens than eager); the settings stay scoped to the
    step."""
    model, tok, info = sbd
    ids, mask = _batch(tok, info, 44)
    settings = _settings(tok, info, max_new_tokens=24)
    before = _compiled_and_eager(model, ids, mask, settings)
    attn = model.get_decoder().layers[-1].self_attn
    scaling = attn.scaling
    try:
        attn.scaling = scaling * 0.25  # a constant of the traced graph
        changed = _compiled_and_eager(model, ids, mask, settings)
        assert not torch.equal(changed.sequences, before.sequences)
    finally:
        attn.scaling = scaling
    mlp = model.get_decoder().layers[0].mlp
    handle = mlp.register_forward_hook(lambda module, args, out: out * -3.0)
    try:
        hooked = _compiled_and_eager(model, ids, mask, settings)
        assert not torch.equal(hooked.sequences, before.sequences)
    finally:
        handle.remove()
    _assert_same(generate(model, ids, mask, settings, compile=True), before)
    config = torch._dynamo.config  # the process's settings untouched
    assert config.use_recursive_dict_tags_for_guards is False and config.skip_nnmodule_hook_guards is True


def test_compiled_rows_forward_refuses_bad_input():
    """compiled_rows_forward (the vLLM proposer's compiled draft forward) checks its rows and plan before compiling:
    [B, T] ids and positions of one shape with T >= 2, a plan the cache can hold."""
    compiled_rows_forward = compiled_mod.compiled_rows_forward
    model, _ = models.load(models.DEFAULT_MODEL)
    cache = SBDCache(model.config, 1, 16)
    ids = torch.zeros(1, 4, dtype=torch.int64)
    pos = torch.arange(4).view(1, 4)
    with pytest.raises(ValueError, match="T >= 2"):
        compiled_rows_forward(model, cache, ids[:, :1], pos[:, :1], [1], [1], 1)
    with pytest.raises(ValueError, match="same shape|T >= 2"):
        compiled_rows_forward(model, cache, ids, pos[:, :3], [1], [4], 2)
    with pytest.raises(ValueError, match="overflow"):
        compiled_rows_forward(model, SBDCache(model.config, 1, 2), ids, pos, [4], [4], 2)
    with pytest.raises(ValueError, match="n_commit <= n_valid"):
        compiled_rows_forward(model, cache, ids, pos, [3], [2], 2)
    assert cache.seq_lens == [0]  # nothing ran
