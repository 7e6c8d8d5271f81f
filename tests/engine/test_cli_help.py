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


def test_flags_take_vllms_spellings_and_refuse_what_cannot_be_meant(capsys):
    # a trial: --dtype half, --max-model-len 4k refused (vLLM takes them); --port 73856 listened on 8320
    serve = subcommand(build_parser(), "engine", "serve")
    args = serve.parse_args(["--dtype", "half", "--max-model-len", "4k"])
    assert (args.dtype, args.max_model_len) == ("float16", 4000)
    args = serve.parse_args(["--dtype", "float", "--max-model-len", "25.6k"])
    assert (args.dtype, args.max_model_len) == ("float32", 25600)
    assert serve.parse_args(["--max-model-len", "4K", "--port", "0"]).max_model_len == 4096
    for argv, said in ((["--port", "73856"], "a TCP port is 0-65535, got 73856"),
                       (["--max-model-len", "4.5"], "a token count must be a whole number"),
                       (["--max-model-len", "lots"], "cannot parse a token count")):
        with pytest.raises(SystemExit):
            serve.parse_args(argv)
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--port", "99999"])   # the gateway's too
    assert "a TCP port is 0-65535, got 99999" in capsys.readouterr().err


def test_an_unknown_flag_is_named_with_its_commands_usage(capsys):
    """A trial's ``tandem engine serve --load-formatx`` printed the top level's usage (``tandem [-h] COMMAND``):
    the command's own parser says it now."""
    from gateway.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["engine", "serve", "--no-such-flag"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage: tandem engine serve" in err
    assert "tandem engine serve: error: unrecognized arguments: --no-such-flag" in err
