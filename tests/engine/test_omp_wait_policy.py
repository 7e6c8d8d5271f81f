"""OpenMP's wait policy, chosen by whoever starts an engine core before torch loads libgomp
(``engine.worker.device.choose_omp_wait_policy``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.worker.device import SPIN_COUNT, choose_omp_binding, choose_omp_wait_policy, count_others_running

ROOT = Path(__file__).resolve().parents[2]


def test_auto_spins_only_on_a_machine_that_is_the_engines():
    env: dict = {}
    assert choose_omp_wait_policy(env, others_running=0, cores=2) == "spin"
    assert env["GOMP_SPINCOUNT"] == str(SPIN_COUNT) and env["OMP_WAIT_POLICY"] == "PASSIVE"
    env = {}
    assert choose_omp_wait_policy(env, others_running=1, cores=2) == "passive"
    assert env["GOMP_SPINCOUNT"] == "0"
    assert choose_omp_wait_policy(env, others_running=0, cores=2) == "passive"   # a child inherits its parent's choice


def test_explicit_choices_and_the_users_openmp_variables_win():
    for policy, count in (("spin", str(SPIN_COUNT)), ("passive", "0")):
        env = {"TANDEM_CPU_WAIT_POLICY": policy}
        assert choose_omp_wait_policy(env, others_running=9 if policy == "spin" else 0, cores=2) == policy
        assert env["GOMP_SPINCOUNT"] == count
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert choose_omp_wait_policy(env, others_running=0, cores=2) == "user" and env == {"OMP_WAIT_POLICY": "ACTIVE"}
    with pytest.raises(ValueError, match="TANDEM_CPU_WAIT_POLICY"):
        choose_omp_wait_policy({"TANDEM_CPU_WAIT_POLICY": "fast"})


def test_a_busy_process_counts_as_running():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert count_others_running() >= 1
    finally:
        busy.kill()
        busy.wait()


START_CORE = """
import asyncio, sys
from engine.config import EngineArgs

def offline(model):
    from engine.llm_engine import LLMEngine
    LLMEngine(EngineArgs(model=model, dtype="float32", kv_cache_memory="4MiB"))

async def process(model):
    from engine.async_engine import AsyncEngine
    eng = AsyncEngine(EngineArgs(model=model, dtype="float32", kv_cache_memory="4MiB", engine_core_process=True))
    await eng.start()
    await eng.shutdown(drain=False)

