"""The sampler registry (sbd_ext/samplers.py) agrees with the kernels' rule list and with every reader of it.

The C++ side is read twice: parsed from its sources (the names ``parse_accept_rule`` accepts, in the order of the
``sbd::AcceptRule`` enum) and queried through the op (each registered name is accepted on every device, anything else
is refused, and a negative threshold is refused exactly for the samplers whose registry entry says so).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import sbd_ext
from sbd_ext import reference, samplers
from sbd_ext.decoding import DEFAULT_THRESHOLDS, SAMPLERS, GenerationSettings

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def _cpp_rules() -> list[tuple[str, str]]:
    """(name, enum constant) of every rule parse_accept_rule accepts, in source order."""
    text = (CSRC / "mask_replace_checks.h").read_text()
    body = text[text.index("parse_accept_rule") :]
    body = body[: body.index("TORCH_CHECK_VALUE")]
    return re.findall(r'rule == "(\w+)"\) return sbd::AcceptRule::(\w+);', body)


def _cpp_enum() -> list[str]:
    """The constants of sbd::AcceptRule with their values, in value order."""
    text = (CSRC / "include" / "sbd" / "common.h").read_text()
    body = text[text.index("enum class AcceptRule") :]
    body = body[: body.index("};")]
    pairs = re.findall(r"(k\w+)\s*=\s*(\d+)", body)
    return [name for name, _ in sorted(pairs, key=lambda p: int(p[1]))]


def test_cpp_rule_list_matches_the_registry():
    rules = _cpp_rules()
    assert [name for name, _ in rules] == list(samplers.NAMES), (rules, samplers.NAMES)
    assert [const for _, const in rules] == _cpp_enum(), "parse_accept_rule must follow sbd::AcceptRule's order"


def test_readers_use_the_registry():
    assert reference.RULES == samplers.NAMES == SAMPLERS
    assert DEFAULT_THRESHOLDS == {n: s.default_threshold for n, s in samplers.SAMPLERS.items()}
    for name, sampler in samplers.SAMPLERS.items():
        assert GenerationSettings(sampler=name).threshold == sampler.default_threshold


def test_cli_sampler_choices():
    from sbd_ext.demo import cli

    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    choices = {
        (name, action.dest): tuple(action.choices)
        for name, parser in sub.choices.items()
        for action in parser._actions
        if action.dest in ("sampler", "samplers")
    }
    assert choices == {("generate", "sampler"): samplers.NAMES, ("eval", "samplers"): samplers.NAMES}, choices


def _block(device):
    tokens = torch.tensor([[5, 5, 1, 5]], device=device)
    prop = torch.tensor([[7, 8, 9, 6]], device=device)
    ent = torch.tensor([[0.05, 0.2, 0.0, 0.01]], device=device)
    return tokens, prop, ent, 1.0 - ent


@pytest.mark.parametrize("name", samplers.NAMES)
def test_the_op_accepts_every_registered_sampler(device, name):
    tokens, prop, ent, pmax = _block(device)
    ref_tokens = tokens.cpu().clone()
    thr = samplers.DEFAULT_THRESHOLDS[name]
    counts = torch.ops.sbd_ext.mask_replace(tokens, prop, ent, pmax, 5, name, thr)
    ref_counts = reference.mask_replace(ref_tokens, prop.cpu(), ent.cpu(), pmax.cpu(), 5, name, thr)
    assert torch.equal(tokens.cpu(), ref_tokens) and torch.equal(counts[0].cpu(), ref_counts[0])


@pytest.mark.parametrize("name", samplers.NAMES)
def test_negative_thresholds_follow_the_registry(device, name):
    """The kernels refuse a negative threshold exactly where the registry's min_threshold does."""
    tokens, prop, ent, pmax = _block(device)
    refused_by_registry = samplers.SAMPLERS[name].min_threshold is not None
    with pytest.raises(ValueError) if refused_by_registry else _no_error():
        samplers.check_threshold(name, -0.5, "test")
    with pytest.raises(ValueError) if refused_by_registry else _no_error():
        torch.ops.sbd_ext.mask_replace(tokens, prop, ent, pmax, 5, name, -0.5)


def test_unknown_sampler_is_refused_everywhere(device):
    tokens, prop, ent, pmax = _block(device)
    with pytest.raises(ValueError, match="rule must be one of"):
        torch.ops.sbd_ext.mask_replace(tokens, prop, ent, pmax, 5, "greedy", 0.1)
    with pytest.raises(ValueError, match=r"rule must be one of \('eb', 'entropy', 'confidence'\)"):
        sbd_ext.mask_replace(tokens, prop, ent, pmax, 5, "greedy", 0.1)
    with pytest.raises(ValueError, match="sampler must be one of"):
        GenerationSettings(sampler="greedy")
    with pytest.raises(ValueError, match="rule must be one of"):
        reference.mask_replace(tokens.cpu(), prop.cpu(), ent.cpu(), pmax.cpu(), 5, "greedy", 0.1)


class _no_error:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
