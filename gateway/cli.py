"""The ``tandem`` command line.

Each area registers its own sub-commands (``register(subparsers)``) so that
this file stays a dispatcher: ``engine.entrypoints.cli`` (generate, engine serve),
``gateway.commands`` (serve, route, ctl, usage, cost), ``loadtests.cli``
(loadtest, parity) and ``loadtests.bench.cli`` (bench).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Each area's module and the top-level commands its ``register`` adds (tests/gateway/test_cli_help.py pins the
# two together): ``tandem X`` imports only X's module, so a quick command does not load the others first.
COMMAND_MODULES = {
    "engine.entrypoints.cli": ("generate", "engine"),
    "gateway.commands": ("serve", "route", "ctl", "usage", "cost"),
    "loadtests.cli": ("loadtest", "parity"),
    "loadtests.bench.cli": ("bench",),
}


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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``tandem`` parser; every ``--help`` shows the defaults. With ``command`` (a top-level command of
    ``COMMAND_MODULES``) only its module registers, so a quick command such as ``route explain --url`` does not
    import the engine's server or the load tests first; otherwise every area's sub-commands."""
    from engine.protocol.version import tandem_version   # after shadowed_packages: not at this module's import

    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: the LLM gateway and its co-located engine.")
    parser.add_argument("--version", action="version", version=f"tandem {tandem_version()}",
                        help="print the version and exit (as vllm --version, litellm --version)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    owner = [name for name, commands in COMMAND_MODULES.items() if command in commands]
    for name in owner or COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    show_defaults(parser)
    return parser


def shadowed_packages() -> list[str]:
    """This project's top-level packages that another installed package of the same name hides (``import``
    would load the other one) or has written over, each as a sentence saying which and what to do; empty when
    none is. Seen: from transformers 5.25 on, HuggingFace's ``kernels`` package in site-packages comes before an
    editable install's ``kernels/`` (whose finder Python consults last), and the engine failed to start with an
    ImportError; installed from a wheel, both share site-packages' ``kernels/`` and the other's files replace
    ours (a packaging trial), which only the other distribution's ``kernels-*.dist-info`` shows."""
    import glob
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the directory holding gateway/
    out = []
    for name in ("engine", "kernels", "policies", "loadtests"):
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        fix = (f"(`pip uninstall {name}`, then `pip install --force-reinstall --no-deps tandem` where tandem was "
               f"installed from a wheel; HuggingFace's `kernels` comes with transformers >= 5.25, which this "
               f"project keeps below)")
        if origin is not None and not os.path.abspath(origin).startswith(os.path.join(root, name) + os.sep):
            out.append(f"`import {name}` loads {origin}, not this project's {os.path.join(root, name)}: another "
                       f"installed package is named {name!r} {fix}")
            continue
        # a distribution's metadata directory is its normalized name, then "-" and the version (PEP 491)
        other = next((hit for d in sys.path if d and os.path.isdir(d)
                      for hit in glob.glob(os.path.join(d, f"{name}-*.dist-info"))), None)
        if other is not None:
            out.append(f"another installed package is named {name!r} ({other}): it shares or replaces this "
                       f"project's {name}/ {fix}")
    return out


def leaf_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the sub-command ``args`` chose (``tandem engine serve``'s for ``engine serve ...``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(getattr(args, action.dest, None))
            if sub is not None:
                return leaf_parser(sub, args)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv`` and run the chosen command's ``func(args)``."""
    argv = sys.argv[1:] if argv is None else argv
    for problem in shadowed_packages():   # before anything imports the other package in its place
        print(f"tandem: {problem}", file=sys.stderr)
        return 2
    if argv and argv[0] in ("engine", "generate"):   # vLLM's spellings (--tensor_parallel_size, --x.key v)
        from engine.protocol.cli_spellings import vllm_argv
        argv = vllm_argv(argv)
    parser = build_parser(argv[0] if argv else None)
    args, extra = parser.parse_known_args(argv)
    if extra:   # said by the command's own parser: its usage, not the top level's
        leaf_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # the reader left (``tandem ctl ... | head``): no traceback, and none at exit when Python flushes stdout
        # (the recipe of Python's signal module documentation, "Note on SIGPIPE")
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141                                     # 128 + SIGPIPE, as a shell reports a command killed by it


if __name__ == "__main__":
    sys.exit(main())
