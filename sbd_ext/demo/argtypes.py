"""argparse types shared by the command lines (``sbd-ext``: :mod:`sbd_ext.demo.cli`; the drafter recipe:
:mod:`sbd_ext.recipes.drafter.args`; ``python -m sbd_ext.recipes.smollm2``): a value out of range is a usage
error (exit code 2) that names the range."""

from __future__ import annotations

import argparse
import math

__all__ = ["finite_number", "int_in"]


def int_in(lo: int, hi: int | None = None):
    """argparse type: an integer in [lo, hi] (no upper bound when ``hi`` is None)."""
    want = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {want}, got {value}")
        return value

    return parse


def finite_number(lo: float = 0.0, hi: float | None = None, above: bool = False):
    """argparse type: a finite number >= ``lo`` (> ``lo`` with ``above``) and <= ``hi`` (no nan / inf)."""
    want = f"a finite number {'>' if above else '>='} {lo:g}" + ("" if hi is None else f" and <= {hi:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        bad = not math.isfinite(value) or value < lo or (above and value == lo) or (hi is not None and value > hi)
        if bad:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
        return value

    return parse
