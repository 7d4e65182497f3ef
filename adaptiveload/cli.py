"""The ``adaptiveload`` command line: one subcommand per job, each defined next to the code it runs.

Every module listed in ``_COMMAND_MODULES`` exposes ``add_commands(subparsers)``, which adds its
subcommands and sets ``func`` (a callable taking the parsed ``argparse.Namespace`` and returning an
exit code) as their default. Every subcommand's ``--help`` shows its defaults
(:class:`adaptiveload.cliargs.HelpFormatter`).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from adaptiveload import __version__
from adaptiveload.cliargs import HelpFormatter

_COMMAND_MODULES = (
    "adaptiveload.train.cli",  # train, calibrate
    "adaptiveload.sched.cli",  # plan, simulate
    "adaptiveload.fxfuse.cli",  # inspect
    "adaptiveload.ops.cli",  # build
)


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser: shows defaults in ``--help``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaptiveload",
        description="Fused adaLN-modulate backend and cost-balanced bucket sampling for video DiT training.",
    )
    parser.add_argument("--version", action="version", version=f"adaptiveload {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).add_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:  # bad input: one clear line, no traceback
        print(f"adaptiveload {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
