"""An idle CPU cgroup for the grammar compile threads and check workers
(Linux, where this process may write its own cgroup).

Why (issue #34, measured): ``SCHED_IDLE`` ranks a thread below the others of
its own scheduling group only. With ``kernel.sched_autogroup_enabled = 1``
(the default of most distributions' kernels) every session is a group, and
``tandem engine serve`` started from a shell or a service is a session of its
own: its compile thread, idle among the engine's threads, made the engine's
group runnable on a core whenever the step's OpenMP worker slept, and that
group then took its full share against every other session's tasks. On a
2-core AVX2 host a client's stream reader (another session) waited up to
146 ms for a CPU while the compile ran, and the largest gap it read was
7.7-14x its p99 without the schema (3 runs), against 2.0-2.7x with
autogroup switched off (3 runs interleaved); with the compile thread and
check workers in a cgroup with ``cpu.idle = 1`` (this module) beside the
sessions' groups, 5.2x as read and 1.4-1.8x less the reader's own CPU wait.

A cgroup's ``cpu.idle`` (Linux 5.15+, cgroup v1 and v2) makes the whole
group ``SCHED_IDLE`` against its siblings, which is what a compile needs.
``join_idle_cgroup`` moves the calling thread into ``tandem-idle-<pid>``,
a child of this process's CPU cgroup (made on first use, with
``cpu.idle = 1``): on cgroup v1 by writing its thread id to ``tasks``; on
cgroup v2 the child is a threaded cgroup (``cgroup.type``), the parent's
``cgroup.subtree_control`` gets ``+cpu``, and the thread id goes to
``cgroup.threads``. Where any step is refused (no write access: an
unprivileged user, a read-only ``/sys/fs/cgroup`` in a container; or a
kernel before 5.15), the thread stays where it is, in ``SCHED_IDLE`` within
its process's group, and the reason is returned. A process started by a
thread in an idle cgroup is born in it and stays there. Children left by
processes that are gone are removed when the next one is made.

Source: Linux ``Documentation/admin-guide/cgroup-v2.rst`` (``cpu.idle``,
threaded cgroups) and ``Documentation/scheduler/sched-design-CFS.rst``
(autogroup); the ``cpu.idle`` patch (Josh Don, 2021) for its use: "a
cgroup of SCHED_IDLE entities".
"""

from __future__ import annotations

import os
import re
import threading

PREFIX = "tandem-idle-"
_CHILD = re.compile(re.escape(PREFIX) + r"(\d+)")   # a process's idle child: the prefix and its pid


def cpu_cgroup(proc_cgroup: str, mountinfo: str) -> tuple[str, int] | None:
    """(directory, cgroup version) of the CPU cgroup of a process from its
    ``/proc/<pid>/cgroup`` and ``/proc/<pid>/mountinfo`` texts: the v1
    hierarchy with the ``cpu`` controller where one is mounted, else the v2
    one; None when neither is mounted."""
    mounts = {}   # version -> (mount point, root of the mount)
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        _, _, after = line.partition(" - ")
        fstype, _, options = (after.split() + ["", "", ""])[:3]
        if fstype == "cgroup" and "cpu" in options.split(","):
            mounts.setdefault(1, (fields[4], fields[3]))
        elif fstype == "cgroup2":
            mounts.setdefault(2, (fields[4], fields[3]))
    paths = {}
    for line in proc_cgroup.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            paths[2] = path
        elif "cpu" in controllers.split(","):
            paths[1] = path
    for version in (1, 2):
        if version in mounts and version in paths:
            point, root = mounts[version]
            path = paths[version]
            rel = path[len(root):] if root != "/" and path.startswith(root) else path
            return os.path.join(point, rel.lstrip("/")), version
    return None


def join_idle_cgroup(proc_dir: str = "/proc") -> str | None:
    """Move the calling thread into this process's idle cgroup (see the
    module doc), made on first use. Returns None when the thread is in it,
    else why it is not (the thread is left where it was)."""
    try:
        found = cpu_cgroup(_read(f"{proc_dir}/self/cgroup"), _read(f"{proc_dir}/self/mountinfo"))
    except OSError as exc:
        return f"cgroups not readable: {exc}"
    if found is None:
        return "no CPU cgroup mounted"
    parent, version = found
    if _CHILD.fullmatch(os.path.basename(parent.rstrip("/"))):
        return None   # in one already: a worker started by a thread in its process's idle cgroup is born there
    if version == 2 and "cpu" not in _read_or_empty(os.path.join(parent, "cgroup.controllers")).split():
        return f"the cpu controller is not available in {parent}"
    child = os.path.join(parent, f"{PREFIX}{os.getpid()}")
    made = False
    try:
        if not os.path.isdir(child):
            _remove_stale(parent, proc_dir)
            os.makedirs(child, exist_ok=True)
            made = True
            if version == 2:
                _write(os.path.join(child, "cgroup.type"), "threaded")
                if "cpu" not in _read_or_empty(os.path.join(parent, "cgroup.subtree_control")).split():
                    _write(os.path.join(parent, "cgroup.subtree_control"), "+cpu")
            _write(os.path.join(child, "cpu.idle"), "1")
        _write(os.path.join(child, "tasks" if version == 1 else "cgroup.threads"), str(threading.get_native_id()))
    except OSError as exc:
        if made:   # half made: removed, so that the parent is left as it was (v2: a threaded child changes its type)
            _rmdir_tree(child)
        return f"cannot use {child}: {exc.strerror or exc}"
    return None


def _remove_stale(parent: str, proc_dir: str) -> None:
    """Remove the idle children of processes that are gone (empty: rmdir
    refuses a cgroup that still holds a thread)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        m = _CHILD.fullmatch(name)
        if m and not os.path.exists(f"{proc_dir}/{m.group(1)}"):
            _rmdir_tree(os.path.join(parent, name))


def _rmdir_tree(path: str) -> None:
    """rmdir ``path`` after its own idle children (an empty cgroup's files go with it; one holding a thread stays)."""
    try:
        for name in os.listdir(path):
            if name.startswith(PREFIX) and os.path.isdir(os.path.join(path, name)):
                _rmdir_tree(os.path.join(path, name))
        os.rmdir(path)
    except OSError:
        pass


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _read_or_empty(path: str) -> str:
    try:
        return _read(path)
    except OSError:
        return ""


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
