"""The sampler registry: the acceptance rules of ``mask_replace``, their default thresholds and threshold checks.

One entry per rule, in the order of ``sbd::AcceptRule`` (csrc/include/sbd/common.h). The rule itself is written
twice, as the kernels' predicate (csrc/include/sbd/accept.h, its name parsed in csrc/mask_replace_checks.h) and as
the pure-PyTorch reference (:func:`sbd_ext.reference.mask_replace`); everything else reads this table: the op
wrapper, decoding's :class:`~sbd_ext.decoding.GenerationSettings`, the reference and the CLI.
``python_tests/ops/test_sampler_registry.py`` checks that the C++ rule list agrees with it.

Adding a sampler: the rule (C++ header + its name in ``parse_accept_rule`` + the reference), one entry here, tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SAMPLERS", "NAMES", "DEFAULT_THRESHOLDS", "Sampler", "get_sampler", "check_threshold"]


@dataclass(frozen=True)
class Sampler:
    """One acceptance rule of ``mask_replace``.

    name: the rule's name in the op schema and in :class:`GenerationSettings`. threshold_name: "gamma" (an entropy
    bound, nats) or "tau" (a probability). default_threshold: the library default. min_threshold: the smallest
    legal threshold (inclusive), None for any number. summary: what it reveals.
    """

    name: str
    threshold_name: str
    default_threshold: float
    min_threshold: float | None
    summary: str


# Defaults: gamma 0.35 for the entropy rules is the paper's chat gamma_low (and its reasoning gamma_high; the
# reasoning gamma_low is 0.1, which the demo uses); tau 0.9 for the confidence rule as in Fast-dLLM.
SAMPLERS: dict[str, Sampler] = {
    s.name: s
    for s in (
        Sampler("eb", "gamma", 0.35, 0.0, "entropy-bounded (paper Eq. 8): the largest entropy-sorted prefix whose "
                "entropies, all but the last, sum to <= gamma"),
        Sampler("entropy", "gamma", 0.35, 0.0, "every position with entropy < gamma"),
        Sampler("confidence", "tau", 0.9, None, "every position with max probability > tau (Fast-dLLM)"),
    )
}  # fmt: skip
NAMES: tuple[str, ...] = tuple(SAMPLERS)
DEFAULT_THRESHOLDS: dict[str, float] = {n: s.default_threshold for n, s in SAMPLERS.items()}


def get_sampler(name, who: str = "sampler") -> Sampler:
    """The registry entry of ``name``; a ValueError naming the registered samplers otherwise."""
    sampler = SAMPLERS.get(name) if isinstance(name, str) else None
    if sampler is None:
        raise ValueError(f"{who} must be one of {NAMES}, got {name!r}")
    return sampler


def check_threshold(name: str, threshold, who: str, *, finite: bool = False) -> float:
    """``threshold`` of sampler ``name`` as a float: a real number (an int, a float, a NumPy scalar or a 0-d tensor;
    not a bool or a string), not NaN (with ``finite``, not infinite either), and at least the sampler's
    ``min_threshold``. Errors start with ``who``."""
    sampler = get_sampler(name, f"{who}: sampler")
    value = None
    if not isinstance(threshold, (bool, str, bytes)):
        try:
            value = float(threshold)
        except (TypeError, ValueError):
            value = None
    if value is None or math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{who}: threshold must be a {'finite ' if finite else ''}number, got {threshold!r}")
    if sampler.min_threshold is not None and value < sampler.min_threshold:
        raise ValueError(
            f"{who}: the {name!r} sampler's threshold {sampler.threshold_name} must be >= {sampler.min_threshold:g}, "
            f"got {value}"
        )
    return value
