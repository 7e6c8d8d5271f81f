"""The idle cgroup of grammar compiles (engine/worker/idle_cgroup.py): found from a process's cgroup and mount
tables, made with ``cpu.idle = 1``, joined by a thread; and the compile threads and check workers join it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from engine.worker import idle_cgroup
from engine.worker.idle_cgroup import PREFIX, cpu_cgroup, join_idle_cgroup

V1_MOUNTS = """\
30 25 0:26 / /sys/fs/cgroup/cpu rw,relatime shared:9 - cgroup cgroup rw,cpu
31 25 0:27 / /sys/fs/cgroup/cpuacct rw,relatime shared:10 - cgroup cgroup rw,cpuacct
40 25 0:35 / /sys/fs/cgroup/unified rw,relatime shared:19 - cgroup2 cgroup2 rw
"""
V2_MOUNTS = "35 24 0:30 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"


def test_the_cpu_cgroup_is_the_v1_cpu_hierarchy_where_one_is_mounted():
    assert cpu_cgroup("2:cpuacct:/\n1:cpu:/svc\n0::/\n", V1_MOUNTS) == ("/sys/fs/cgroup/cpu/svc", 1)
    assert cpu_cgroup("4:cpu,cpuacct:/a/b\n0::/\n",
                      V1_MOUNTS.replace("rw,cpu\n", "rw,cpu,cpuacct\n")) == ("/sys/fs/cgroup/cpu/a/b", 1)


def test_the_cpu_cgroup_is_the_v2_one_on_a_unified_host():
    assert cpu_cgroup("0::/system.slice/tandem.service\n", V2_MOUNTS) == (
        "/sys/fs/cgroup/system.slice/tandem.service", 2)
    # a container's cgroup namespace: the mount's root is the container's cgroup; the process's path is below it
    mounts = V2_MOUNTS.replace(" / /sys/fs/cgroup", " /kubepods/pod1 /sys/fs/cgroup")
    assert cpu_cgroup("0::/kubepods/pod1/app\n", mounts) == ("/sys/fs/cgroup/app", 2)
    assert cpu_cgroup("0::/\n", "") is None


def _fake_proc(tmp_path, cgroup: str, mounts: str):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(mounts)
    return proc


def test_v2_makes_a_threaded_child_with_cpu_idle_and_moves_the_thread_there(tmp_path):
    """cgroup v2 (no such hierarchy on the test hosts, which bind cpu to v1): the files written are the threaded
    child's type, the parent's subtree control, the child's cpu.idle and the thread id; a child left by a
    process that is gone is removed."""
    root = tmp_path / "cg"
    parent = root / "svc"
    parent.mkdir(parents=True)
    (parent / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (parent / "cgroup.subtree_control").write_text("")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (parent / f"{PREFIX}{dead}" / f"{PREFIX}{dead}1").mkdir(parents=True)   # nested (a worker of that process)
    proc = _fake_proc(tmp_path, "0::/svc\n", f"35 24 0:30 / {root} rw - cgroup2 cgroup2 rw\n")
    tid = []
    t = threading.Thread(target=lambda: tid.append((join_idle_cgroup(str(proc)), threading.get_native_id())))
    t.start()
    t.join()
    why, native = tid[0]
    child = parent / f"{PREFIX}{os.getpid()}"
    assert why is None
    assert (child / "cgroup.type").read_text() == "threaded"
    assert (parent / "cgroup.subtree_control").read_text() == "+cpu"
    assert (child / "cpu.idle").read_text() == "1"
    assert (child / "cgroup.threads").read_text() == str(native)
    assert not (parent / f"{PREFIX}{dead}").exists()


def test_v2_without_the_cpu_controller_leaves_the_thread_and_says_why(tmp_path):
    parent = tmp_path / "cg" / "svc"
    parent.mkdir(parents=True)
    (parent / "cgroup.controllers").write_text("memory pids\n")
    proc = _fake_proc(tmp_path, "0::/svc\n", f"35 24 0:30 / {tmp_path / 'cg'} rw - cgroup2 cgroup2 rw\n")
    why = join_idle_cgroup(str(proc))
    assert "cpu controller is not available" in why
    assert os.listdir(parent) == ["cgroup.controllers"]


def test_a_refused_step_leaves_no_half_made_cgroup(tmp_path, monkeypatch):
    """v2 where the child cannot be made threaded (refused by the hierarchy, e.g. a parent with domain children):
    the thread stays, and the child made on the way is removed (on cgroupfs its files go with it)."""
    parent = tmp_path / "cg" / "svc"
    parent.mkdir(parents=True)
    (parent / "cgroup.controllers").write_text("cpu\n")
    (parent / "cgroup.subtree_control").write_text("cpu\n")
    blocked = parent / f"{PREFIX}{os.getpid()}" / "cgroup.type"
    proc = _fake_proc(tmp_path, "0::/svc\n", f"35 24 0:30 / {tmp_path / 'cg'} rw - cgroup2 cgroup2 rw\n")
    real_write = idle_cgroup._write

    def write(path: str, text: str) -> None:
        if path == str(blocked):
            raise PermissionError(13, "Permission denied")
        real_write(path, text)
    monkeypatch.setattr(idle_cgroup, "_write", write)
    why = join_idle_cgroup(str(proc))
    assert why.startswith("cannot use") and "Permission denied" in why
    assert not (parent / f"{PREFIX}{os.getpid()}").exists()


def _thread_cgroup(pid: int, tid: int) -> str:
    """The cpu line's path of ``/proc/<pid>/task/<tid>/cgroup`` (v1), or the v2 line's."""
    lines = open(f"/proc/{pid}/task/{tid}/cgroup").read().splitlines()
    cpu = [ln for ln in lines if "cpu" in ln.split(":")[1].split(",")] or [ln for ln in lines if ln.startswith("0::")]
    return cpu[0].split(":", 2)[2]


def _real_idle_cgroup_or_skip() -> tuple[str, int]:
    found = cpu_cgroup(open("/proc/self/cgroup").read(), open("/proc/self/mountinfo").read())
    if found is None or not os.access(found[0], os.W_OK):
        pytest.skip(f"this host's CPU cgroup is not writable here ({found}): the thread stays in its group")
    if found[1] == 1 and not os.path.exists(os.path.join(found[0], "cpu.idle")):
        pytest.skip("this kernel has no cpu.idle (before 5.15): the thread stays in its group")
    return found


def test_a_thread_joins_a_real_idle_cgroup_and_the_others_stay(tmp_path):
    """On this host's own cgroup tree (root on the test hosts): the joining thread is in ``tandem-idle-<pid>``
    with ``cpu.idle`` 1; the process's other threads are not moved."""
    parent, version = _real_idle_cgroup_or_skip()
    before = _thread_cgroup(os.getpid(), threading.get_native_id())
    got = []

    def join() -> None:
        got.append((join_idle_cgroup(), threading.get_native_id(), _thread_cgroup(os.getpid(), threading.get_native_id())))
    t = threading.Thread(target=join)
    t.start()
    t.join()
    why, _, inside = got[0]
    assert why is None
    assert inside.rstrip("/").endswith(f"/{PREFIX}{os.getpid()}")
    assert open(os.path.join(parent, f"{PREFIX}{os.getpid()}", "cpu.idle")).read().strip() == "1"
    assert _thread_cgroup(os.getpid(), threading.get_native_id()) == before   # this thread was not moved


