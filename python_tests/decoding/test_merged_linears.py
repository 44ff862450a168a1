"""Sibling projections in one call (sbd_ext.merged_linears): q/k/v and gate/up whose kernel tensors lie one after
another in the weight arena run as one row_linear call inside the compiled CPU step. The grouping must find exactly
those (not o_proj / down_proj, not a member of another kind), the compiled step must take the one call, and the
tokens must be those of the eager forward and of the compiled step with every projection its own call."""

from __future__ import annotations

import copy

import pytest
import torch
from sbd_models import random_drafter, tiny_llama
from torch import nn

import sbd_ext
import sbd_ext.decoding.compiled as compiled
from sbd_ext import merged_linears, weight_arena

pytestmark = pytest.mark.skipif(
    not sbd_ext.hf.kernel_available(torch.device("cpu")), reason="the block_attention CPU kernel is not built"
)

SCHEMES = ["packed", "bf16", "int8", "w8a8"]


def _members(model) -> dict[str, merged_linears.Member]:
    key = merged_linears.MERGED
    return {n: m.__dict__[key] for n, m in model.named_modules() if key in m.__dict__}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_arena_groups_q_k_v_and_gate_up_with_their_columns(scheme):
    model = sbd_ext.quantize(tiny_llama(seed=3, layers=2), scheme)
    arena = weight_arena.prepare(model)
    got = _members(model)
    want = [f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")]  # fmt: skip
    assert sorted(got) == sorted(want)
    for i in range(2):
        attn, mlp = model.model.layers[i].self_attn, model.model.layers[i].mlp
        q, k, v = (got[f"model.layers.{i}.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj"))
        g, u = got[f"model.layers.{i}.mlp.gate_proj"], got[f"model.layers.{i}.mlp.up_proj"]
        assert q.group is k.group is v.group and g.group is u.group and q.group is not g.group
        assert [q.index, k.index, v.index, q.last, k.last, v.last] == [0, 1, 2, False, False, True]
        assert (q.col, q.n) == (0, attn.q_proj.out_features)
        assert k.col == q.col + -(-q.n // 16) * 16 and v.col == k.col + -(-k.n // 16) * 16
        assert (g.col, u.col, u.n) == (0, -(-mlp.gate_proj.out_features // 16) * 16, mlp.up_proj.out_features)
        assert q.arena is arena and q.quantize_x == (scheme == "w8a8")
        # the merged tensor: the members' own kernel tensors, concatenated
        key, off, shape = q.weight
        merged = arena.flats[key][off : off + torch.Size(shape).numel()].view(shape)
        own = [getattr(attn, p).kernel_weight()[0] if scheme in ("int8", "w8a8") else getattr(attn, p).weight_packed
               for p in ("q_proj", "k_proj", "v_proj")]  # fmt: skip
        assert torch.equal(merged, torch.cat(own))


@pytest.mark.parametrize("scheme", ["packed", "w8a8"])
def test_a_drafters_adapters_group_over_their_fused_copies_and_b(scheme):
    _, model = random_drafter(seed=6)
    sbd_ext.quantize(model, scheme)
    model.sbd_drafter.refresh(model, "cpu")
    weight_arena.prepare(model)
    attn = model.model.layers[0].self_attn
    if attn.q_proj.fused_weight() is None:
        pytest.skip("w8a8 weights are packed (and fused) on AVX512-VNNI only")
    q, k, v = (p.__dict__[merged_linears.MERGED] for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    ns = tuple(p.out_features for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert q.segments == ns and (q.gated_col, k.gated_col, v.gated_col) == (0, ns[0], ns[0] + ns[1])
    a_rows = -(-attn.q_proj.rank // 16) * 16  # each [W; A] call's columns: W's, then A's panels
    assert (k.col, v.col) == (ns[0] + a_rows, ns[0] + ns[1] + 2 * a_rows)
    key, off, shape = q.lora_b
    b = weight_arena.prepare(model).flats[key][off : off + torch.Size(shape).numel()].view(shape)
    assert torch.equal(b, torch.cat([p.packed_b() for p in (attn.q_proj, attn.k_proj, attn.v_proj)]))


def test_a_member_of_another_kind_breaks_only_its_group():
    model = sbd_ext.quantize(tiny_llama(seed=4, layers=2), "packed")
    layer = model.model.layers[1]
    layer.self_attn.v_proj = nn.Linear(layer.self_attn.v_proj.in_features, layer.self_attn.v_proj.out_features,
                                       bias=False)  # fmt: skip
    weight_arena.prepare(model)
    got = _members(model)
    assert not any(n.startswith("model.layers.1.self_attn.") for n in got)
    assert "model.layers.1.mlp.gate_proj" in got and "model.layers.0.self_attn.v_proj" in got


def test_off_the_arena_and_outside_a_compile_each_member_runs_its_own_call():
    model = sbd_ext.quantize(tiny_llama(seed=5, layers=2), "w8a8")
    arena = weight_arena.prepare(model)
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(1, 3, q.in_features)
    assert merged_linears.member_out(q, x) is None  # eager
    arena.on = True
    try:
        assert merged_linears.member_out(q, x) is None  # still eager: the one call is for the compiled step
    finally:
        arena.on = False
    assert weight_arena.prepare(model, "cuda") is None and not _members(model)  # links dropped: groups too


def _decode(model, ids, kw, merged: bool, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "_VARIANTS", set())
    monkeypatch.setenv("SBD_EXT_MERGED_LINEARS", "1" if merged else "0")
    model.__dict__.pop(weight_arena.MODEL_ARENA, None)  # a new arena reads the switch
    weight_arena._unlink(model)
    calls = []
    real = merged_linears._call

    def counting(spec, x, rows, gate):
        calls.append((spec, gate is not None))
        return real(spec, x, rows, gate)

    monkeypatch.setattr(merged_linears, "_call", counting)
    out = sbd_ext.generate(model, ids, compile=True, **kw).sequences
    return out, calls


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["packed", "w8a8"])
@pytest.mark.parametrize("mode", ["ntp", "verify"])
def test_the_compiled_step_takes_one_call_per_group_and_decodes_the_same_tokens(monkeypatch, scheme, mode):
    _, model = random_drafter(seed=7)
    sbd_ext.quantize(model, scheme)
    ids = torch.randint(0, 90, (1, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(mode="ntp", verify=False) if mode == "ntp" else dict(verify=True, block_size=3)
    kw |= dict(max_new_tokens=12)
    eager = sbd_ext.generate(copy.deepcopy(model), ids, compile=False, **kw).sequences
    one, calls = _decode(model, ids, kw, True, monkeypatch)
    each, none = _decode(model, ids, kw, False, monkeypatch)
    assert not none and torch.equal(one, each) and torch.equal(one, eager)
    # NTP: a drafter's adapters with no gate, one row_linear over the group's [W; A] (traced once per graph); verify:
    # with the gate, one gated_lora_linear over the group's [W_i; A_i] and B'_i
    gated = mode == "verify"
    assert len({id(s.group) for s, with_gate in calls if with_gate == gated}) == 4  # 2 layers x (q/k/v, gate/up)
    assert all(s.segments and s.lora_b is not None for s, _ in calls)
