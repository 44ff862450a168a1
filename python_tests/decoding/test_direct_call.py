"""The compiled step's replayed graph calls (sbd_ext.decoding.direct_call): after a generation's full call of some
shapes, later calls of those shapes call the compiled graph with the captured argument list, skipping dynamo's
frame entry. They must compute what the compiled function computes -- same tokens, same cache, bit for bit -- and
the capture must refuse every call it cannot replay exactly."""

from __future__ import annotations

import copy

import pytest
import torch

import sbd_ext
import sbd_ext.decoding.compiled as compiled
from sbd_ext.decoding import direct_call
from sbd_ext.demo import models, tasks
from sbd_ext.demo.evaluate import format_prompt

pytestmark = pytest.mark.skipif(
    not sbd_ext.hf.kernel_available(torch.device("cpu")), reason="the block_attention CPU kernel is not built"
)


@pytest.fixture(scope="module")
def arith():
    model, tok = models.load(models.DEFAULT_MODEL)
    info = models.demo_info(models.DEFAULT_MODEL)
    probs = list(tasks.problems("test", 2))
    texts = [format_prompt(p.prompt, info.get("prompt_template")) for p in probs]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    return model, info, enc.input_ids, enc.attention_mask


def _cache_rows(out) -> list[torch.Tensor]:
    cache = out.past_key_values
    n = max(cache.seq_lens)
    return [t[:, :, :n].clone() for layer in cache.layers for t in (layer.keys, layer.values)]


def _count_replays(monkeypatch) -> list[int]:
    """A counter [n] of the replayed graph calls (DirectCall calls) from now on."""
    replayed = [0]
    real = direct_call.DirectCall.__call__

    def counting(self, *tensors):
        replayed[0] += 1
        return real(self, *tensors)

    monkeypatch.setattr(direct_call.DirectCall, "__call__", counting)
    return replayed


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["packed", "w8a8"])
@pytest.mark.parametrize("mode", ["ntp", "verify", "sbd"])
def test_replayed_calls_compute_what_the_compiled_function_computes(arith, monkeypatch, scheme, mode):
    model, info, ids, mask = arith
    model = sbd_ext.quantize(copy.deepcopy(model), scheme)
    kw = {"ntp": dict(mode="ntp"), "verify": dict(mode="sbd", verify=True), "sbd": dict(mode="sbd")}[mode]
    kw |= dict(block_size=info["block_size"], max_new_tokens=24, return_cache=True)
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "_VARIANTS", set())
    monkeypatch.setattr(compiled, "_EAGER", set())
    replayed = _count_replays(monkeypatch)
    sbd_ext.generate(model, ids, mask, compile=True, **kw)  # compiles (a capture needs a compiled graph)
    replayed[0] = 0
    got = sbd_ext.generate(model, ids, mask, compile=True, **kw)
    # most forwards replayed: all but the eager prefill and one full call per row count the generation used
    assert replayed[0] >= (int(got.nfe.max()) - 1) // 2 > 0
    monkeypatch.setattr(compiled, "DIRECT_CALLS", False)
    want = sbd_ext.generate(model, ids, mask, compile=True, **kw)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.nfe, want.nfe)
    for a, b in zip(_cache_rows(got), _cache_rows(want), strict=True):
        assert torch.equal(a, b)
    if mode != "sbd":  # verify and NTP: the model's own greedy answers, eagerly too
        eager = sbd_ext.generate(model, ids, mask, **{k: v for k, v in kw.items() if k != "return_cache"})
        assert torch.equal(got.sequences, eager.sequences)


def _count_captures(monkeypatch) -> list[tuple]:
    """The shapes (StaticStep's ``seen``: tokens' shape first) of each full, captured call from now on."""
    seen: list[tuple] = []
    real = compiled.StaticStep._replay_at

    def watching(self, key):
        got = real(self, key)
        if got is None and key not in self._direct:
            seen.append(key)
        return got

    monkeypatch.setattr(compiled.StaticStep, "_replay_at", watching)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("branch", [False, True])
def test_a_generation_replays_row_counts_a_full_call_ran(arith, monkeypatch, branch):
    """SBD's rows are one dynamic size: after a generation's first full call, a row count whose graph has run at
    those shapes under the full guards (an earlier generation) is replayed, not called through dynamo again; one
    that never ran is not. Either way the tokens and the cache are the compiled function's, bit for bit."""
    model, info, ids, mask = arith
    model = sbd_ext.quantize(copy.deepcopy(model), "packed")
    kw = dict(mode="sbd", verify=True, block_size=info["block_size"], max_new_tokens=24, return_cache=True)
    kw |= dict(branch=True, lookup=0) if branch else {}
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "_VARIANTS", set())
    monkeypatch.setattr(compiled, "_EAGER", set())
    monkeypatch.setattr(compiled, "_RAN_AT", compiled.weakref.WeakKeyDictionary())
    sbd_ext.generate(model, ids, mask, compile=True, **kw)  # compiles
    full = _count_captures(monkeypatch)
    monkeypatch.setattr(compiled, "_RAN_AT", compiled.weakref.WeakKeyDictionary())  # no row count known
    first = sbd_ext.generate(model, ids, mask, compile=True, **kw)
    counts = {key[0][2] for key in full}
    assert len(full) == len(counts) >= 2  # one full call per row count: several row counts, none replayed unseen
    full.clear()
    got = sbd_ext.generate(model, ids, mask, compile=True, **kw)
    assert len(full) == 1  # the generation's first call; every other row count replayed
    monkeypatch.setattr(compiled, "DIRECT_CALLS", False)
    want = sbd_ext.generate(model, ids, mask, compile=True, **kw)
    for out in (first, got):
        assert torch.equal(out.sequences, want.sequences) and torch.equal(out.nfe, want.nfe)
        for a, b in zip(_cache_rows(out), _cache_rows(want), strict=True):
            assert torch.equal(a, b)


