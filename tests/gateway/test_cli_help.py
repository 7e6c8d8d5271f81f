"""Every flag of the gateway's operator commands (``tandem serve``, ``ctl``, ``route explain``, ``usage``,
``cost estimate``, ``loadtest ...``) says what it does, its default and its unit; the rendered ``--help`` shows
the default."""

from __future__ import annotations

import argparse
import re

import pytest

from gateway.cli import build_parser

COMMANDS = (("serve",), ("ctl",), ("route", "explain"), ("usage",), ("cost", "estimate"), ("loadtest",))
# A flag whose name says it takes seconds, bytes, tokens, a rate... must name the unit in its help.
_TIMED = ("timeout", "duration", "rate", "usage", "tokens", "ttft", "itl", "settle", "window", "kill-at", "shift")
_UNITS = re.compile(r"second|bytes|MiB|GiB|tokens|requests/s|percent|fraction|count|nats")


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _parsers():
    """(command path, parser) of each command above and of every nested sub-command."""
    root = build_parser()
    todo = []
    for path in COMMANDS:
        p = root
        for name in path:
            p = _subparser(p, name)
        todo.append((" ".join(path), p))
    while todo:
        path, p = todo.pop()
        yield path, p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo.extend((f"{path} {n}", sp) for n, sp in a.choices.items())


CASES = [(path, p, a) for path, p in _parsers() for a in p._actions
         if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("path,parser,action", CASES, ids=[f"{p} {a.option_strings[-1]}" for p, _, a in CASES])
def test_every_flag_has_help_with_its_default(path, parser, action):
    flag = f"tandem {path} {action.option_strings[-1]}"
    assert action.help and action.help.strip(), f"{flag}: no help"
    shown = parser._get_formatter()._get_help_string(action)   # as --help renders it
    if action.default not in (None, False, [], argparse.SUPPRESS) and not action.required:
        assert "default" in shown, f"{flag}: default not shown"
    name = action.option_strings[-1]
    if action.type in (int, float) and (name.endswith("-s") or any(w in name for w in _TIMED)):
        assert _UNITS.search(action.help), f"{flag}: no unit in {action.help!r}"


def test_help_renders_defaults_and_units():
    for _, p in _parsers():
        p.format_help()                  # a stray % in a help string would raise here
    root = build_parser()
    text = _subparser(root, "serve").format_help()
    assert "server.port" in text and "default" in text
    explain = _subparser(_subparser(root, "route"), "explain").format_help()
    assert "percent" in explain
    ctl = _subparser(root, "ctl").format_help()
    assert "TANDEM_URL" in ctl


@pytest.mark.parametrize("module", ["engine.entrypoints.cli", "gateway.commands", "loadtests.cli",
                                    "loadtests.bench.cli"])
def test_each_areas_commands_are_the_ones_it_registers(module):
    """``tandem`` registers only the owner of the command it runs (gateway/cli.py ``COMMAND_MODULES``): the
    commands listed for each area must be exactly the top-level commands its ``register`` adds, or one vanishes."""
    import importlib

    from gateway.cli import COMMAND_MODULES

    parser = argparse.ArgumentParser()
    importlib.import_module(module).register(parser.add_subparsers())
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(action.choices) == set(COMMAND_MODULES[module])


def test_a_gateway_command_does_not_import_the_engine_server():
    """``tandem route explain --url`` answers in well under a second: parsing it registers the gateway's
    commands alone, not the engine's server (Litestar) nor the load tests (aiohttp)."""
    import subprocess
    import sys

    code = ("import sys; from gateway.cli import build_parser; build_parser('route').parse_args("
            "['route', 'explain', '--url', 'http://127.0.0.1:1', '--request', '{}']); "
            "print(sorted(m for m in ('engine.entrypoints.server', 'loadtests.upstream') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_reader_that_leaves_early_gets_no_traceback():
    """``tandem ... | head``: the pipe closes before the command writes; it exits 141 (as SIGPIPE would) and
    prints no BrokenPipeError traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "cost", "estimate", "--tokens-per-month", "1e9",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                       # before the command has imported anything, let alone written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_package_that_hides_one_of_ours_stops_tandem_with_what_to_do(tmp_path):
    """Found by a user trial: a fresh install got transformers 5.25, which brings HuggingFace's ``kernels``
    package; it hid this project's ``kernels/`` and the engine failed to start (gateway up, ``ready: false``).
    ``tandem`` now stops at once, naming the package and what to do; with none hidden it runs."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    code = "import sys; from gateway.cli import main; sys.exit(main(['--help']))"

    def tandem_help(pythonpath: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], cwd=tmp_path.parent, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": pythonpath}, timeout=60)

    hidden = tandem_help(f"{tmp_path}{os.pathsep}{repo}")   # a `kernels` package found before ours
    assert hidden.returncode == 2
    assert f"`import kernels` loads {tmp_path / 'kernels' / '__init__.py'}, not this project's" in hidden.stderr
    assert "pip uninstall kernels" in hidden.stderr
    assert tandem_help(repo).returncode == 0
    # installed from a wheel, HuggingFace's `kernels` writes its files over ours in site-packages: only its
    # metadata directory tells (a packaging trial: the guard missed it and `tandem generate` failed on import)
    (tmp_path / "kernels" / "__init__.py").unlink()
    (tmp_path / "kernels").rmdir()
    (tmp_path / "kernels-0.19.1.dist-info").mkdir()
    merged = tandem_help(f"{repo}{os.pathsep}{tmp_path}")
    assert merged.returncode == 2
    assert f"another installed package is named 'kernels' ({tmp_path / 'kernels-0.19.1.dist-info'})" in merged.stderr
    assert "--force-reinstall" in merged.stderr


def test_tandem_version_prints_the_packages_version():
    """``vllm --version`` and ``litellm --version`` exist; ``tandem --version`` answered "required: COMMAND" (a CLI
    trial)."""
    import subprocess
    import sys

    from engine.protocol.version import tandem_version

    out = subprocess.run([sys.executable, "-m", "gateway.cli", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"tandem {tandem_version()}", (out.stdout, out.stderr)
