"""``select: prefix_affinity`` over real ``tandem engine serve`` replicas (a tiny random Llama, byte-level
tokenizer: one character = one token) behind real ``tandem serve`` processes, over real HTTP with the official
``openai`` client: a conversation stays on one replica, a loaded replica spills over, a dead one is skipped,
reload adds and removes replicas without touching a stream in flight, two gateways agree."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid

import httpx
import openai
import pytest

from tests.gateway.support import GatewayProcess, engine_replicas, wait_until

pytestmark = pytest.mark.slow   # a large workload: tests/conftest.py runs these files first

ENV = {"TANDEM_ADMIN_TOKEN": "admin-tok"}
ADMIN = {"authorization": "Bearer admin-tok"}
NAMES = ("r1", "r2", "r3")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Three engine replicas of one tiny model (started together, stopped at the end)."""
    yield from engine_replicas(tmp_path_factory, NAMES)


def config(replicas, names=("r1", "r2"), state: str = "") -> str:
    backends = "".join(f"  {n}:\n    type: openai\n    base_url: {s.base_url}/v1\n    models: {{tiny: bench}}\n"
                       f"    max_model_len: 4096\n" for n, s in replicas.items())
    targets = ", ".join(f"{{backend: {n}}}" for n in names)
    return (f"{state}reload: {{watch: false}}\n"
            "resilience:\n  breaker: {consecutive_failures: 1, open_s: 60}\n  health: {interval_s: 0}\n"
            f"models:\n  - name: tiny\nbackends:\n{backends}"
            "routes:\n  replicas:\n    select: prefix_affinity\n"
            "    affinity: {metrics_interval_s: 0.1, load_factor: 1.25}\n"
            f"    targets: [{targets}]\n"
            "policy:\n  default_route: replicas\n  rules: []\n")


@pytest.fixture(scope="module")
def state(redis_url) -> str:
    """The two gateways share a Redis (config versions, breakers), as replicas of one gateway do."""
    return f"state: {{redis_url: '{redis_url}', key_prefix: rp{uuid.uuid4().hex[:8]}}}\n"


@pytest.fixture(scope="module")
def gateways(replicas, state, tmp_path_factory):
    path = tmp_path_factory.mktemp("replicas") / "config.yaml"
    path.write_text(config(replicas, state=state))
    gs = [GatewayProcess(path, env=ENV), GatewayProcess(path, env=ENV)]
    for g in gs:
        g.start()
    yield gs
    for g in gs:
        g.stop()


def conversation(i: int, turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"Question {i}: why {i}?"}]
    for t in range(1, turns):
        msgs += [{"role": "assistant", "content": f"answer {t} " * 5}, {"role": "user", "content": f"and then {t}?"}]
    return msgs


def ask(g: GatewayProcess, messages, **kw):
    c = openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return c.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=2,
                                                       temperature=0, **kw)


def backend_of(g: GatewayProcess, i: int, turns: int = 1) -> str:
    """Where conversation ``i`` goes when every replica is idle: after the gateway's next ``/metrics`` read
    (every 0.1 s), so a read taken while the previous ask still ran on a replica does not count it as load (with
    three replicas the bound is 1: that stale 1 spilled a conversation off its home in a full make test)."""
    time.sleep(0.15)
    return ask(g, conversation(i, turns)).headers["x-tandem-backend"]


def metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})?\s+(\S+)", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_a_conversation_stays_on_its_replica(gateways, replicas):
    g = gateways[0]
    homes = {i: backend_of(g, i) for i in range(10)}
    assert set(homes.values()) == {"r1", "r2"}            # conversations spread over both replicas
    hits0 = {n: metric(replicas[n].base_url, "vllm:prefix_cache_hits_total") for n in ("r1", "r2")}
    for i in range(10):
        for turns in (2, 3):                                # later turns repeat the first: same replica
            assert backend_of(g, i, turns) == homes[i]
    for n in ("r1", "r2"):                                 # ... whose prefix cache holds the earlier turns
        if n in homes.values():
            assert metric(replicas[n].base_url, "vllm:prefix_cache_hits_total") > hits0[n]
    assert metric(g.url, "tandem_replica_affinity_total", outcome="hit") >= 20
    assert metric(g.url, "tandem_replica_routed_total", target="r1") > 0


def test_two_gateways_choose_the_same_replica(gateways):
    a, b = gateways
    assert [backend_of(a, i, 2) for i in range(12)] == [backend_of(b, i, 2) for i in range(12)]


