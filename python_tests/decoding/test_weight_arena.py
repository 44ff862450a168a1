"""The weight arena (sbd_ext.weight_arena): the kernel tensors a compiled CPU step reads, moved into one buffer per
dtype. Moving must not change a value, a tensor's identity or a sharing (a drafter's fused copy and the base weight
that views it); a tensor moved out again (an assigned buffer, a device move) must be seen and the arena rebuilt or
dropped; the compiled step must read the arena (far fewer graph inputs) and give the tokens it gives without it;
and nothing outside the step may read it."""

from __future__ import annotations

import copy

import pytest
import torch
from sbd_models import random_drafter, tiny_llama

import sbd_ext
import sbd_ext.decoding.compiled as compiled
from sbd_ext import weight_arena
from sbd_ext.decoding import direct_call
from sbd_ext.demo import models, tasks
from sbd_ext.demo.evaluate import format_prompt
from sbd_ext.packing import constant_weight

pytestmark = pytest.mark.skipif(
    not sbd_ext.hf.kernel_available(torch.device("cpu")), reason="the block_attention CPU kernel is not built"
)

SCHEMES = ["packed", "bf16", "int8", "w8a8"]


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _in_arena(t: torch.Tensor, arena: weight_arena.Arena) -> bool:
    return any(t.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in arena.flats.values())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prepare_moves_each_kernel_tensor_keeping_values_and_outputs(scheme):
    model = sbd_ext.quantize(tiny_llama(seed=3), scheme)
    ids = torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(0))
    want, state = _logits(model, ids), {k: v.clone() for k, v in model.state_dict().items()}
    before = [(name, t, t.clone()) for _, name, t in weight_arena._listed(model)]
    arena = weight_arena.prepare(model)
    assert arena is not None and len(before) >= 14  # 2 layers x 7 projections (+ scales, the head)
    assert {str(t.dtype)[6:] for _, t, _ in before} == set(arena.flats)  # one buffer per dtype
    for (m, name, t), (name0, old, value) in zip(weight_arena._listed(model), before, strict=True):
        assert name == name0 and _in_arena(t, arena) and torch.equal(t, value)
        assert type(t) is type(old) and t.requires_grad is False  # a constant weight stays one (dynamo)
        assert torch.equal(old, value)  # the old tensor (a caller may hold it) keeps its memory and values
        key, off, shape = m.__dict__[weight_arena.LINK][1][name]
        assert torch.equal(arena.flats[key][off : off + t.numel()].view(shape), t)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(_logits(model, ids), want)
    assert weight_arena.prepare(model) is arena  # nothing moved: kept
    model.load_state_dict(state)  # in place: into the arena
    assert weight_arena.prepare(model) is arena and torch.equal(_logits(model, ids), want)


def test_a_tensor_moved_out_rebuilds_the_arena_with_its_new_values():
    model = sbd_ext.quantize(tiny_llama(seed=4), "packed")
    first = weight_arena.prepare(model)
    layer = model.model.layers[1].mlp.down_proj
    new = constant_weight(layer.weight_packed.clone() * 2)
    layer.weight_packed = new  # an assigned buffer: not in the arena
    arena = weight_arena.prepare(model)
    assert arena is not first and _in_arena(layer.weight_packed, arena) and torch.equal(layer.weight_packed, new)
    key, off, shape = layer.__dict__[weight_arena.LINK][1]["weight_packed"]
    assert torch.equal(arena.flats[key][off : off + new.numel()].view(shape), new)
    with torch.no_grad():
        layer.weight_packed.data = layer.weight_packed.data.clone()  # the same object on another storage
    assert weight_arena.prepare(model) is not arena


