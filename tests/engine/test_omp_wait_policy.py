"""OpenMP's wait policy, chosen by role before torch loads libgomp (``engine.worker.device.choose_omp_wait_policy``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.worker.device import SPIN_COUNT, choose_omp_wait_policy, count_others_running

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


@pytest.mark.parametrize("policy,count", [("spin", SPIN_COUNT), ("passive", 0)])
def test_libgomp_takes_the_choice(policy, count):
    """What libgomp itself reports (``OMP_DISPLAY_ENV``) after ``import engine`` then torch."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                                           "TANDEM_OMP_WAIT_CHOSEN")}
    env.update(TANDEM_CPU_WAIT_POLICY=policy, OMP_DISPLAY_ENV="verbose")
    out = subprocess.run([sys.executable, "-c", "import engine, torch; torch.ones(64, 64) @ torch.ones(64, 64)"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert f"GOMP_SPINCOUNT = '{count}'" in out.stdout + out.stderr, out.stdout + out.stderr
