"""The compiled step's guards: a generation's step checks dynamo's full guards on each kind of call's first occurrence,
then (no other Python thread alive) only the guards that tell the graphs apart, around its own call alone; with
another thread alive every guard runs on every call. Tokens equal eager decoding either way."""

from __future__ import annotations

import io
import threading

import pytest
import torch
import tqdm

import sbd_ext.hf
from sbd_ext.decoding import GenerationSettings, generate
from sbd_ext.decoding import compiled as compiled_mod
from sbd_ext.demo import models, tasks
from sbd_ext.demo.evaluate import format_prompt

pytestmark = pytest.mark.skipif(
    not sbd_ext.hf.kernel_available(torch.device("cpu")), reason="the block_attention CPU kernel is not built"
)


@pytest.fixture(scope="module")
def ntp_job():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok = models.load(models.DEFAULT_MODEL)
    info = models.demo_info(models.DEFAULT_MODEL)
    probs = list(tasks.problems("test", 2))
    texts = [format_prompt(p.prompt, info.get("prompt_template")) for p in probs]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    settings = GenerationSettings(
        mode="ntp", verify=False, max_new_tokens=24, eos_token_id=[], pad_token_id=tok.pad_token_id
    )
    yield model, enc.input_ids, enc.attention_mask, settings
    torch.set_num_threads(prev)


def _count_skips(monkeypatch) -> list[int]:
    """Counts the step's calls under the guard-skipping stance. The step must compile here: variants left by earlier
    tests in the process can exhaust the variant budget and decode eagerly."""
    torch._dynamo.reset()
    monkeypatch.setattr(compiled_mod, "_VARIANTS", set())
    monkeypatch.setattr(compiled_mod, "_EAGER", set())
    monkeypatch.setattr(compiled_mod, "DIRECT_CALLS", False)  # every call through the compiled function
    skips = [0]
    real = torch.compiler.set_stance

    def counting(*args, **kw):
        skips[0] += bool(kw.get("skip_guard_eval_unsafe"))
        return real(*args, **kw)

    monkeypatch.setattr(compiled_mod.torch.compiler, "set_stance", counting)
    return skips


def test_a_generation_skips_guards_after_the_first_full_check(ntp_job, monkeypatch):
    model, ids, mask, s = ntp_job
    monkeypatch.setattr(compiled_mod, "_skip_guards_now", lambda: True)
    skips = _count_skips(monkeypatch)
    got = generate(model, ids, mask, s, compile=True)
    want = generate(model, ids, mask, s)
    assert torch.equal(got.sequences, want.sequences)
    static_forwards = int(got.nfe.max()) - 1  # after the eager prefill, one kind of call: [B, 1] rows
    assert skips[0] == static_forwards - 1  # every call but the first of the generation


def test_another_thread_keeps_every_guard(ntp_job, monkeypatch):
    model, ids, mask, s = ntp_job
    skips = _count_skips(monkeypatch)
    release = threading.Event()
    other = threading.Thread(target=release.wait, daemon=True)
    other.start()
    try:
        assert not compiled_mod._skip_guards_now()
        got = generate(model, ids, mask, s, compile=True)
    finally:
        release.set()
        other.join()
    assert skips[0] == 0
    assert torch.equal(got.sequences, generate(model, ids, mask, s).sequences)


def test_tqdm_monitor_thread_does_not_count(monkeypatch):
    """A progress bar starts tqdm's monitor thread (loading a checkpoint draws one); it runs no compiled code."""
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 10)
    bar = tqdm.tqdm(total=1, disable=False, file=io.StringIO())
    try:
        monitors = [t for t in threading.enumerate() if type(t).__name__ == "TMonitor"]
        if not monitors:
            pytest.skip("tqdm started no monitor thread here")
        others = [t for t in threading.enumerate() if t is not threading.current_thread() and t not in monitors]
        assert compiled_mod._skip_guards_now() == (not others)
    finally:
        bar.close()


def test_a_call_dynamo_refuses_under_the_stance_runs_with_every_guard(ntp_job, monkeypatch):
    """Where dynamo would have to compile under the skipping stance it raises before running anything; the step
    then makes the same call with every guard (same tokens)."""
    from torch._dynamo.eval_frame import _is_skip_guard_eval_unsafe_stance

    model, ids, mask, s = ntp_job
    monkeypatch.setattr(compiled_mod, "_skip_guards_now", lambda: True)
    _count_skips(monkeypatch)
    refused = [0]
    real = compiled_mod._compiled_forward

    def refusing(device):
        fn = real(device)

        def run(*args):
            if _is_skip_guard_eval_unsafe_stance():
                refused[0] += 1
                raise RuntimeError("Recompilation triggered with skip_guard_eval_unsafe stance.")
            return fn(*args)

        return run

    monkeypatch.setattr(compiled_mod, "_compiled_forward", refusing)
    got = generate(model, ids, mask, s, compile=True)
    assert refused[0] > 0
    assert torch.equal(got.sequences, generate(model, ids, mask, s).sequences)


@pytest.mark.parametrize("scheme", ["packed", "w8a8"])
def test_converted_weights_are_not_in_the_guards_a_skipping_call_checks(ntp_job, monkeypatch, scheme):
    """dynamo's skipping stance still checks every non-parameter tensor of the call (and that no two alias): the
    converted weights, kept in buffers, are parameters to dynamo (sbd_ext.packing.constant_weight), so those checks
    cover the cache and the inputs, not the weights. Same tokens as the quantized model's eager decoding."""
    import copy

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model, ids, mask, s = ntp_job
    qmodel = sbd_ext.quantize(copy.deepcopy(model), scheme)
    names = ("weight_packed", "weight_int8", "weight_scale")
    converted = [(n, b) for n, b in qmodel.named_buffers() if n.rsplit(".", 1)[-1].startswith(names)]
    assert converted and all(isinstance(b, torch.nn.Parameter) and not b.requires_grad for _, b in converted)
    with torch.no_grad():  # (model.parameters() on a quantized model warns where autograd is on)
        assert not {id(b) for _, b in converted} & {id(p) for p in qmodel.parameters()}  # still buffers
    monkeypatch.setattr(compiled_mod, "_skip_guards_now", lambda: True)
    _count_skips(monkeypatch)
    got = generate(qmodel, ids, mask, s, compile=True)
    assert torch.equal(got.sequences, generate(qmodel, ids, mask, s).sequences)
    entries = _debug_get_cache_entry_list(compiled_mod._static_forward.__code__)
    assert entries
    for entry in entries:
        diff = entry.guard_manager.diff_guard_sources
        assert any("keys" in src or "tokens" in src for src in diff), sorted(diff)  # the test sees the sources
        assert not [src for src in diff if any(n in src for n in names)], sorted(diff)
