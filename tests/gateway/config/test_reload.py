"""Config reload under load, invalid files, and multi-replica propagation
through a real Redis server."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from tests.gateway.support import ROOT, FaultInjectorUpstream, GatewayProcess, upstream_config, wait_until

ENV = {"TEST_UPSTREAM_KEY": "k", "TANDEM_ADMIN_TOKEN": "adm"}
ADMIN = {"authorization": "Bearer adm"}
ROUTES = """  main:
    targets: [{backend: a, weight: 100}, {backend: b, weight: 0}]
    fallbacks: [{backend: b}]
"""


@pytest.fixture(scope="module")
def upstreams():
    a, b = FaultInjectorUpstream("a").start(), FaultInjectorUpstream("b").start()
    yield a, b
    a.stop()
    b.stop()


def admin_config(g: GatewayProcess) -> dict:
    return httpx.get(g.url + "/admin/config", headers=ADMIN, timeout=10).json()


async def test_reload_under_load_drops_nothing_and_refuses_invalid_file(upstreams, tmp_path):
    a, b = upstreams
    a.set_mode(delay=1.5)
    b.set_mode(delay=1.5)
    path = tmp_path / "config.yaml"
    good = upstream_config({"a": a, "b": b}, ROUTES)
    path.write_text(good)
    g = GatewayProcess(path, env=ENV).start()
    try:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(base_url=g.url, timeout=60, limits=limits) as c:
            async def one(i: int) -> httpx.Response:
                return await c.post("/v1/chat/completions", json={
                    "model": "m1", "messages": [{"role": "user", "content": f"q{i}"}], "user": f"u{i}",
                    "stream": i % 4 == 0})

            tasks = [asyncio.create_task(one(i)) for i in range(200)]
            await asyncio.sleep(0.5)                       # requests are in flight now
            r = await c.post("/admin/weights", headers=ADMIN, json={"route": "main", "weights": {"a": 50, "b": 50}})
            assert r.status_code == 200, r.text
            version = r.json()["version"]
            path.write_text(good.replace("weight: 100", "weight: -7"))     # invalid, picked up by the watcher
            r = await c.post("/admin/reload", headers=ADMIN)
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["param"] == "routes.main.targets[0].weight" and "routes.main.targets[0].weight" in err["message"]
            assert str(path) in err["message"]             # the error names the file
            results = await asyncio.gather(*tasks)
        assert [r.status_code for r in results] == [200] * 200
        assert all(("[DONE]" in r.text) if i % 4 == 0 else r.json()["choices"] for i, r in enumerate(results))
        cfg = admin_config(g)
        assert cfg["version"] == version                   # the invalid file changed nothing
        assert cfg["routes"]["main"]["targets"][1]["weight"] == 50
        assert "routes.main.targets[0].weight" in g.log()  # the watcher refused it too, naming the key
        # The status says so (it had said "runtime override active, file differs", and there was none).
        status = cfg["file"]["status"]
        assert status.startswith("file does not load (the running version is kept): ") and cfg["file"]["differs"]
        assert cfg["file"]["refused"]
        assert "routes.main.targets[0].weight" in status
        # A valid edit is picked up by the watcher (weights from the file again).
        path.write_text(good.replace("{backend: b, weight: 0}", "{backend: b, weight: 1}"))
        wait_until(lambda: admin_config(g)["routes"]["main"]["targets"][1]["weight"] == 1)
    finally:
        a.set_mode()
        b.set_mode()
        g.stop()


@contextlib.contextmanager
def unwatched(upstreams, tmp_path):
    """A gateway process on a config file it does not watch: yields (the file, its text, the gateway)."""
    a, b = upstreams
    path = tmp_path / "config.yaml"
    good = upstream_config({"a": a, "b": b}, ROUTES).replace("watch: true", "watch: false")
    path.write_text(good)
    g = GatewayProcess(path, env=ENV).start()
    try:
        yield path, good, g
    finally:
        g.stop()


def test_sighup_reloads(upstreams, tmp_path):
    with unwatched(upstreams, tmp_path) as (path, good, g):
        path.write_text(good.replace("{backend: b, weight: 0}", "{backend: b, weight: 3}"))
        time.sleep(0.5)
        assert admin_config(g)["routes"]["main"]["targets"][1]["weight"] == 0   # not watched
        g.proc.send_signal(__import__("signal").SIGHUP)
        wait_until(lambda: admin_config(g)["routes"]["main"]["targets"][1]["weight"] == 3)
        assert admin_config(g)["history"][0]["source"] == "sighup"


def test_unchanged_reload_keeps_the_version(upstreams, tmp_path):
    """Reloading an unchanged file (after a weights change and a rollback) keeps
    the head's version: versions never go backwards."""
    a, b = upstreams
    path = tmp_path / "config.yaml"
    path.write_text(upstream_config({"a": a, "b": b}, ROUTES).replace("watch: true", "watch: false"))
    g = GatewayProcess(path, env=ENV).start()
    try:
        first = admin_config(g)["version"]
        r = httpx.post(g.url + "/admin/weights", headers=ADMIN, json={"route": "main", "weights": {"b": 5}})
        assert r.status_code == 200 and r.json()["version"] > first
        r = httpx.post(g.url + "/admin/rollback", headers=ADMIN)
        assert r.status_code == 200
        rolled = r.json()["version"]
        assert rolled > first
        r = httpx.post(g.url + "/admin/reload", headers=ADMIN)
        assert r.status_code == 200 and r.json()["version"] == rolled
        assert admin_config(g)["version"] == rolled
    finally:
        g.stop()


