"""The engine package stands alone and importing it does nothing (issue #32): no module under ``engine/``
imports ``loadtests``, ``gateway`` or ``policies`` (the benchmarks register their own ``tandem bench``), and
importing every engine module sets no environment variable (OpenMP's wait policy included) and leaves torch's
threads as they were: whoever starts an engine core sets its threading policy.

The rules both halves apply live below both (issue 48): ``engine/protocol/`` imports only the standard library
and itself, and the gateway reads them there; the local backend runs the engine's OpenAI layer without HTTP
(``engine/serving/``); nothing in the gateway imports the engine's HTTP package ``engine/entrypoints/``."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = {"loadtests", "gateway", "policies"}


def imported_modules(tree: ast.AST) -> list[str]:
    """Absolute module names ``tree`` imports: import statements and ``importlib.import_module("...")`` calls."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            names.append(str(node.args[0].value))
    return names


def test_no_engine_module_imports_the_packages_above_it():
    files = sorted((ROOT / "engine").rglob("*.py"))
    assert len(files) > 30
    upward = [f"{f.relative_to(ROOT)}: {name}" for f in files
              for name in imported_modules(ast.parse(f.read_text(), str(f))) if name.split(".")[0] in OUTSIDE]
    assert upward == []


def imports_of(package: str) -> dict[str, list[str]]:
    """The absolute modules each ``.py`` file under ``package`` (a folder of ROOT) imports, by relative path."""
    return {str(f.relative_to(ROOT)): imported_modules(ast.parse(f.read_text(), str(f)))
            for f in sorted((ROOT / package).rglob("*.py"))}


def test_the_shared_rules_import_only_the_standard_library():
    found = imports_of("engine/protocol")
    assert {"engine/protocol/param_ranges.py", "engine/protocol/request_ids.py", "engine/protocol/errors.py",
            "engine/protocol/heap.py"} <= set(found)
    foreign = [f"{f}: {name}" for f, names in found.items() for name in names
               if name.split(".")[0] not in sys.stdlib_module_names and not name.startswith("engine.protocol")]
    assert foreign == []


def test_the_gateway_imports_nothing_from_the_engines_http_package():
    """The gateway reads the shared rules from ``engine/protocol/`` and its local backend runs the engine's OpenAI
    layer without HTTP (``engine/serving/``: typed chunks, no JSON in between); ``engine/entrypoints/`` is
    ``tandem engine serve`` alone (the ``tandem`` command's dispatcher names its CLI module as a string)."""
    found = imports_of("gateway")
    assert len(found) > 50
    reaching = {f: sorted({n for n in names if n == "engine.entrypoints" or n.startswith("engine.entrypoints.")})
                for f, names in found.items()}
    assert {f: names for f, names in reaching.items() if names} == {}
    shared = {n for names in found.values() for n in names if n.startswith("engine.protocol")}
    assert shared >= {"engine.protocol.param_ranges", "engine.protocol.request_ids", "engine.protocol.errors",
                      "engine.protocol.heap"}
    local = found["gateway/backends/local.py"]
    assert {"engine.serving.chat", "engine.serving.completion"} <= set(local)
    assert "engine.serving.chunks" not in local   # the typed chunks become events, never SSE bytes, in process


def test_the_walk_sees_each_kind_of_import():
    tree = ast.parse("import loadtests.bench\nfrom gateway import cli\n"
                     "def f():\n    importlib.import_module('policies.slo')\n")
    assert imported_modules(tree) == ["loadtests.bench", "gateway", "policies.slo"]


IMPORT_ALL = """
import importlib, json, os, pkgutil, sys
before = dict(os.environ)
import torch
threads = torch.get_num_threads()
import engine
modules = [m.name for m in pkgutil.walk_packages(engine.__path__, "engine.")]
for name in modules:
    importlib.import_module(name)
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print(json.dumps({"modules": len(modules), "changed": changed, "threads": [threads, torch.get_num_threads()],
                  "kernels": "kernels" in sys.modules}))
"""


def test_importing_every_engine_module_sets_no_environment_and_no_threads():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_")) and k != "TANDEM_OMP_WAIT_CHOSEN"}
    env["TANDEM_CPU_WAIT_POLICY"] = "spin"      # a choice an import would act on
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["modules"] > 30 and report["kernels"]       # the walk reached the layers and their kernels
    assert report["changed"] == []
    assert report["threads"][0] == report["threads"][1]


def test_the_offline_engine_loads_torch_only_when_it_starts_a_core():
    """``LLM``/``LLMEngine`` choose the core's OpenMP policy when constructed: torch (libgomp) must not be loaded
    by importing them, or the choice would come too late."""
    code = "import sys; from engine.llm import LLM; from engine.llm_engine import LLMEngine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False"


def test_vllms_top_level_names_import_from_engine_and_importing_it_loads_nothing():
    """A vLLM user's first line, ``from engine import LLM, SamplingParams`` (``from vllm import ...``), was an
    ImportError; the names load on first use, so ``import engine`` still loads nothing (torch included)."""
    code = ("import sys, engine; bare = 'torch' in sys.modules or 'engine.llm' in sys.modules\n"
            "from engine import LLM, SamplingParams, RequestOutput, PoolingParams, EngineArgs\n"
            "from engine.llm import LLM as L; from engine.sampling_params import SamplingParams as S\n"
            "print(bare, LLM is L and SamplingParams is S, sorted(engine.__all__) == engine.__all__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "True", "True"]
    import engine

    for name in engine.__all__:
        assert getattr(engine, name).__name__ == name
