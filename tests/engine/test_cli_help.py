"""Every flag of ``tandem engine serve``, ``tandem generate`` and ``tandem
bench ...`` has help text, and the help shows each default (fast: no model)."""

from __future__ import annotations

import argparse

import pytest

from gateway.cli import build_parser


def subcommand(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("path", [("engine", "serve"), ("generate",), ("bench", "engine"), ("bench", "structured")])
def test_every_flag_has_help_with_its_default(path):
    parser = subcommand(build_parser(), *path)
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"tandem {' '.join(path)} {action.option_strings}: no help text"
        if not action.required:
            rendered = parser._get_formatter()._expand_help(action) if "%(default)" in action.help else (
                argparse.ArgumentDefaultsHelpFormatter("x")._get_help_string(action) % vars(action))
            assert "default" in rendered, f"{action.option_strings}: the help does not show the default"
    assert "(default: " in text