def test_another_device_or_the_switch_drops_every_link(monkeypatch):
    model = sbd_ext.quantize(tiny_llama(seed=5), "w8a8")
    assert weight_arena.prepare(model) is not None
    assert weight_arena.prepare(model, "cuda") is None  # the arena is for the CPU step only
    assert not any(weight_arena.LINK in m.__dict__ for m in model.modules())
    assert weight_arena.prepare(model) is not None
    monkeypatch.setenv("SBD_EXT_WEIGHT_ARENA", "0")
    assert weight_arena.prepare(model) is None
    assert not any(weight_arena.LINK in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("scheme", ["packed", "w8a8"])
def test_a_drafters_fused_copy_and_its_base_view_still_share(scheme):
    _, model = random_drafter(seed=6)
    sbd_ext.quantize(model, scheme)
    model.sbd_drafter.refresh(model, "cpu")
    arena = weight_arena.prepare(model)
    adapters = [m for _, m in model.sbd_drafter.lora_modules(model)]
    fused = [m for m in adapters if m.fused_weight() is not None]
    if scheme == "w8a8" and not fused:
        pytest.skip("w8a8 weights are packed (and fused) on AVX512-VNNI only")
    assert fused
    name = "weight_packed" if scheme == "packed" else "weight_int8_packed"
    copies = [m._fused for m in fused]
    for m in fused:
        base_w = m.base._buffers[name]
        assert base_w is m._fused_view and base_w.data_ptr() == m._fused.data_ptr() and _in_arena(base_w, arena)
    model.sbd_drafter.refresh(model, "cpu")  # nothing changed: no copy rebuilt, the arena kept
    assert weight_arena.prepare(model) is arena and all(m._fused is c for m, c in zip(fused, copies, strict=True))


def test_a_deep_copy_keeps_its_own_arena():
    model = sbd_ext.quantize(tiny_llama(seed=7), "w8a8")
    arena = weight_arena.prepare(model)
    twin = copy.deepcopy(model)
    twin_arena = weight_arena.prepare(twin)
    assert twin_arena is twin.__dict__[weight_arena.MODEL_ARENA] and twin_arena is not arena  # copied, not rebuilt
    assert all(_in_arena(t, twin_arena) and not _in_arena(t, arena) for _, _, t in weight_arena._listed(twin))


def test_a_users_own_compile_reads_the_layers_own_tensors():
    model = sbd_ext.quantize(tiny_llama(seed=8), "packed")
    weight_arena.prepare(model)
    layer = model.model.layers[0].self_attn.o_proj
    x = torch.randn(1, 3, layer.in_features)
    fn = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(fn(x), layer(x))
        layer.weight_packed.mul_(0.5)  # in place: the arena's slot and the layer's tensor are one
        assert torch.equal(fn(x), layer(x))
        layer.weight_packed = constant_weight(layer.weight_packed.clone() * 3)  # moved out; the arena not in use
        assert torch.equal(fn(x), layer(x))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ntp", "verify"])
def test_the_compiled_step_reads_the_arena_and_decodes_the_same_tokens(monkeypatch, mode):
    base, tok = models.load(models.DEFAULT_MODEL)
    info = models.demo_info(models.DEFAULT_MODEL)
    text = format_prompt(next(iter(tasks.problems("test", 1))).prompt, info.get("prompt_template"))
    ids = tok([text], return_tensors="pt").input_ids
    kw = dict(mode="sbd", verify=True) if mode == "verify" else dict(mode="ntp")
    kw |= dict(block_size=info["block_size"], max_new_tokens=32, compile=True)
    calls: list[list] = []  # the replayed graph calls' argument lists
    real = direct_call.DirectCall.__call__

    def recording(self, *tensors):
        calls.append(self.args)
        return real(self, *tensors)

    monkeypatch.setattr(direct_call.DirectCall, "__call__", recording)
    got, inputs = {}, {}
    for switch in ("1", "0"):
        monkeypatch.setenv("SBD_EXT_WEIGHT_ARENA", switch)
        model = sbd_ext.quantize(copy.deepcopy(base), "w8a8")
        torch._dynamo.reset()
        monkeypatch.setattr(compiled, "_VARIANTS", set())
        calls.clear()
        got[switch] = sbd_ext.generate(model, ids, **kw).sequences
        assert calls
        args = {id(a) for a in calls[-1] if isinstance(a, torch.Tensor)}
        inputs[switch] = len(args)
        listed = {id(t) for _, _, t in weight_arena._listed(model)}
        arena = model.__dict__.get(weight_arena.MODEL_ARENA)
        if switch == "1":  # the graph reads the arena's buffers, none of the layers' own tensors; on only inside
            assert arena is not None and not arena.on
            assert {id(f) for f in arena.flats.values()} <= args and not listed & args
        else:
            assert arena is None and len(listed & args) >= len(listed) // 2
    assert inputs["1"] < inputs["0"] // 2
    assert torch.equal(got["1"], got["0"])
    eager = sbd_ext.generate(sbd_ext.quantize(copy.deepcopy(base), "w8a8"), ids, **{**kw, "compile": False})
    assert torch.equal(got["1"], eager.sequences)


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text.split("[")[1].split("]")[0] if "[" in text else None


def _huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages (kB) of the mapping that holds ``t``'s first byte (/proc/self/smaps)."""
    found = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            found = lo <= t.data_ptr() < hi
        elif found and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="Linux transparent huge pages are off here")
def test_a_large_arena_starts_on_a_huge_page_and_asks_for_them(monkeypatch):
    model = sbd_ext.quantize(tiny_llama(seed=9, hidden=512, intermediate=1024), "packed")  # ~20 MB of panels
    flat = weight_arena.prepare(model).flats["float32"]
    assert flat.data_ptr() % weight_arena.HUGE_PAGE == 0
    assert _huge_kb(flat) >= 2048  # at least one 2 MB page under the arena
    if _thp_mode() == "madvise":  # huge pages only on request: without it, none
        monkeypatch.setenv("SBD_EXT_WEIGHT_ARENA", "nohuge")
        model = sbd_ext.quantize(tiny_llama(seed=9, hidden=512, intermediate=1024), "packed")
        assert _huge_kb(weight_arena.prepare(model).flats["float32"]) == 0