def _hold(base_url: str, n: int) -> tuple[list, threading.Event]:
    """``n`` long streams straight to one replica, held open until the event is set."""
    stop, started = threading.Event(), []

    def one(k: int) -> None:
        body = {"model": "bench", "messages": [{"role": "user", "content": f"load {k}"}], "max_tokens": 3000,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=120) as r:
            for _ in r.iter_bytes():
                started.append(k)
                if stop.is_set():
                    return

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    return threads, stop


def test_a_loaded_replica_spills_over(gateways, replicas):
    g = gateways[0]
    i = next(i for i in range(50) if backend_of(g, i) == "r1")
    spills0 = metric(g.url, "tandem_replica_spillovers_total", target="r1")
    threads, stop = _hold(replicas["r1"].base_url, 4)
    try:
        wait_until(lambda: metric(replicas["r1"].base_url, "vllm:num_requests_running") >= 4, timeout=60)
        time.sleep(0.3)                                     # the gateway's next /metrics read
        r = ask(g, conversation(i, 2))
        assert r.headers["x-tandem-backend"] == "r2"         # r1: load 4 + 1 > bound ceil(1.25 * 5 / 2) = 4
        assert metric(g.url, "tandem_replica_spillovers_total", target="r1") == spills0 + 1
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    wait_until(lambda: metric(replicas["r1"].base_url, "vllm:num_requests_running") == 0, timeout=60)
    time.sleep(0.3)
    assert backend_of(g, i, 2) == "r1"                      # unloaded: back home


def test_reload_adds_and_removes_a_replica_stream_in_flight_unaffected(gateways, replicas, state):
    g = gateways[0]
    before = {i: backend_of(g, i) for i in range(15)}
    path = g.config_path
    original = open(path).read()
    try:
        open(path, "w").write(config(replicas, ("r1", "r2", "r3"), state))
        assert httpx.post(g.url + "/admin/reload", headers=ADMIN, timeout=30).status_code == 200
        after = {i: backend_of(g, i) for i in range(15)}
        moved = [i for i in before if after[i] != before[i]]
        assert moved and all(after[i] == "r3" for i in moved)    # consistent hashing: only moves onto r3
        i = moved[0]
        c = openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        stream = c.chat.completions.create(model="tiny", messages=conversation(i, 1), max_tokens=400,
                                           extra_body={"ignore_eos": True}, stream=True, temperature=0)
        first = next(iter(stream))
        open(path, "w").write(original)                           # r3 removed while the stream runs
        assert httpx.post(g.url + "/admin/reload", headers=ADMIN, timeout=30).status_code == 200
        rest = list(stream)
        assert first.choices[0].delta.content is not None and rest[-1].choices[0].finish_reason == "length"
        assert {backend_of(g, j) for j in moved} <= {"r1", "r2"} and backend_of(g, i) == before[i]
    finally:
        open(path, "w").write(original)
        httpx.post(g.url + "/admin/reload", headers=ADMIN, timeout=30)


def test_a_dead_replica_is_skipped(gateways, replicas):
    g = gateways[0]
    on_r2 = [i for i in range(20) if backend_of(g, i) == "r2"]
    os.killpg(os.getpgid(replicas["r2"].pid), signal.SIGKILL)   # the server and any engine process it started
    replicas["r2"].proc.wait()
    results = [ask(g, conversation(i, 2)) for i in on_r2]
    assert all(r.headers["x-tandem-backend"] == "r1" for r in results)
    time.sleep(0.5)                                           # r2's metrics fail: ranked last, not even tried
    assert all(ask(g, conversation(i, 3)).headers["x-tandem-attempts"] == "1" for i in on_r2)
    assert "replica r2: metrics unreachable" in g.log()


def test_route_explain_shows_affinity_scores_and_spill(gateways, tmp_path):
    import json
    import subprocess
    import sys

    from tests.gateway.support import ROOT

    req = tmp_path / "req.json"
    req.write_text(json.dumps({"model": "tiny", "messages": conversation(3, 2)}))
    home = backend_of(gateways[0], 3)
    other = "r2" if home == "r1" else "r1"

    def explain(*extra: str) -> str:
        r = subprocess.run([sys.executable, "-m", "gateway.commands", "route", "explain", "--config",
                            gateways[0].config_path, "--request", str(req), *extra], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    out = explain()
    assert "scores: r1=" in out and f"chosen: {home} (prefix affinity, key " in out and f"{home} (home)" in out
    out = explain("--replica-load", f"{home}=7")
    assert f"chosen: {other}" in out and f"spill-over from home {home}" in out and "> bound" in out
    assert f"chosen: {other}" in explain("--replica-load", f"{home}=dead")
