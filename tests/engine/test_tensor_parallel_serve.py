"""Tensor parallelism behind real ``tandem engine serve`` processes: two
"hosts" on this machine (``--nnodes 2 --node-rank k`` over loopback) answer
as two ranks in one process do; a rank that dies turns the engine unhealthy
within 5 s; no rank outlives its driver (SIGTERM or SIGKILL, on one host
or two).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from loadtests.procs import Server, free_port, tandem_cmd, tensor_parallel_ranks, wait_gone
from tests.engine.test_core_process import alive, core_pid, descendants
from tests.tiny_models import save_byte_level_llama

pytestmark = pytest.mark.slow
PROMPT = "The tensor-parallel ranks"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny"), printable_only=True)


def _serve(model: str, tmp_path, name: str, *extra: str, ready: bool = True) -> Server:
    port = free_port()
    cmd = [*tandem_cmd("engine", "serve"), "--model", model, "--port", str(port), "--dtype", "float32",
           "--kv-cache-memory", "16MiB", "--served-model-name", "tiny", "--uvicorn-log-level", "warning", *extra]
    server = Server(cmd, f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}", log_dir=tmp_path, name=name)
    return server.wait_ready(300) if ready else server


def _complete(server: Server) -> str:
    r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_two_hosts_answer_as_one_and_end_with_their_driver(tiny_model, tmp_path):
    """Host 1 (no HTTP server) and host 0 meet at a loopback port; the completion equals two ranks in one
    process; SIGKILL of host 0's server ends its core and rank, and host 1's rank leaves too."""
    llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2)
    try:
        want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    finally:
        llm.shutdown()
    master = str(free_port())
    hosts = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", master]
    host1 = _serve(tiny_model, tmp_path, "host1", *hosts, "--node-rank", "1", ready=False)
    host0 = _serve(tiny_model, tmp_path, "host0", *hosts, "--node-rank", "0")
    try:
        assert _complete(host0) == want
        tree = descendants(host0.pid) + [host1.pid] + descendants(host1.pid)
        host0.kill()
        assert wait_gone(tree, 30) == [], host1.log_tail()
        assert host1.proc.wait(5) != 0
    finally:
        host0.stop()
        host1.stop()


def test_a_dead_rank_makes_the_engine_unhealthy_within_5_s(tiny_model, tmp_path):
    """Three ranks on one host: SIGKILL of rank 2 turns /health to 503 within 5 s (the executor's watcher),
    the other rank and the core end with it, and SIGTERM of the server leaves no process."""
    server = _serve(tiny_model, tmp_path, "tp3", "--tensor-parallel-size", "3")
    try:
        assert _complete(server)
        core = core_pid(server.pid)
        forked = [p for p in descendants(core) if b"engine.executor.zygote" in Path(f"/proc/{p}/cmdline").read_bytes()]
        zygote = [p for p in forked if descendants(p)]   # the ranks are its children, and carry its command line
        ranks = descendants(zygote[0])
        assert len(zygote) == 1 and sorted(ranks) == sorted(set(forked) - set(zygote)) and len(ranks) == 2
        t0 = time.monotonic()
        os.kill(ranks[-1], signal.SIGKILL)
        while httpx.get(server.base_url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() - t0 < 5, "still healthy 5 s after a rank died"
            time.sleep(0.05)
        assert wait_gone([core, *zygote, *ranks], 10) == []
        tree = descendants(server.pid)
        server.stop()
        assert server.proc.returncode is not None and wait_gone(tree, 10) == []
    finally:
        server.stop()


@pytest.mark.parametrize("how", ["SIGTERM server", "SIGKILL server", "SIGKILL driver"])
def test_no_rank_outlives_its_driver(tiny_model, tmp_path, how):
    """Two ranks on one host, serving: SIGTERM or SIGKILL of the server, or SIGKILL of the engine core (the
    driver, rank 0), ends the zygote and the other rank too (the zygote sees its stdin close, the kernel
    kills the ranks it forked); the server whose driver was killed answers 503."""
    server = _serve(tiny_model, tmp_path, "tp2", "--tensor-parallel-size", "2")
    try:
        assert _complete(server)
        core = core_pid(server.pid)
        ranks = tensor_parallel_ranks(server.pid)
        zygotes = [int(Path(f"/proc/{r}/stat").read_text().rsplit(")", 1)[1].split()[1]) for r in ranks]
        assert len(ranks) == 1 and alive(zygotes[0]) and zygotes[0] in descendants(core)
        if how == "SIGKILL driver":
            os.kill(core, signal.SIGKILL)
            engine = [core, *zygotes, *ranks]
        else:
            engine = descendants(server.pid)
            server.stop() if how == "SIGTERM server" else server.kill()
        assert wait_gone(engine, 30) == [], server.log_tail()
        if how == "SIGKILL driver":
            assert httpx.get(server.base_url + "/health", timeout=5).status_code == 503
    finally:
        server.stop()
