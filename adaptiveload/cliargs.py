"""Argument types and conventions shared by every ``adaptiveload`` subcommand.

* values are checked where they are parsed, and a bad one is rejected naming the flag;
* every default is shown in ``--help`` (:class:`HelpFormatter`);
* an old spelling of a flag or of a choice keeps working for one release and prints one
  deprecation note on stderr (:func:`deprecated_flag`, :func:`choice`).
"""
from __future__ import annotations

import argparse
import sys


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to every option with a meaningful default (not None, False or a
    suppressed one) whose help does not already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        # identity, not ==: a default of 0 (== False) is shown
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS or "(default" in text:
            return text
        default = action.default
        if isinstance(default, (list, tuple)):
            default = ",".join(map(str, default)) if action.nargs is None else " ".join(map(str, default))
        return f"{text} (default: {default})"


def note(message: str) -> None:
    """One line on stderr, prefixed ``adaptiveload: note:``."""
    print(f"adaptiveload: note: {message}", file=sys.stderr, flush=True)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = _parse(int, text, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = _parse(int, text, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = _parse(float, text, "a number")
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    value = _parse(float, text, "a number")
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1, e.g. ``1,2,4``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def int_triple(text: str) -> tuple[int, int, int]:
    """An argparse type: three comma-separated integers >= 1, ``T,H,W`` (a VAE stride or a patch
    size, e.g. ``4,8,8``), returned as a tuple."""
    parts = [v.strip() for v in text.split(",")]
    try:
        values = tuple(int(v) for v in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three comma-separated integers T,H,W, got {text!r}") from None
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"expected three comma-separated integers T,H,W, got {len(values)} in {text!r}")
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers T,H,W >= 1, got {text!r}")
    return values


def _parse(kind, text: str, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def choice(flag: str, choices, deprecated: dict):
    """An argparse type for ``flag`` taking one of ``choices``, or an old spelling from
    ``deprecated`` (old -> current), which is mapped and noted on stderr.

    Use it with ``metavar`` listing the current choices (argparse's own ``choices=`` would reject
    the old spellings before this type maps them)."""

    def parse(text: str) -> str:
        if text in choices:
            return text
        if text in deprecated:
            note(f"{flag} {text} is deprecated and will be removed in the next release; use {flag} {deprecated[text]}")
            return deprecated[text]
        raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(choices)})")

    parse.__name__ = flag  # argparse names the type in some messages
    return parse


def deprecated_flag(new_flag: str):
    """An argparse action for an old flag name: stores its value into ``dest`` (give the new flag's)
    and notes on stderr that ``new_flag`` replaces it. The old flag is hidden from ``--help``."""

    class Deprecated(argparse.Action):
        def __init__(self, option_strings, dest, **kwargs):
            kwargs["help"] = argparse.SUPPRESS
            super().__init__(option_strings, dest, **kwargs)

        def __call__(self, parser, namespace, values, option_string=None):
            note(f"{option_string} is deprecated and will be removed in the next release; use {new_flag}")
            setattr(namespace, self.dest, values)

    return Deprecated
