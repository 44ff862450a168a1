"""``generate(..., cycle="device")``: the decoding cycle as tensor operations on the device
(sbd_ext.decoding.device_cycle) returns the host cycle's tokens, forward counts and corrections for every mode
(plain SBD, first_from_ntp, verify with and without a gated drafter's sampler head, NTP), ragged batches, EOS and
budgets; compiled, one cycle is one graph (fullgraph, no graph break, no recompilation across prompt lengths and
budgets), and on CUDA nothing inside a cycle synchronises with the host."""

from __future__ import annotations

import copy

import pytest
import torch
from sbd_models import MASK_ID, random_prompts, single_thread, tiny_llama  # noqa: F401
from torch._dynamo.utils import counters

import sbd_ext.hf
from sbd_ext import drafter
from sbd_ext.decoding import GenerationSettings, generate, generate_reference
from sbd_ext.decoding import device_cycle as dc
from sbd_ext.decoding import device_loop as dl
from sbd_ext.decoding.settings import make_job
from sbd_ext.decoding.state import SequenceState
from sbd_ext.decoding.step import TwoForwardStep
from sbd_ext.drafter import sampler_head as sh

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(not sbd_ext.hf.kernel_available(torch.device("cpu")), reason="no CPU block_attention kernel"),
]

CASES = [
    dict(mode="ntp"),
    dict(block_size=1),
    dict(block_size=4),
    dict(block_size=16, threshold=1.0),
    dict(block_size=5, sampler="confidence", threshold=0.5),
    dict(block_size=3, sampler="entropy", threshold=0.8),
    dict(block_size=4, first_from_ntp=True),
    dict(block_size=2, verify=True),
    dict(block_size=8, verify=True, threshold=1.0),
    dict(block_size=5, verify=True, sampler="confidence", threshold=0.5),
    dict(block_size=16, verify=True, threshold=0.1),
]


def _same(host, dev):
    assert torch.equal(dev.sequences, host.sequences), (dev.sequences, host.sequences)
    assert torch.equal(dev.nfe, host.nfe), (dev.nfe, host.nfe)
    assert torch.equal(dev.num_generated, host.num_generated)
    assert torch.equal(dev.num_corrected, host.num_corrected)
    assert torch.equal(dev.num_accepted, host.num_accepted)
    assert dev.corrections == host.corrections
    assert dev.trace is None


def _with_drafter(seed: int = 0):
    """A tiny Llama with a random gated drafter and a random sampler head (they change the drafts, never what
    verify returns), and the base without them."""
    base = tiny_llama(seed=seed, block_size_range=(2, 8))
    model = copy.deepcopy(base)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in drafter.attach(model, MASK_ID, rank=4):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        head = sh.SamplerHead(model.config.hidden_size, hidden=32, topk=16)
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.sbd_drafter.sampler_head = head.eval()
    return base, model


@pytest.mark.parametrize("eos", [[], [7, 11]])
@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_device_cycle_equals_host_cycle(models, kw, eos):
    for i, m in enumerate(models):
        ids, mask = random_prompts([3, 9, 6], seed=10 + i)
        st = dict(max_new_tokens=21, eos_token_id=eos, **kw)
        _same(generate(m, ids, mask, **st), generate(m, ids, mask, cycle="device", **st))


@pytest.mark.parametrize("kw", [dict(block_size=4), dict(block_size=8, sampler="confidence", threshold=0.6)])
def test_device_cycle_sbd_equals_the_no_cache_reference(models, kw):
    """Plain SBD on the device: the reference decoder's tokens and forwards (Alg. 3 without a cache)."""
    m = models[1]
    ids, mask = random_prompts([6, 2, 9], seed=21)
    st = dict(max_new_tokens=19, eos_token_id=[3], **kw)
    ref = generate_reference(m, ids, mask, **st)
    dev = generate(m, ids, mask, cycle="device", **st)
    assert torch.equal(dev.sequences, ref.sequences) and torch.equal(dev.nfe, ref.nfe)


def test_device_cycle_verify_corrects_and_rolls_back(models):
    """A random model's drafts are mostly wrong: many corrections and rollbacks; the output is NTP's and the cache
    lengths end where the host cycle's do."""
    m = models[0]
    ids, mask = random_prompts([4, 8, 1], seed=3)
    st = dict(max_new_tokens=40, eos_token_id=[], block_size=8, threshold=1.0, verify=True)
    host = generate(m, ids, mask, return_cache=True, **st)
    dev = generate(m, ids, mask, cycle="device", return_cache=True, **st)
    _same(host, dev)
    assert int(dev.num_corrected.sum()) >= 16, dev.num_corrected
    assert dev.past_key_values.seq_lens == host.past_key_values.seq_lens
    ntp = generate(m, ids, mask, mode="ntp", max_new_tokens=40, eos_token_id=[])
    assert torch.equal(dev.sequences, ntp.sequences)


@pytest.mark.parametrize("k", [2, 4])
def test_device_cycle_with_a_drafter_and_its_sampler_head(k):
    base, model = _with_drafter(seed=7)
    ids, mask = random_prompts([7, 11, 4], seed=8)
    st = dict(max_new_tokens=24, block_size=k, verify=True, eos_token_id=[5])
    calls = []
    real = sh.SamplerHead.rescore_
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sh.SamplerHead, "rescore_", lambda self, *a: calls.append(1) or real(self, *a))
        dev = generate(model, ids, mask, cycle="device", **st)
    assert calls, "the head was not used"
    _same(generate(model, ids, mask, **st), dev)
    ntp = generate(base, ids, mask, mode="ntp", max_new_tokens=24, eos_token_id=[5])
    assert torch.equal(dev.sequences, ntp.sequences)