def test_compile_threads_and_check_workers_run_in_the_idle_cgroup():
    """The grammar pool's compile thread and its check worker process each join an idle cgroup (issue #34: in
    ``SCHED_IDLE`` alone they took a share against other sessions' tasks under autogroup)."""
    _real_idle_cgroup_or_skip()
    from engine.sampling_params import StructuredOutputsParams
    from engine.worker.grammar_compiler import GrammarCompilePool, GrammarLimits
    from tests.engine.test_grammar_compiler import Answers, _GUARD_S, _pid_in_refusal, probe_check

    seen = []
    pool = GrammarCompilePool(lambda p: (seen.append(_thread_cgroup(os.getpid(), threading.get_native_id())),
                                         (object(), 1))[1], GrammarLimits(workers=2, wait_s=_GUARD_S),
                              validate_fn=probe_check)
    try:
        answers = Answers()
        pool.submit(StructuredOutputsParams(regex="pid"), answers.done("pid"))
        _, error = answers.wait("pid")
        worker = _pid_in_refusal(error)
        # started by a compile thread: born in its process's idle cgroup, and stays there (no nested child)
        assert _thread_cgroup(worker, worker).rstrip("/").endswith(f"/{PREFIX}{os.getpid()}")
        pool.submit(StructuredOutputsParams(regex="ok"), answers.done("ok"))
        _, error = answers.wait("ok")
        assert error is None
        assert seen and seen[0].rstrip("/").endswith(f"/{PREFIX}{os.getpid()}")
    finally:
        pool.shutdown()
