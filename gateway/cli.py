"""The ``tandem`` command line.

Each area registers its own sub-commands (``register(subparsers)``) so that
this file stays a dispatcher: ``engine.cli`` (generate, engine serve, bench),
``gateway.commands`` (serve, route, ctl, usage, cost) and ``loadtests.cli``
(loadtest, parity).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = ("engine.cli", "gateway.commands", "loadtests.cli")


def build_parser() -> argparse.ArgumentParser:
    """The full ``tandem`` parser with every area's sub-commands."""
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv`` and run the chosen command's ``func(args)``."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