if __name__ == "__main__":
    how, model = sys.argv[1:]
    offline(model) if how == "offline" else asyncio.run(process(model))
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from tests.tiny_models import save_byte_level_llama

    return save_byte_level_llama(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("how", ["offline", "process"])
def test_libgomp_takes_the_choice_of_whoever_starts_the_core(how, tiny_model, tmp_path):
    """What libgomp itself reports (``OMP_DISPLAY_ENV``, on stderr) in the process that runs the model: the
    offline engine (``LLMEngine``) and the core process's entry choose before torch loads; importing ``engine``
    chooses nothing. "passive" (spin count 0) because "spin" reads as libgomp's own default (300000)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                                           "TANDEM_OMP_WAIT_CHOSEN")}
    env.update(TANDEM_CPU_WAIT_POLICY="passive", OMP_DISPLAY_ENV="verbose")
    script = tmp_path / "start_core.py"
    script.write_text(START_CORE)
    out = subprocess.run([sys.executable, str(script), how, tiny_model], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "GOMP_SPINCOUNT = '0'" in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]


def test_binding_places_one_thread_per_cpu_and_the_users_choice_wins():
    env: dict = {}
    assert choose_omp_binding(env, cpus=[3, 1]) == "bind"
    assert env == {"OMP_PROC_BIND": "true", "OMP_PLACES": "{1},{3}", "TANDEM_CPUS": "1,3"}
    for user in ({"OMP_PLACES": "cores"}, {"OMP_PROC_BIND": "false"}, {"GOMP_CPU_AFFINITY": "0-3"}):
        env = dict(user)
        assert choose_omp_binding(env, cpus=[0, 1]) == "user" and env == user
    assert choose_omp_binding({}, cpus=[0]) == "nobind"
    env = {"TANDEM_CPU_OMP_THREADS_BIND": "nobind"}
    assert choose_omp_binding(env, cpus=[0, 1]) == "nobind" and "OMP_PLACES" not in env


AFFINITIES = """
import asyncio, glob, os, sys
from engine.config import EngineArgs

async def main(model):
    from engine.async_engine import AsyncEngine
    eng = AsyncEngine(EngineArgs(model=model, dtype="float32", kv_cache_memory="4MiB", engine_core_process=True))
    await eng.start()
    from engine.sampling_params import SamplingParams
    async for _ in eng.generate("ab", SamplingParams(max_tokens=2), request_id="r"):
        pass
    core = eng.core_pid
    for task in sorted(glob.glob(f"/proc/{core}/task/*")):
        cpus = [line.split()[1] for line in open(task + "/status") if line.startswith("Cpus_allowed_list")][0]
        print("TASK", task.rsplit("/", 1)[1] == str(core), cpus)
    await eng.shutdown(drain=False)

if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def core_process_runs(tiny_model, tmp_path_factory):
    """The ``AFFINITIES`` script run with ``TANDEM_CPU_OMP_THREADS_BIND`` auto and nobind (the second also with
    a ``glibc.malloc`` tunable of the user's): {bind: (the core's tasks as (is main thread, CPUs), stderr)}."""
    script = tmp_path_factory.mktemp("core") / "affinities.py"
    script.write_text(AFFINITIES)
    seen = {}
    for bind in ("auto", "nobind"):
        env = {k: v for k, v in os.environ.items()
               if k not in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "TANDEM_CPUS", "GLIBC_TUNABLES",
                            "TANDEM_MALLOC_CHOSEN")}
        env["TANDEM_CPU_OMP_THREADS_BIND"] = bind
        if bind == "nobind":
            env["GLIBC_TUNABLES"] = "glibc.malloc.tcache_count=7"   # glibc's default value: changes nothing
        out = subprocess.run([sys.executable, str(script), tiny_model], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        tasks = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("TASK ")]
        seen[bind] = ([(main == "True", _cpu_list(c)) for main, c in tasks], out.stderr)
    return seen


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="binding needs two CPUs")
def test_the_core_process_binds_its_model_threads_and_no_other(core_process_runs):
    """The core process's initial thread (the model's) is bound to its first CPU and libgomp's worker to the
    next, whatever the wait policy; the threads that run no model (the command reader, the grammar pool) keep
    every CPU. With ``TANDEM_CPU_OMP_THREADS_BIND=nobind`` nothing is bound."""
    cpus = sorted(os.sched_getaffinity(0))
    seen = {bind: tasks for bind, (tasks, _) in core_process_runs.items()}
    every = set(cpus)
    assert (True, {cpus[0]}) in seen["auto"], seen
    assert (False, {cpus[1]}) in seen["auto"], seen             # libgomp's worker
    assert any(c == every for main, c in seen["auto"] if not main), seen   # the reader, the grammar threads
    assert all(c == every for _, c in seen["nobind"]), seen


def test_the_core_process_tunes_malloc_unless_the_user_did(core_process_runs):
    """The core process raises malloc's thresholds before it loads the model (``tune_malloc``) and says so in
    its ``engine ready`` line; a ``glibc.malloc`` tunable the user set is left alone."""
    ready = {bind: [line for line in err.splitlines() if "engine ready" in line]
             for bind, (_, err) in core_process_runs.items()}
    assert len(ready["auto"]) == 1 and "malloc=trim=64MiB,mmap=32MiB" in ready["auto"][0], ready
    assert len(ready["nobind"]) == 1 and "malloc=user" in ready["nobind"][0], ready


def _cpu_list(text: str) -> set[int]:
    """CPUs of a ``Cpus_allowed_list`` ("0-2,5")."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out
