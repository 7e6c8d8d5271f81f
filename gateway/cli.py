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


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows each flag's default: `` (default: X)`` is added unless the help already says it or there is
    none to say (no default, a switch that is off, a required flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and not action.required and "default" not in text
                and action.default not in (None, False, [], argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


class RawDefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """``DefaultsHelpFormatter`` keeping the description's own line breaks."""


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and all its sub-command parsers the formatters above."""
    raw = issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter)
    parser.formatter_class = RawDefaultsHelpFormatter if raw else DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)


def build_parser() -> argparse.ArgumentParser:
    """The full ``tandem`` parser with every area's sub-commands; every ``--help`` shows the defaults."""
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    show_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv`` and run the chosen command's ``func(args)``."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
