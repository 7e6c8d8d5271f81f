"""Examples that cannot rot: every code block marked ``<!-- runnable; expect: REGEX; ... -->`` in the README and
docs/ runs against a served gateway (``config.example.yaml``, the real SmolLM2), in the order written: Python
blocks in one namespace per file (a later block may use an earlier one's ``client``), bash blocks through bash
with the virtual environment's ``tandem`` on PATH. Each must succeed and print something each ``expect`` regex
finds (multi-line). ``127.0.0.1:8000`` in a block is the test gateway's address."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway.support import ROOT, GatewayProcess

pytestmark = pytest.mark.slow
MARK = re.compile(r"^<!-- runnable(?P<rest>.*?)-->\n```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.M | re.S)
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def runnable_blocks(path: Path) -> list[tuple[int, str, str, list[str]]]:
    """(line, language, code, expected regexes) of each runnable block of ``path``."""
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 1, m["lang"], m["code"],
             [e.split("expect:", 1)[1].strip() for e in m["rest"].split(";") if "expect:" in e])
            for m in MARK.finditer(text)]


def test_runnable_blocks_are_found():
    counts = {str(f.relative_to(ROOT)): len(runnable_blocks(f)) for f in FILES if runnable_blocks(f)}
    assert counts.get("README.md", 0) >= 6 and sum(counts.values()) >= 7, counts
    bad = "<!-- runnable -->\n```python\nprint(1)\n```\n"      # the parser takes a block without expectations
    assert MARK.search(bad) and not MARK.search("```python\nprint(1)\n```\n")


@pytest.fixture()
def gateway():
    """A fresh gateway per file: one file's operator story (weights moved, a rollout started) is not the next's."""
    g = GatewayProcess(ROOT / "config.example.yaml", env={"TANDEM_ADMIN_TOKEN": "dev-token"}).start(timeout=300)
    yield g
    g.stop()


def _run(lang: str, code: str, namespace: dict, cwd: Path) -> str:
    """Run one block; a bash block after the earlier blocks' ``export`` lines (one shell session, as a reader's)."""
    if lang == "python":
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<block>", "exec"), namespace)   # noqa: S102 -- the docs' own examples
        return out.getvalue()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    exports = namespace.setdefault("__exports__", [])
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join([*exports, code])], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    exports += [line for line in code.splitlines() if line.startswith("export ")]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("path", [f for f in FILES if runnable_blocks(f)], ids=lambda f: str(f.relative_to(ROOT)))
def test_runnable_blocks_run_and_print_what_they_promise(path, gateway, tmp_path):
    address = gateway.url.removeprefix("http://")
    namespace: dict = {"__name__": "__docs__"}
    for line, lang, code, expected in runnable_blocks(path):
        out = _run(lang, code.replace("127.0.0.1:8000", address), namespace, tmp_path)
        for regex in expected:
            assert re.search(regex, out, re.M), f"{path.name}:{line}: no match for {regex!r} in:\n{out[-3000:]}"