def test_device_cycle_streams_final_tokens(models):
    m = models[1]
    ids, mask = random_prompts([5, 2, 8], seed=4)
    for kw in (dict(block_size=4), dict(block_size=3, verify=True), dict(mode="ntp")):
        got = {b: [] for b in range(3)}
        on_final = lambda b, t, got=got: got[b].extend(t)  # noqa: E731
        out = generate(
            m, ids, mask, cycle="device", max_new_tokens=17, eos_token_id=[9], on_final_tokens=on_final, **kw
        )
        for b in range(3):
            p, n = int(out.prompt_lengths[b]), int(out.num_generated[b])
            assert got[b] == out.sequences[b, p : p + n].tolist(), (kw, b)
            assert n > 0


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(cycle="gpu"), "cycle must be"),
        (dict(cycle="device", temperature=0.7), "greedily"),
        (dict(cycle="device", verify=True, lookup=4), "lookup"),
        (dict(cycle="device", verify=True, branch=True), "branch"),
    ],
)
def test_device_cycle_settings_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        GenerationSettings(**kw)
    # outside verify mode lookup and branch do nothing: allowed
    GenerationSettings(cycle="device", lookup=4, branch=True)


def test_device_cycle_refuses_a_step_class(models):
    ids, mask = random_prompts([3, 4], seed=1)
    with pytest.raises(ValueError, match="step_cls"):
        generate(models[0], ids, mask, cycle="device", block_size=2, step_cls=TwoForwardStep, max_new_tokens=4)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(block_size=4), "revealed no token"),
        (dict(mode="ntp"), "invalid next-token"),
        (dict(block_size=2, verify=True), "invalid next-token"),
    ],
)
def test_device_cycle_reports_invalid_logits(kw, match):
    """NaN logits after the prefill (the host's forward): the device cycle raises the host's errors."""
    m = tiny_llama()
    calls = []

    def nan_after_prefill(module, inp, out):
        calls.append(1)
        return out.fill_(float("nan")) if len(calls) > 1 else out

    m.lm_head.register_forward_hook(nan_after_prefill)
    ids = torch.randint(0, MASK_ID, (2, 4), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=match):
        generate(m, ids, max_new_tokens=12, eos_token_id=[], cycle="device", **kw)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["sbd", "verify-drafter", "ntp"])
def test_compiled_device_cycle_is_one_graph_and_equals_the_host(which, monkeypatch):
    """fullgraph (no graph break); one graph serves generations of other prompt lengths and budgets; the host
    cycle's tokens and forwards."""
    # a fresh bound on compiled variants: earlier tests' graphs must not send this one to the eager fallback
    monkeypatch.setattr(dl, "_CYCLE_VARIANTS", set())
    if which == "verify-drafter":
        _, m = _with_drafter(seed=2)
        kw = dict(block_size=2, verify=True, eos_token_id=[7])
    else:
        m = tiny_llama(seed=0, lm_scale=8.0)
        kw = dict(block_size=4, eos_token_id=[7, 11]) if which == "sbd" else dict(mode="ntp", eos_token_id=[7])
    torch._dynamo.reset()
    counters.clear()
    for n, (lengths, seed) in zip((21, 30), (([3, 9, 6], 10), ([5, 2, 8], 11)), strict=True):
        ids, mask = random_prompts(lengths, seed=seed)
        host = generate(m, ids, mask, max_new_tokens=n, **kw)
        dev = generate(m, ids, mask, max_new_tokens=n, cycle="device", compile=True, **kw)
        _same(host, dev)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_pooled_state_is_reused_and_refilled():
    """CUDA graphs read the state at fixed addresses: a generation with the same shapes gets the pooled buffers back,
    refilled with its own values; other shapes get their own."""
    m = tiny_llama(seed=4)

    def state(seed, n):
        ids = torch.randint(0, MASK_ID, (2, n), generator=torch.Generator().manual_seed(seed))
        job = make_job(m, ids, None, GenerationSettings(block_size=4, max_new_tokens=8))
        return dl.state_from_host([SequenceState(p, job) for p in job.prompts], job, [0, 0], torch.device("cpu"), 9)

    a = dl._pooled(m, state(0, 5))
    b_new = state(1, 5)
    b = dl._pooled(m, b_new)
    assert b is a and all(torch.equal(x, y) for x, y in zip(b.tensors(), b_new.tensors(), strict=True))
    assert not torch.equal(a.pend, state(0, 5).pend)  # refilled: the first state's prompts are gone
    c = dl._pooled(m, state(2, 7))  # longer prompts: other shapes
    assert c is not a and len(dl._STATE_POOL[m]) == 2


@pytest.mark.skipif(
    not torch.cuda.is_available() or not sbd_ext.hf.kernel_available(torch.device("cuda")), reason="no GPU"
)
def test_cuda_device_cycle_never_syncs_inside_a_cycle(monkeypatch):
    """On CUDA: no device-to-host synchronisation inside a cycle (eager, so every op is checked), and the compiled
    cycle (CUDA graphs) returns the host cycle's tokens."""
    _, m = _with_drafter(seed=3)
    m = m.cuda()
    ids, mask = random_prompts([5, 9, 3], seed=12)
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(max_new_tokens=24, block_size=2, verify=True, eos_token_id=[7])
    real = dc.cycle

    def strict(*a, **k):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(dc, "cycle", strict)
    dev = generate(m, ids, mask, cycle="device", **kw)
    monkeypatch.undo()
    _same(generate(m, ids, mask, **kw), dev)
    _same(generate(m, ids, mask, **kw), generate(m, ids, mask, cycle="device", compile=True, **kw))
