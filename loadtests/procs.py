"""Server processes for the scenarios: free ports, start-and-wait-ready, stop,
and CPU time read from ``/proc/<pid>/stat`` (Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from engine.executor.ports import free_port  # noqa: F401 -- re-exported for the scenarios and tests

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_set(cpus: str) -> set[int]:
    """CPU numbers of a list such as ``"0"``, ``"1-3"`` or ``"0,2-3"`` (taskset's ``-c`` form)."""
    out: set[int] = set()
    for part in cpus.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when GET ``url`` answers 2xx."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback only)
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def post_json(url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 10.0) -> tuple[int, dict]:
    """POST JSON to ``url``; returns (status, decoded body or {})."""
    import json
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    return _json_call(req, timeout)


def get_json(url: str, headers: dict | None = None, timeout: float = 10.0) -> tuple[int, dict]:
    """GET ``url``; returns (status, decoded JSON body or {})."""
    return _json_call(urllib.request.Request(url, headers=headers or {}), timeout)


def _json_call(req, timeout: float) -> tuple[int, dict]:
    import json
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310
            data = r.read()
            return r.status, (json.loads(data) if data else {})
    except urllib.error.HTTPError as e:
        data = e.read()
        try:
            return e.code, json.loads(data)
        except ValueError:
            return e.code, {"raw": data.decode(errors="replace")}


def exit_on_sigterm() -> None:
    """Make SIGTERM end this program as Ctrl-C does, through its ``finally`` blocks (``Server.stop``), instead of
    at once: a benchmark stopped by ``timeout`` or a scheduler left its ``tandem engine serve`` running (each
    started in its own session, so the signal does not reach it), and the orphan's CPU spoiled the next runs'
    figures (seen on the 2-core host). Call it from a program's main thread, before starting servers."""
    def _exit(signum, frame):  # noqa: ARG001 - the signal module's signature
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


class Server:
    """A child process serving HTTP, with its log file.

    Attributes:
        proc: the ``subprocess.Popen``.
        log_path: combined stdout/stderr.
        base_url: ``http://127.0.0.1:PORT``.

    ``cpus`` (e.g. ``"0"``, ``"1-3"``): the CPUs the process and its threads may run on (``sched_setaffinity``,
    set in the child before it starts the command); None: any.
    """

    def __init__(self, cmd: list[str], ready_url: str, base_url: str, env: dict | None = None,
                 log_dir: str | Path | None = None, name: str = "server", cpus: str | None = None):
        self.cmd = cmd
        self.ready_url = ready_url
        self.base_url = base_url
        self.name = name
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="loadtests-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpu_set(cpus)))
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True, preexec_fn=pin)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 60.0) -> "Server":
        """Poll ``ready_url`` until 2xx.

        Raises:
            RuntimeError: the process exited or ``timeout`` seconds passed
                (the message carries the log's tail).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if http_ok(self.ready_url, timeout=1.0):
                return self
            time.sleep(0.1)
        tail = self.log_tail()   # before stop() closes the log
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s at {self.ready_url}:\n{tail}")

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        data = self.log_path.read_bytes()
        return data[-n:].decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL at once (the failover scenario's crash)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of this process and its live descendants."""
        return cpu_seconds(self.pid)


def upstream_cmd(port: int, name: str = "upstream", *extra: str) -> list[str]:
    """Command line of a :mod:`loadtests.upstream` process."""
    return [sys.executable, "-m", "loadtests.upstream", "--port", str(port), "--name", name, *extra]


def tandem_cmd(*args: str) -> list[str]:
    """Command line of the ``tandem`` CLI run with this interpreter."""
    return [sys.executable, "-m", "gateway.cli", *args]


def _stat_fields(pid: int) -> list[str] | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces: split after the closing parenthesis.
    return data[data.rindex(")") + 2:].split()


def cpu_seconds(pid: int, include_children: bool = True) -> float:
    """utime + stime (fields 14, 15 of ``/proc/<pid>/stat``) of ``pid`` and, when
    asked, of its live descendants, seconds.

    Raises:
        ProcessLookupError: no such process.
    """
    fields = _stat_fields(pid)
    if fields is None:
        raise ProcessLookupError(pid)
    total = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    if include_children:
        for child in descendants(pid):
            f = _stat_fields(child)
            if f is not None:
                total += (int(f[11]) + int(f[12])) / _CLK_TCK
    return total


def tensor_parallel_ranks(server_pid: int) -> list[int]:
    """The pids of the tensor-parallel ranks an engine server (``server_pid``) started on this host: the
    children of its zygote (``engine/executor/zygote.py``; they carry the zygote's command line)."""
    tree = descendants(server_pid)

    def zygote(pid: int) -> bool:
        try:
            return b"engine.executor.zygote" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
    return [pid for pid in tree if zygote(pid) and (f := _stat_fields(pid)) is not None and zygote(int(f[1]))]


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not reaped, is not alive)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids of ``pids`` still alive after up to ``timeout_s`` seconds (polled every 0.1 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def descendants(pid: int) -> list[int]:
    """The pids of ``pid``'s children, their children and so on (zombies included), from ``/proc``."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            f = _stat_fields(int(entry))
            if f is not None:
                parent_of[int(entry)] = int(f[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent_of.items() if pp == p]
        out.extend(kids)
        frontier.extend(kids)
    return out