def test_a_rollback_brings_back_a_removed_key_only_when_told(upstreams, tmp_path):
    """A key removed by a reload is revoked; a rollback of that reload would make it work again (a security
    trial's team-d key did): refused with 409 ``keys_restored`` naming the tenant, nothing changed, unless
    ``restore_keys`` (``tandem ctl rollback --restore-keys``)."""
    import hashlib

    import openai

    a, b = upstreams
    keys = {"team-a": "sk-a-0123456789", "team-d": "sk-d-0123456789"}

    def text(tenants):
        auth = "".join(f"    - {{tenant: {t}, sha256: {hashlib.sha256(keys[t].encode()).hexdigest()}}}\n"
                       for t in tenants)
        return upstream_config({"a": a, "b": b}, ROUTES, extra=f"auth:\n  keys:\n{auth}").replace(
            "watch: true", "watch: false")

    def chat(tenant):
        c = openai.OpenAI(base_url=g.url + "/v1", api_key=keys[tenant], max_retries=0)
        return c.chat.completions.create(model="m1", messages=[{"role": "user", "content": "x"}])

    path = tmp_path / "config.yaml"
    path.write_text(text(["team-a", "team-d"]))
    g = GatewayProcess(path, env=ENV).start()
    try:
        assert chat("team-d").choices[0].message.content
        path.write_text(text(["team-a"]))
        assert httpx.post(g.url + "/admin/reload", headers=ADMIN).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            chat("team-d")
        revoked = admin_config(g)["version"]
        r = httpx.post(g.url + "/admin/rollback", headers=ADMIN)
        assert r.status_code == 409 and r.json()["error"]["code"] == "keys_restored"
        assert "team-d" in r.json()["error"]["message"] and "--restore-keys" in r.json()["error"]["message"]
        assert admin_config(g)["version"] == revoked
        with pytest.raises(openai.AuthenticationError):
            chat("team-d")
        ctl = subprocess.run([sys.executable, "-m", "gateway.commands", "ctl", "--url", g.url, "rollback",
                              "--restore-keys"], cwd=ROOT, env={**ENV, "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, timeout=60)
        assert ctl.returncode == 0, ctl.stderr
        # it says what it undid (an ops trial read only the new version's number)
        assert f"returns to version {revoked - 1}: auth.keys changed" in ctl.stdout, ctl.stdout
        assert chat("team-d").choices[0].message.content                 # the operator said so
    finally:
        g.stop()


def test_two_replicas_share_config_through_redis(upstreams, tmp_path, redis_url):
    a, b = upstreams
    prefix = f"t{uuid.uuid4().hex[:8]}"
    extra = f"state: {{redis_url: '{redis_url}', key_prefix: {prefix}, sync_interval_s: 0.5}}"
    paths = [tmp_path / "r1.yaml", tmp_path / "r2.yaml"]
    for p in paths:
        p.write_text(upstream_config({"a": a, "b": b}, ROUTES, extra=extra))
    g1 = GatewayProcess(paths[0], env=ENV).start()
    g2 = GatewayProcess(paths[1], env=ENV).start()
    try:
        def weights(g):
            return [t["weight"] for t in admin_config(g)["routes"]["main"]["targets"]]

        assert weights(g1) == weights(g2) == [100, 0]
        r = httpx.post(g1.url + "/admin/weights", headers=ADMIN, json={"route": "main", "weights": {"a": 0, "b": 100}})
        assert r.status_code == 200 and r.json()["propagated"] is True
        wait_until(lambda: weights(g2) == [0, 100])
        r = httpx.post(g2.url + "/v1/chat/completions", json={"model": "m1", "messages": [{"role": "user",
                                                                                         "content": "x"}]})
        assert r.headers["x-tandem-backend"] == "b"
        # A rollback on the second replica reaches the first.
        assert httpx.post(g2.url + "/admin/rollback", headers=ADMIN).status_code == 200
        wait_until(lambda: weights(g1) == [100, 0])
        # A reload of an edited file on one replica reaches the other (whose own file is unchanged).
        paths[0].write_text(paths[0].read_text().replace("{backend: b, weight: 0}", "{backend: b, weight: 7}"))
        assert httpx.post(g1.url + "/admin/reload", headers=ADMIN).status_code == 200
        wait_until(lambda: weights(g2) == [100, 7])
        assert admin_config(g1)["version"] == admin_config(g2)["version"]
    finally:
        g1.stop()
        g2.stop()


@pytest.mark.parametrize("shared", [False, True])
async def test_ledger_push_dedupe_and_rollback(shared, redis_url):
    from gateway.config.versions import ConfigState, MemoryLedger, RedisLedger

    ledger = RedisLedger(redis_url, f"t{uuid.uuid4().hex[:8]}", keep=3) if shared else MemoryLedger(keep=3)
    try:
        assert await ledger.head() is None
        v1 = await ledger.push(ConfigState("a: 1\n"))
        assert await ledger.push(ConfigState("a: 1\n")) == v1            # same digest: no new version
        v2 = await ledger.push(ConfigState("a: 1\n", {"r": {"t": 5}}, "weights"))
        v3 = await ledger.push(ConfigState("a: 2\n"))
        assert v1 < v2 < v3 == await ledger.version()
        back = await ledger.rollback()
        assert back.text == "a: 1\n" and back.overrides == {"r": {"t": 5.0}} and back.source == "rollback"
        assert back.version > v3 and (await ledger.head()).version == back.version
        assert await ledger.push(ConfigState("a: 1\n", {"r": {"t": 5}})) == back.version   # equal to the head
        back = await ledger.rollback()
        assert back.text == "a: 1\n" and back.overrides == {}
        with pytest.raises(LookupError):
            await ledger.rollback()
        for i in range(5):
            await ledger.push(ConfigState(f"b: {i}\n"))
        assert len(await ledger.history()) == 3                          # keep_versions
    finally:
        await ledger.aclose()


def test_admin_drain_then_exit(upstreams, tmp_path):
    import concurrent.futures

    a, b = upstreams
    path = tmp_path / "config.yaml"
    path.write_text(upstream_config({"a": a, "b": b}, ROUTES))
    g = GatewayProcess(path, env=ENV).start()
    try:
        body = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "stream": True,
                "metadata": {"chunks": "6", "chunk_delay": "0.2"}}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            stream = pool.submit(httpx.post, g.url + "/v1/chat/completions", json=body, timeout=30)
            time.sleep(0.4)
            ctl = subprocess.run([sys.executable, "-m", "gateway.commands", "ctl", "--url", g.url, "drain"], cwd=ROOT,
                                 env={**ENV, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
            assert ctl.returncode == 0, ctl.stderr                  # a sentence, as every ctl command prints
            assert ctl.stdout.startswith("draining: 1 request(s) in flight are answered first"), ctl.stdout
            assert httpx.get(g.url + "/health/ready").status_code == 503
            done = stream.result()
        assert done.status_code == 200 and done.text.rstrip().endswith("data: [DONE]")
        assert g.proc.wait(20) is not None                 # exits by itself once drained
    finally:
        g.stop()


def _on_redis(upstreams, tmp_path, redis_server, state: str, extra: str = ""):
    """A started gateway (and its config file's path) on ``upstreams`` sharing state in ``redis_server``, with the
    ``state`` keys given and quick sync and timeouts (1 s: a full suite's load once took 0.3 s for a reload's
    Redis calls, refused as "Redis is unreachable"), and ``extra`` top-level config."""
    a, b = upstreams
    text = (f"state: {{redis_url: '{redis_server.url}', sync_interval_s: 0.3, socket_timeout_s: 1.0, {state}}}\n"
            f"{extra}")
    path = tmp_path / "config.yaml"
    path.write_text(upstream_config({"a": a, "b": b}, ROUTES, extra=text))
    return GatewayProcess(path, env=ENV).start(), path


def test_redis_outage_keeps_serving_and_reseeds(upstreams, tmp_path, redis_server):
    import redis

    g = _on_redis(upstreams, tmp_path, redis_server, "key_prefix: outage")[0]
    try:
        redis_server.stop()
        time.sleep(0.5)
        body = {"model": "m1", "messages": [{"role": "user", "content": "x"}]}
        assert httpx.post(g.url + "/v1/chat/completions", json=body).status_code == 200
        before = admin_config(g)["routes"]["main"]["targets"][1]["weight"]
        r = httpx.post(g.url + "/admin/weights", headers=ADMIN, json={"route": "main", "weights": {"b": 30}})
        # refused, naming why: applied here alone it would be lost, or undo another replica's, on rejoin
        assert r.status_code == 503 and r.json()["error"]["code"] == "redis_unavailable", r.text
        assert "weights change of route 'main' not applied" in r.json()["error"]["message"]
        assert wait_until(lambda: admin_config(g)["redis_degraded"])
        redis_server.start()                                                  # comes back empty
        client = redis.Redis.from_url(redis_server.url)
        wait_until(lambda: client.get("outage:config:version") is not None)
        assert not admin_config(g)["redis_degraded"]
        assert admin_config(g)["routes"]["main"]["targets"][1]["weight"] == before   # re-seeded with the running config
        assert httpx.post(g.url + "/v1/chat/completions", json=body).status_code == 200
        client.close()
    finally:
        g.stop()


def test_fail_closed_limits_takes_effect_on_reload(upstreams, tmp_path, redis_server):
    """A docs trial: state.fail_closed_limits changed by a reload was logged as applied, and a limited request
    was still admitted in process once Redis went away (the limiter kept the start's value). Now the reload
    applies it; a key read at start says so in the reload's answer."""
    g, path = _on_redis(upstreams, tmp_path, redis_server, "key_prefix: failclosed, fail_closed_limits: false",
                        "limits: {tenants: {anonymous: {rpm: 100}}}")
    try:
        body = {"model": "m1", "messages": [{"role": "user", "content": "x"}]}
        assert httpx.post(g.url + "/v1/chat/completions", json=body).status_code == 200
        path.write_text(path.read_text().replace("fail_closed_limits: false", "fail_closed_limits: true")
                        .replace("key_prefix: failclosed", "key_prefix: other"))
        r = httpx.post(g.url + "/admin/reload", headers=ADMIN, timeout=10)
        assert r.status_code == 200, r.text
        line = next(x for x in g.log().splitlines() if "config version 2 applied" in x)
        assert "state.fail_closed_limits changed;" in line or line.endswith("state.fail_closed_limits changed")
        assert "state.key_prefix changed (read at start: a restart applies it)" in line
        redis_server.stop()
        assert wait_until(lambda: admin_config(g)["redis_degraded"])
        r = httpx.post(g.url + "/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "rate_limiter_unavailable", r.text
    finally:
        redis_server.start()
        g.stop()


def test_a_key_given_twice_is_refused_not_half_applied(upstreams, tmp_path):
    """A second ``policy:`` block pasted at the end of the file was applied, PyYAML keeping the last: the first
    block's rules were dropped without a word (an ops trial). The reload is refused naming both lines; the
    running version stays."""
    with unwatched(upstreams, tmp_path) as (path, good, g):
        version = admin_config(g)["version"]
        path.write_text(good + "policy:\n  default_route: main\n")
        r = httpx.post(g.url + "/admin/reload", headers=ADMIN, timeout=30)
        first = next(i for i, line in enumerate(good.splitlines(), 1) if line.startswith("policy:"))
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert f"found duplicate key 'policy' (first given on line {first})" in message, message
        assert f'in "{path}", line {len(good.splitlines()) + 1}' in message, message
        assert admin_config(g)["version"] == version


def test_yaml_errors_name_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("server:\n  port: [1\n")
    r = subprocess.run([sys.executable, "-m", "gateway.commands", "serve", "--config", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f'in "{path}", line 2' in r.stderr and "<unicode string>" not in r.stderr, r.stderr


def test_a_reload_that_would_leave_a_backend_keyless_is_refused(upstreams, tmp_path):
    """An ops trial: a reload naming an unset ``api_key_env`` (a typo) was applied, its backend left out and all
    of the route's traffic moved to the 5 % canary, the reload answered as applied. It is refused, naming the
    key; a backend keyless since the start is not a reason to refuse an unrelated change."""
    with unwatched(upstreams, tmp_path) as (path, good, g):
        version = admin_config(g)["version"]
        typo = good.replace("api_key_env: TEST_UPSTREAM_KEY", "api_key_env: TEST_UPSTREAM_KEYY", 1)
        path.write_text(typo)
        r = httpx.post(g.url + "/admin/reload", headers=ADMIN)
        assert r.status_code == 400, r.text
        assert "backends.a.api_key_env" in r.text and "TEST_UPSTREAM_KEYY is unset" in r.text
        info = admin_config(g)
        assert info["version"] == version
        # the file's status says why it does not run (an ops trial read "runtime override active, file differs")
        assert info["file"]["refused"] is True and info["file"]["status"].startswith(
            "file not applied (the running version is kept): ") and "TEST_UPSTREAM_KEYY is unset" in \
            info["file"]["status"], info["file"]
        rsp = httpx.post(g.url + "/v1/chat/completions", headers={"authorization": "Bearer x"},
                         json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]})
        assert rsp.headers["x-tandem-backend"] == "a"
    path.write_text(typo)            # keyless from the start: reported, and an unrelated edit is applied
    g = GatewayProcess(path, env=ENV).start()
    try:
        path.write_text(typo.replace("{backend: b, weight: 0}", "{backend: b, weight: 3}"))
        r = httpx.post(g.url + "/admin/reload", headers=ADMIN)
        assert r.status_code == 200, r.text
    finally:
        g.stop()


def test_a_file_edit_while_redis_is_away_waits_and_says_so(upstreams, tmp_path, redis_server):
    """An ops trial, Redis away: a watched edit showed "runtime override active, file differs" and nothing in the
    log, and a SIGHUP logged "Task exception was never retrieved" with a traceback. The edit waits, says why in
    the status and once in the log, and is applied when Redis answers."""
    import signal

    g, path = _on_redis(upstreams, tmp_path, redis_server, "key_prefix: waits")
    try:
        redis_server.stop()
        assert wait_until(lambda: admin_config(g)["redis_degraded"])
        path.write_text(path.read_text().replace("{backend: b, weight: 0}", "{backend: b, weight: 7}"))
        assert wait_until(lambda: admin_config(g)["file"]["status"].startswith(
            "file not applied (the running version is kept): Redis is unreachable"))
        g.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "config reload (sighup) refused" in g.log())
        time.sleep(1.0)                                       # a few polls of the watcher
        assert g.log().count("config file changed while Redis is unreachable") == 1
        assert "Task exception was never retrieved" not in g.log() and "Traceback" not in g.log()
        redis_server.start()
        assert wait_until(lambda: admin_config(g)["routes"]["main"]["targets"][1]["weight"] == 7, timeout=30)
        assert admin_config(g)["file"]["status"] == "in sync"
    finally:
        g.stop()
