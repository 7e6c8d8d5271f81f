"""``state: {redis: embedded}`` (gateway/embedded_redis.py): the first ``tandem serve`` on a machine starts a private
redis-server from the bundled binary, a second one joins it and shares its weights, the last to stop shuts it
down, and what they shared is persisted under the data directory for the next start."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from gateway.embedded_redis import _answers, release, start_or_join
from tests.gateway.support import ROOT, FaultInjectorUpstream, GatewayProcess, upstream_config, wait_until

ENV = {"TEST_UPSTREAM_KEY": "k", "TANDEM_ADMIN_TOKEN": "admin-tok"}
ROUTES = """  main:
    targets: [{backend: a, weight: 95}, {backend: b, weight: 5}]
"""


@pytest.fixture(scope="module")
def upstreams():
    a, b = FaultInjectorUpstream("a").start(), FaultInjectorUpstream("b").start()
    yield a, b
    a.stop()
    b.stop()


def _weights(g: GatewayProcess) -> dict[str, float]:
    cfg = httpx.get(g.url + "/admin/config", headers={"authorization": "Bearer admin-tok"}, timeout=5).json()
    return {t["id"]: t["weight"] for t in cfg["routes"]["main"]["targets"]}


def test_a_second_gateway_joins_the_embedded_redis_and_the_last_one_stops_it(upstreams, tmp_path):
    data = tmp_path / "data"
    path = tmp_path / "config.yaml"
    path.write_text(upstream_config(dict(zip("ab", upstreams)), ROUTES,
                                    extra=f"state: {{redis: embedded, data_dir: {data}, sync_interval_s: 0.2}}"))
    socket = data / "redis" / "redis.sock"
    first = GatewayProcess(path, env=ENV).start()
    second = None
    try:
        second = GatewayProcess(path, env=ENV).start()
        assert "started the embedded redis" in first.log() and "joining the embedded redis" in second.log()
        ctl = subprocess.run([sys.executable, "-m", "gateway.commands", "ctl", "--url", first.url, "weights", "main",
                              "a=25", "b=75"], cwd=ROOT, env={**ENV, "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, timeout=60)
        assert ctl.returncode == 0, ctl.stderr
        assert "this gateway only" not in ctl.stdout      # shared: the gateways have a Redis
        wait_until(lambda: _weights(second) == {"a": 25.0, "b": 75.0}, timeout=15)
        first.stop()
        assert _answers(socket)                           # the second gateway still uses it
        reply = openai.OpenAI(base_url=second.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert reply.choices[0].message.content.startswith("hello from")
        ready = httpx.get(second.url + "/health/ready", timeout=5).json()
        assert not ready.get("redis_degraded"), json.dumps(ready)
    finally:
        first.stop()
        if second is not None:
            second.stop()
    assert not _answers(socket)                           # the last gateway shut it down
    assert (data / "redis" / "appendonly.aof").exists()
    third = GatewayProcess(path, env=ENV).start()         # a restart finds what was shared: the weights stand
    try:
        assert "started the embedded redis" in third.log()
        assert _weights(third) == {"a": 25.0, "b": 75.0}
    finally:
        third.stop()
    assert not _answers(socket)


def test_two_gateways_released_at_once_leave_no_redis_running(tmp_path):
    """Two gateways stopping at the same moment: each saw the other's release connection and left the server
    running with no gateway using it (an ops trial). Their releases (two threads here, started together by a
    barrier; 7 of 10 rounds were left running before) take turns: the server is shut down every round."""
    for i in range(5):
        server = start_or_join(tmp_path / str(i))
        joined = start_or_join(tmp_path / str(i))
        barrier = threading.Barrier(2)
        done: list[bool] = []
        threads = [threading.Thread(target=lambda s=s: (barrier.wait(), done.append(release(s)))) for s in
                   (server, joined)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        try:
            assert not _answers(server.socket) and sorted(done) == [False, True], (i, done)
        finally:
            if server.process.poll() is None:
                server.process.kill()
                server.process.wait()


def test_an_embedded_redis_that_dies_is_started_again_from_its_data(upstreams, tmp_path):
    # a trial killed the embedded redis: every desired-state change was refused (503) until the gateway restarted
    import os
    import signal
    import time

    data = tmp_path / "data"
    path = tmp_path / "config.yaml"
    path.write_text(upstream_config(dict(zip("ab", upstreams)), ROUTES,
                                    extra=f"state: {{redis: embedded, data_dir: {data}, sync_interval_s: 0.2}}"))
    admin = {"authorization": "Bearer admin-tok"}
    g = GatewayProcess(path, env=ENV).start()
    try:
        assert httpx.post(g.url + "/admin/weights", headers=admin, timeout=10,
                          json={"route": "main", "weights": {"a": 40, "b": 60}}).status_code == 200
        pid = int((data / "redis" / "redis.pid").read_text())
        os.kill(pid, signal.SIGSTOP)            # alive and not answering: left alone (a second server would
        time.sleep(3)                           # write the same files)
        assert "starting it again" not in g.log()
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)            # gone: started again, from its data
        wait_until(lambda: "starting it again" in g.log(), timeout=30)
        wait_until(lambda: httpx.post(g.url + "/admin/weights", headers=admin, timeout=10, json={
            "route": "main", "weights": {"a": 30, "b": 70}}).status_code == 200, timeout=30)
        assert int((data / "redis" / "redis.pid").read_text()) != pid
        history = httpx.get(g.url + "/admin/config", headers=admin, timeout=5).json()["history"]
        assert [h["source"] for h in history[:3]] == ["weights", "weights", "file"]   # those before the kill too
    finally:
        g.stop()
    assert not _answers(data / "redis" / "redis.sock")            # and the gateway still shuts it down at the end
