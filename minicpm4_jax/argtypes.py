"""argparse ``type=`` validators for bounded numbers and the help formatter, shared by the scripts in ``scripts/``.

A bad value is argparse's one-line usage error (exit 2) naming the option, the value and the allowed range, e.g.
``error: argument --rounds: 0 is out of range: give an integer >= 1``, instead of a traceback (or a silent
nonsense run) further down. Standard library only: ``scripts/torch_side.py`` imports it under the torch
environment too.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

__all__ = ["int_range", "float_range", "DefaultsHelpFormatter"]


def _ranged(convert: Callable[[str], float], noun: str, kind: str, lo, hi, lo_open: bool,
            hi_open: bool) -> Callable[[str], float]:
    """The argparse ``type``: ``convert(text)``, refused (:class:`argparse.ArgumentTypeError`) when it fails, is not
    finite, or lies outside the bounds."""
    bounds = [f"{'>' if lo_open else '>='} {lo}"] if lo is not None else []
    bounds += [f"{'<' if hi_open else '<='} {hi}"] if hi is not None else []
    want = " ".join([f"give {kind}", " and ".join(bounds)]).rstrip()

    def parse(text: str):
        try:
            x = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}: {want}") from None
        if ((isinstance(x, float) and not math.isfinite(x)) or (lo is not None and (x <= lo if lo_open else x < lo))
                or (hi is not None and (x >= hi if hi_open else x > hi))):
            raise argparse.ArgumentTypeError(f"{text} is out of range: {want}")
        return x

    parse.__name__ = convert.__name__
    return parse


def int_range(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` accepting an integer ``lo <= n <= hi`` (``None``: unbounded on that side).

    Returns a function ``str -> int`` that raises :class:`argparse.ArgumentTypeError` (argparse's one-line
    ``error: argument --opt: ...``, exit 2) for a non-integer or out-of-range value.
    """
    return _ranged(int, "an integer", "an integer", lo, hi, False, False)


def float_range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                hi_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` accepting a finite float between ``lo`` and ``hi`` (open ends with ``lo_open`` /
    ``hi_open``; ``None``: unbounded on that side).

    Returns a function ``str -> float`` that raises :class:`argparse.ArgumentTypeError` for a non-number, nan/inf
    or an out-of-range value.
    """
    return _ranged(float, "a number", "a finite number", lo, hi, lo_open, hi_open)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """A help formatter that shows every option's default: ``(default: X)`` is appended to an option's help unless
    the help already names its default or the option has none (``None`` / ``False`` / an empty list).

    The scripts' ``--help`` left most defaults out (``bench_decode.py --steps`` 32, ``--rounds`` 5, ...); written
    into each help by hand they drift from the code, this reads them from the parser."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (text and action.option_strings and "default" not in text.lower()
                and action.default not in (None, False, [], argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text
