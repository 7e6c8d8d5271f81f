"""The wheel a user installs runs from its install alone (a packaging trial: the wheel lacked kernels/csrc's
headers, so `tandem --help` failed on import; the load tests' prompts lived under tests/, which no wheel ships,
and the example config was in no package)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "gateway", "kernels", "policies", "loadtests")


def _run(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_wheel_holds_every_package_file_and_runs_from_its_install(tmp_path):
    tracked = _run(["git", "ls-files", *PACKAGES], ROOT).stdout.split()
    assert len(tracked) > 300 and "kernels/csrc/kernels.h" in tracked
    src = tmp_path / "src"   # a copy of the tracked tree: the build writes build/ and *.egg-info next to it
    for name in tracked + ["pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "config.example.yaml"]:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, src / name, follow_symlinks=False)
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                  "-w", str(tmp_path / "dist"), str(src)], tmp_path)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("tandem-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        example = z.read("gateway/config/example.yaml")
    # every file of the packages (C headers, prompt data, console, dashboards...), nothing of tests/
    assert sorted(set(tracked) - names) == []
    assert not any(n.startswith("tests/") for n in names)
    assert example == (ROOT / "config.example.yaml").read_bytes()   # the link's text, not the link
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)

    site = tmp_path / "site"
    installed = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                      str(site), str(wheel)], tmp_path)
    assert installed.returncode == 0, installed.stderr
    run_dir = tmp_path / "elsewhere"   # no source tree and no config file here
    run_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}   # before the editable install's finder
    helped = _run([sys.executable, "-m", "gateway.cli", "--help"], run_dir, env)
    assert helped.returncode == 0, helped.stderr
    cost = _run([sys.executable, "-m", "gateway.cli", "cost", "estimate", "--tokens-per-month", "1e9", "--json"],
                run_dir, env)   # its default config: the packaged example
    assert cost.returncode == 0, cost.stderr
    assert json.loads(cost.stdout)
    probe = ("import kernels.cpu_build as b, loadtests.workloads as w, gateway.config as c\n"
             "assert b.load_library() is not None\n"
             "paths = [b.CSRC, w.MT_BENCH_PATH, w.EDIT_TEXTS_PATH, w.JSON_SCHEMAS_PATH, c.EXAMPLE_CONFIG]\n"
             "assert all(os.path.exists(p) and str(p).startswith(sys.argv[1]) for p in paths), paths\n")
    loaded = _run([sys.executable, "-c", "import os, sys\n" + probe, str(site)], run_dir, env)
    assert loaded.returncode == 0, loaded.stderr
