"""The engine core in its own process (``engine_core_process: true``): it
dies with its parent, its crash fails the in-flight requests with one error
and turns the server to 503, and its start-up errors reach the parent.

Real ``tandem engine serve`` subprocesses with the tiny random Llama of
``tests/tiny_models.py`` (loads in a second), the official ``openai`` client.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import EngineArgs
from engine.sampling_params import SamplingParams
from loadtests.procs import Server, free_port, tandem_cmd
from tests.tiny_models import save_byte_level_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny"), printable_only=True)


def serve(model: str, tmp_path: Path, *extra: str) -> Server:
    port = free_port()
    cmd = [*tandem_cmd("engine", "serve"), "--model", model, "--port", str(port),
           "--kv-cache-memory", "64MiB", "--served-model-name", "tiny", "--uvicorn-log-level", "warning", *extra]
    return Server(cmd, f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}", log_dir=tmp_path,
                  name="engine").wait_ready(120)


def descendants(pid: int) -> list[int]:
    """Live (non-zombie) descendants of ``pid``."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parent_of[int(entry)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [c for c, p in parent_of.items() if p == parent]
        out += kids
        frontier += kids
    return out


def core_pid(server_pid: int) -> int:
    """The engine core process among the server's children (the spawn child
    that is not multiprocessing's resource tracker)."""
    for pid in descendants(server_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError(f"no engine core process under {server_pid}")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_core_process_dies_with_its_parent(tiny_model, tmp_path):
    srv = serve(tiny_model, tmp_path)
    try:
        children = descendants(srv.pid)
        assert core_pid(srv.pid) in children
    finally:
        srv.kill()  # SIGKILL: no shutdown code runs in the parent
    deadline = time.monotonic() + 30
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if alive(p)], "orphaned engine processes"


def test_killed_core_fails_in_flight_requests_and_the_server_says_503(tiny_model, tmp_path):
    srv = serve(tiny_model, tmp_path)
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        started, errors = threading.Event(), []

        def stream(i: int) -> None:
            try:
                for _ in client.completions.create(model="tiny", prompt=f"abc{i}", max_tokens=3000, stream=True,
                                                   extra_body={"ignore_eos": True}):
                    started.set()
                errors.append(None)
            except openai.APIError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        assert started.wait(60)
        os.kill(core_pid(srv.pid), signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert len(errors) == 3 and all(e is not None for e in errors)  # each stream ended in an error event
        assert all("died" in str(e) for e in errors), errors
        health = httpx.get(srv.base_url + "/health", timeout=10)
        assert health.status_code == 503
        late = httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                          timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_unavailable"
        assert srv.proc.poll() is None  # the front end survives and answers
    finally:
        srv.stop()


def test_bad_model_is_a_clear_startup_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)  # a file the loader rejects in the core process
    with pytest.raises(ValueError) as info:
        asyncio.run(AsyncEngine(EngineArgs(model=str(bad), engine_core_process=True)).start())
    assert "broken.gguf" in str(info.value) or "GGUF" in str(info.value) or "gguf" in str(info.value)
    port = free_port()
    cmd = [*tandem_cmd("engine", "serve"), "--model", str(bad), "--port", str(port)]
    proc = Server(cmd, f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}", log_dir=tmp_path,
                  name="bad").proc
    assert proc.wait(120) == 1
    log = (tmp_path / "bad.log").read_text()
    assert "ValueError" in log or "failed to load" in log
    assert "Traceback" not in log.split("engine core")[0]


async def test_core_process_streams_and_aborts(tiny_model):
    eng = AsyncEngine(EngineArgs(model=tiny_model, kv_cache_memory="64MiB", engine_core_process=True))
    await eng.start()
    try:
        assert eng.core_pid is not None and eng.core_pid != os.getpid()
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        outs = [o async for o in eng.generate("hello", params, "a")]
        assert outs[-1].finished and sum(len(c.token_ids) for o in outs for c in o.outputs) == 5
        stream = eng.generate("hello", SamplingParams(max_tokens=3000, ignore_eos=True), "b")
        await stream.__anext__()
        await stream.aclose()  # the consumer walks away: aborted, blocks freed
        deadline = time.monotonic() + 30
        while eng.get_stats().kv_cache_usage > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert eng.get_stats().kv_cache_usage == 0 and eng.get_stats().num_running == 0
    finally:
        await eng.shutdown(drain=False)
    assert not eng.is_alive
    with pytest.raises(EngineDeadError):
        await eng.generate("x", SamplingParams(max_tokens=1), "c").__anext__()