def _recorded(args, out, result):
    return [(lambda *a: out, list(args), out)], result


def test_capture_refuses_what_it_cannot_replay():
    tokens, meta, w = torch.zeros(2, 1, 3), torch.zeros(3, 1), torch.ones(4)
    res = torch.ones(2)

    def make(calls, result, tokens, meta, cache_rows):  # the host step's capture
        return direct_call._direct(calls, result, (tokens, meta), (0, 2), {cache_rows}, True)

    ok = make(*_recorded([tokens, 40, w, meta, 3], [res], res), tokens, meta, 40)
    assert ok is not None and ok.size_at == [4] and ok.swap_at == [0, 3]
    t5 = torch.zeros(2, 1, 5)
    assert ok.fn is not None and ok.args[4] == 3
    args = list(ok.args)
    ok.fn = lambda *a: args.__setitem__(slice(None), a) or [res]
    assert ok(t5, meta) is res
    assert args[0] is t5 and args[3] is meta and args[4] == 5 and args[1] == 40  # rows replaced, cache rows kept
    assert make([], res, tokens, meta, 40) is None  # no graph ran (compiled during the call)
    two = _recorded([tokens, meta], [res], res)[0] * 2
    assert make(two, res, tokens, meta, 40) is None  # two graph calls
    assert make(*_recorded([tokens, meta], [torch.ones(2)], res), tokens, meta, 40) is None  # not the output itself
    assert make(*_recorded([tokens, tokens, meta], [res], res), tokens, meta, 40) is None  # tokens twice
    assert make(*_recorded([tokens, w], [res], res), tokens, meta, 40) is None  # no plan tensor
    assert make(*_recorded([tokens, meta, 3], [res], res), tokens, meta, 3) is None  # rows == cache rows: ambiguous
    assert make(*_recorded([tokens, meta, 7], [res], res), tokens, meta, 40) is None  # an integer of unknown source
    assert make(*_recorded([tokens, meta, 3.0], [res], res), tokens, meta, 40) is None  # not an integer


def test_cycle_capture_refuses_what_it_cannot_replay():
    """The device cycle's capture: it returns nothing, swaps its row index (a dynamic size) or nothing at all."""
    rows, st, w = torch.arange(3), torch.zeros(2, 9), torch.ones(4)

    def make(calls, result, swap=(rows,), size_of=(0, 0), fixed=(9, 40)):
        return direct_call._direct(calls, result, swap, size_of, set(fixed), False)

    ok = make(*_recorded([w, st, rows, 3, 9], [], None))
    assert ok is not None and ok.swap_at == [2] and ok.size_at == [3]
    args = list(ok.args)
    ok.fn = lambda *a: args.__setitem__(slice(None), a) or []
    r5 = torch.arange(5)
    assert ok(r5) is None and args[2] is r5 and args[3] == 5 and args[4] == 9
    fixed = make(*_recorded([w, st, 9], [], None), swap=(), size_of=None)  # NTP: the same arguments every cycle
    assert fixed is not None and fixed.swap_at == [] and fixed.size_at == []
    assert make(*_recorded([w, st, rows, 3], [st], None)) is None  # the graph returned something: refused
    assert make(*_recorded([w, st, rows, 3], [], st)) is None  # the function returned something
    assert make(*_recorded([w, st, 3], [], None)) is None  # the row index is not an input
    assert make(*_recorded([w, st, rows, 3], [], None), fixed=(3, 9)) is None  # a fixed size == the row count
    assert make(*_recorded([w, st, rows, 11], [], None)) is None  # an integer of unknown source
    assert make(*_recorded([w, st, 7], [], None), swap=(), size_of=None) is None


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["packed", "w8a8"])
@pytest.mark.parametrize("mode", ["ntp", "verify", "sbd"])
def test_replayed_cycles_compute_what_the_compiled_cycle_computes(arith, monkeypatch, scheme, mode):
    """The device cycle (cycle="device") on the CPU: replayed graph calls give the compiled function's tokens,
    forwards and cache bit for bit."""
    model, info, ids, mask = arith
    model = sbd_ext.quantize(copy.deepcopy(model), scheme)
    kw = {"ntp": dict(mode="ntp"), "verify": dict(mode="sbd", verify=True), "sbd": dict(mode="sbd")}[mode]
    kw |= dict(block_size=info["block_size"], max_new_tokens=24, return_cache=True, cycle="device")
    replayed = _count_replays(monkeypatch)
    sbd_ext.generate(model, ids, mask, compile=True, **kw)  # compiles
    replayed[0] = 0
    got = sbd_ext.generate(model, ids, mask, compile=True, **kw)
    if mode == "ntp":  # one row count: every cycle after the first replays
        assert replayed[0] == int(got.nfe.max()) - 2
    monkeypatch.setattr(compiled, "DIRECT_CALLS", False)
    want = sbd_ext.generate(model, ids, mask, compile=True, **kw)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.nfe, want.nfe)
    for a, b in zip(_cache_rows(got), _cache_rows(want), strict=True):
        assert torch.equal(a, b)