FRONT_END_SCRIPT = """
import asyncio, sys
from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.entrypoints.server import build_app

async def main():
    eng = AsyncEngine(EngineArgs(model=sys.argv[1], kv_cache_memory="64MiB"))
    build_app(eng)
    await eng.start()
    print("torch" in sys.modules)
    await eng.shutdown(drain=False)

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_front_end_runs_without_torch(tiny_model, tmp_path):
    """The serving process keeps HTTP, tokenization and output processing: it never loads torch (RSS)."""
    script = tmp_path / "front_end.py"
    script.write_text(FRONT_END_SCRIPT)
    out = subprocess.run([sys.executable, str(script), tiny_model], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_a_large_command_never_blocks_its_sender_and_commands_keep_their_order():
    """Issue #34: a 400 KB schema crosses the pipe twice (compile, then its request); written on the event loop,
    each write waited for the core's reader (which needs the core's GIL per 64 KB) and stalled every stream's
    SSE. The front end's writer thread takes that wait: ``put`` returns while nobody reads yet."""
    import multiprocessing

    from engine.core.core_client import PipeWriter

    ours, core_end = multiprocessing.Pipe()
    writer = PipeWriter(ours)
    big = b"s" * (4 << 20)  # far over a pipe's buffer: its write waits for the reader
    queued = threading.Event()

    def send() -> None:
        writer.put(big)
        writer.put(b"after")
        queued.set()

    threading.Thread(target=send, daemon=True).start()
    assert queued.wait(60)  # deadlock guard only: nothing reads the core's end until both are queued
    assert core_end.recv_bytes() == big and core_end.recv_bytes() == b"after"
    writer.close()


def read_chars(pid: int) -> int:
    """Bytes ``pid`` has read so far, from pipes and files (``/proc/<pid>/io`` rchar)."""
    line = next(x for x in Path(f"/proc/{pid}/io").read_text().splitlines() if x.startswith("rchar:"))
    return int(line.split()[1])


def test_a_schema_crosses_to_the_engine_core_once(tiny_model, tmp_path):
    """Issue #34: a 400 KB schema crossed the core's pipe in its ``CompileGrammar`` and again in its request's
    ``AddRequest``, each read 64 KB at a time by a core thread that takes the engine step's GIL. The request
    now carries the grammar's digest: the core reads the schema once (counted in bytes read, twice: a repeat is
    answered from the cache and reads it once again, never twice)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "description": "d" * 300_000}},
              "required": ["a"]}
    size = len(json.dumps(schema))
    srv = serve(tiny_model, tmp_path)
    try:
        core = core_pid(srv.pid)
        warm = httpx.post(srv.base_url + "/v1/completions", timeout=120, json={  # xgrammar's import reads files
            "model": "tiny", "prompt": "x", "max_tokens": 2, "structured_outputs": {"json": {"type": "integer"}}})
        assert warm.status_code == 200, warm.text
        for attempt in ("compiled", "cached"):
            before = read_chars(core)
            r = httpx.post(srv.base_url + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": "x", "max_tokens": 4, "structured_outputs": {"json": schema}})
            assert r.status_code == 200, r.text
            read = read_chars(core) - before
            assert size <= read < 1.5 * size, (attempt, read, size)
    finally:
        srv.stop()


async def test_a_start_cancelled_while_the_model_loads_leaves_no_core_process(tiny_model):
    """A server stopped while its engine loads cancels ``start``: the core (which ignores SIGINT and SIGTERM, its
    parent draining) was left running and the parent's exit waited for it forever (a new user's Ctrl-C during
    ``make serve``'s load). Now it is killed while loading, or stopped if it had loaded."""
    multiprocessing.active_children()   # reaps what earlier tests left
    before = {p.pid for p in multiprocessing.active_children()}
    eng = AsyncEngine(EngineArgs(model=tiny_model, kv_cache_memory="64MiB", engine_core_process=True))
    task = asyncio.ensure_future(eng.start())
    deadline = time.monotonic() + 60
    while not [p for p in multiprocessing.active_children() if p.pid not in before]:   # spawned: still loading
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 60     # a hang bound, not a timing claim
    while [p for p in multiprocessing.active_children() if p.pid not in before]:
        assert time.monotonic() < deadline, "the abandoned engine core is still running"
        await asyncio.sleep(0.05)
    assert not eng.ready
