"""Shared config versions (issue 26, items 7 and 8): a change names the version it was built on and is refused
(409 with the current version) when the head moved past it, unless rebased explicitly; a rollback stays until the
file itself changes (a touch or a restart does not undo it), and the status says the file differs. Real parts: two
gateways in this process (the Litestar app under uvicorn) on one real Redis, their admin API over HTTP, a config
file on disk watched by its poller."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid

import httpx
import pytest

from gateway.commands import layers_summary
from gateway.config.compile import load_config_text
from gateway.config.versions import ConfigState, MemoryLedger, RedisLedger, VersionConflict, text_digest
from gateway.http.app import create_app
from gateway.runtime import Gateway
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.support import serve_app

ADMIN_TOKEN = "admin-token-versions-26"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def config(up: FaultUpstream, redis_url: str, prefix: str, b_weight: int = 0) -> str:
    # sync_interval_s: 30 -- a replica never picks up the other's change by itself within a test: each change
    # below is made on a replica that has not seen the previous one
    return (f"reload: {{watch: true, poll_interval_s: 0.05}}\n"
            f"state: {{redis_url: '{redis_url}', key_prefix: {prefix}, sync_interval_s: 30}}\n"
            "resilience:\n  health: {interval_s: 0}\nobservability:\n  logs: {requests: false}\n"
            "models:\n  - name: m1\n  - name: m2\n"
            f"backends:\n  a:\n    type: openai\n    base_url: {up.base_url}\n"
            f"  b:\n    type: openai\n    base_url: {up.base_url}\n"
            f"routes:\n  one:\n    targets: [{{backend: a, weight: 100}}, {{backend: b, weight: {b_weight}}}]\n"
            f"  two:\n    targets: [{{backend: a, weight: 100}}, {{backend: b, weight: 0}}]\n"
            "policy:\n  default_route: one\n  rules:\n    - {name: m2, match: {model: m2}, route: two}\n")


@pytest.fixture
def config_text(redis_url, monkeypatch):
    """``config`` on a fault upstream and ``redis_url`` under a key prefix of the test's own (the admin token
    set): ``config_text(b_weight=0)``."""
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", ADMIN_TOKEN)
    prefix = f"v{uuid.uuid4().hex[:8]}"
    with FaultUpstream("up") as up:
        yield lambda b_weight=0: config(up, redis_url, prefix, b_weight)


@contextlib.asynccontextmanager
async def replica(path):
    """A gateway on the config file ``path``: yields (gateway, admin client)."""
    gw = Gateway(str(path), load_config_text(path.read_text(), source=str(path)), start_engine=False)
    server, task, url = await serve_app(create_app(gw))
    async with httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=10) as c:
        try:
            yield gw, c
        finally:
            server.should_exit = True
            await task


def weights(routes: dict, route: str) -> list[float]:
    """The target weights of ``route`` in an admin answer's ``routes`` table."""
    return [t["weight"] for t in routes[route]["targets"]]


async def test_a_change_built_on_an_old_version_is_refused(tmp_path, config_text):
    """Weights on replica 1, then another route's weights on replica 2 that has not seen them: 409 with the
    current version, the first change intact; rebased explicitly, both stand. A file reload on replica 1 is not
    reverted by a weights change built on replica 2's older version."""
    p1, p2 = tmp_path / "r1.yaml", tmp_path / "r2.yaml"
    for p in (p1, p2):
        p.write_text(config_text())
    async with replica(p1) as (g1, c1), replica(p2) as (g2, c2):
        r = await c1.post("/admin/weights", json={"route": "one", "weights": {"a": 60, "b": 40}})
        assert r.status_code == 200 and r.json()["propagated"] is True
        head = r.json()["version"]
        r = await c2.post("/admin/weights", json={"route": "two", "weights": {"a": 10, "b": 90}})
        assert r.status_code == 409 and r.json()["error"]["code"] == "version_conflict"
        assert r.headers["x-tandem-config-version"] == str(head)
        assert (await g2.ledger.head()).overrides == {"one": {"a": 60.0, "b": 40.0}}
        r = await c2.post("/admin/weights", json={"route": "two", "weights": {"a": 10, "b": 90}, "rebase": True})
        assert r.status_code == 200
        assert weights(r.json()["routes"], "one") == [60, 40] and weights(r.json()["routes"], "two") == [10, 90]

        # replica 1 reloads an edited file; replica 2 (still on the version before) changes weights
        p1.write_text(config_text(7))
        r = await c1.post("/admin/reload")
        assert r.status_code == 409        # replica 1 has not seen the rebased change: refused, not undone
        await _apply_head(g1)              # what its sync loop does within sync_interval_s
        r = await c1.post("/admin/reload")
        assert r.status_code == 200 and weights(r.json()["routes"], "one") == [100, 7]
        r = await c2.post("/admin/weights", json={"route": "two", "weights": {"b": 50}})
        assert r.status_code == 409
        assert (await g1.ledger.head()).text == p1.read_text()      # the reload stands fleet-wide


async def _apply_head(gw) -> None:
    head = await gw.ledger.head()
    async with gw._lock:
        gw._apply(head)


async def test_a_rollback_sticks_until_the_file_changes(tmp_path, config_text):
    """Rollback to the version before a file edit: touching the unchanged file, or restarting a replica on it,
    leaves the rollback in place, and the status says the file differs; editing the file applies it."""
    path = tmp_path / "gateway.yaml"
    path.write_text(config_text())
    async with replica(path) as (gw, c):
        path.write_text(config_text(5))
        assert (await c.post("/admin/reload")).status_code == 200
        r = await c.post("/admin/rollback")
        assert r.status_code == 200 and weights(r.json()["routes"], "one") == [100, 0]
        rolled = r.json()["version"]
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))     # touch: same text
        await asyncio.sleep(0.3)                                      # several polls of the watcher
        cfg = (await c.get("/admin/config")).json()
        assert cfg["version"] == rolled and weights(cfg["routes"], "one") == [100, 0]
        assert cfg["file"]["differs"] and cfg["file"]["status"] == "runtime override active, file differs"
        assert cfg["layers"]["one"] == {          # decided by the rollback; "file" is the disk's, not the version's
            "effective": {"a": 100, "b": 0}, "file": {"a": 100, "b": 5},
            "decided_by": f"version {rolled} (rollback)",
            "note": "the file on disk says a 100, b 5; `tandem ctl reload` applies it"}
        assert cfg["layers"]["two"]["decided_by"] == "file"          # the same weights on disk and running
        assert f"route one: a 100, b 0  [version {rolled} (rollback)]" in layers_summary(cfg)
    async with replica(path) as (gw, c):                              # a restart on the same file
        cfg = (await c.get("/admin/config")).json()
        assert cfg["version"] == rolled and weights(cfg["routes"], "one") == [100, 0]
        path.write_text(config_text(9))      # an operator edits the file
        for _ in range(200):
            cfg = (await c.get("/admin/config")).json()
            if cfg["version"] > rolled:
                break
            await asyncio.sleep(0.02)
        assert weights(cfg["routes"], "one") == [100, 9] and cfg["file"]["status"] == "in sync"


async def test_an_edit_of_comments_alone_keeps_the_version_and_the_rollback_it_would_undo(tmp_path, config_text):
    """A new user's trial: after weights 5 then 100 % on the canary, a file edit of a comment made a new version
    ("applied (file): no change"), and the rollback that followed returned to it: the canary stayed at 100 %. A
    reload that changes nothing keeps the running version (desired-state.md), by the watcher and the admin API
    (SIGHUP's reload is the same call); the rollback then returns to 5 %."""
    path = tmp_path / "gateway.yaml"
    path.write_text(config_text())
    async with replica(path) as (gw, c):
        for b in (5, 100):
            r = await c.post("/admin/weights", json={"route": "one", "weights": {"a": 100 - b, "b": b}})
            assert r.status_code == 200, r.text
        promoted = r.json()["version"]
        path.write_text("# the canary is promoted\n" + config_text().replace(": ", ":  "))
        await asyncio.sleep(0.3)                                      # several polls of the watcher
        assert (await c.get("/admin/config")).json()["version"] == promoted
        r = await c.post("/admin/reload")
        assert r.status_code == 200 and r.json()["version"] == promoted, r.text
        status = (await c.get("/admin/config")).json()["file"]
        assert (status["differs"], status["status"]) == (False, "weights overrides active"), status
        r = await c.post("/admin/rollback")
        assert r.status_code == 200 and weights(r.json()["routes"], "one") == [95, 5]
        status = (await c.get("/admin/config")).json()["file"]   # a trial: "runtime override active, file differs"
        assert (status["differs"], status["status"]) == (False, "weights overrides active"), status


@pytest.mark.parametrize("shared", [False, True])
async def test_push_and_rollback_refuse_a_stale_base_alike(shared, redis_url):
    """The Redis scripts and the in-process ledger (one replica) follow the same rules: a push or rollback built
    on a version that is no longer the head is refused with the head's version; an equal state is no change
    whatever its base; a rollback keeps the head's file digest (the file last applied is still that file)."""
    ledger = RedisLedger(redis_url, f"v{uuid.uuid4().hex[:8]}", keep=5) if shared else MemoryLedger(keep=5)
    try:
        v1 = await ledger.push(ConfigState("a: 1\n", file_digest=text_digest("a: 1\n")), None)
        v2 = await ledger.push(ConfigState("a: 2\n", file_digest=text_digest("a: 2\n")), v1)
        with pytest.raises(VersionConflict) as e:
            await ledger.push(ConfigState("a: 1\n", {"r": {"t": 5}}, "weights"), v1)
        assert (e.value.base, e.value.current) == (v1, v2)
        assert await ledger.push(ConfigState("a: 2\n"), v1) == v2          # equal to the head: no change
        edited = "# a note\na:   2   # the same\n"                          # comments and layout are not the config
        assert await ledger.push(ConfigState(edited, file_digest=text_digest(edited)), v1) == v2
        assert (await ledger.head()).text == "a: 2\n" and (await ledger.head()).file_digest == text_digest(edited)
        with pytest.raises(VersionConflict):
            await ledger.rollback(v1)
        back = await ledger.rollback(v2)
        assert back.text == "a: 1\n" and back.file_digest == text_digest(edited) and back.version > v2
        assert (await ledger.head()).file_digest == text_digest(edited)
        v4 = await ledger.push(ConfigState("b: 1\na: 1\n"), back.version)   # the same keys in another order: a change
        assert v4 == back.version + 1
    finally:
        await ledger.aclose()


@pytest.mark.parametrize("shared", [False, True])
async def test_a_guarded_push_waits_on_the_rollouts_revision_alike(shared, redis_url):
    """A rollout controller's change is pushed only while its rollout is at the revision it read (``Guard``):
    the Redis script and the in-process ledger alike refuse it, before anything else, once the rollout moved on
    (an operator or a reload ended it meanwhile), and take it while it holds."""
    from gateway.config.schema import StateSettings
    from gateway.config.versions import GuardFailed
    from gateway.rollouts.store import RolloutStore
    from gateway.state import SharedState

    prefix = f"g{uuid.uuid4().hex[:8]}"
    state = SharedState(StateSettings(redis_url=redis_url if shared else None, key_prefix=prefix))
    store = RolloutStore(state)
    ledger = RedisLedger(redis_url, prefix) if shared else MemoryLedger()
    try:
        v1 = await ledger.push(ConfigState("a: 1\n"), None)
        rev = await store.save("r1", {"state": "running", "route": "ro"}, 0)
        split = ConfigState("a: 1\n", {"ro": {"cand": 25.0, "stable": 75.0}}, "weights")
        assert await ledger.push(split, v1, store.guard("r1", rev)) == v1 + 1
        await store.save("r1", {"state": "aborted", "route": "ro"}, rev)   # ended meanwhile
        with pytest.raises(GuardFailed):
            await ledger.push(ConfigState("a: 1\n", {"ro": {"cand": 50.0, "stable": 50.0}}, "weights"), v1 + 1,
                              store.guard("r1", rev))
        with pytest.raises(GuardFailed):                                     # even a change equal to the head
            await ledger.push(split, v1 + 1, store.guard("r1", rev))
        assert (await ledger.head()).overrides == split.overrides and await ledger.version() == v1 + 1
    finally:
        await ledger.aclose()
        await state.close()


async def test_what_holds_a_split_never_expires_and_what_ended_does(redis_url):
    """A soak trial: every config and rollout key expired some time after its last write (30 days, 7 days), and a
    promoted rollout or a stable config is written by nothing: a week on, the promotion would stop holding its
    route (the next reload setting the file's split over it), a month on, the rollback history would be gone.
    The config history (``keep_versions`` long) and a holding rollout's keys never expire; an ended rollout's do."""
    import redis.asyncio as aioredis

    from gateway.config.schema import StateSettings
    from gateway.rollouts.store import KEY_TTL_S, RolloutStore
    from gateway.state import SharedState

    prefix = f"t{uuid.uuid4().hex[:8]}"
    state = SharedState(StateSettings(redis_url=redis_url, key_prefix=prefix))
    store, ledger, r = RolloutStore(state), RedisLedger(redis_url, prefix), aioredis.Redis.from_url(redis_url)
    try:
        await r.set(ledger.keys[1], "0", ex=60)     # the version counter as an older gateway left it: with a TTL
        v1 = await ledger.push(ConfigState("a: 1\n"), None)
        await ledger.push(ConfigState("a: 2\n"), v1)
        await ledger.rollback()
        assert [await r.ttl(k) for k in ledger.keys] == [-1, -1, -1]
        rev = await store.save("r1", {"state": "promoted", "route": "ro"}, 0)
        held = [f"{prefix}:rollout:r1", f"{prefix}:rollout-rev:r1", f"{prefix}:rollout-route:ro", f"{prefix}:rollouts"]
        assert [await r.ttl(k) for k in held] == [-1, -1, -1, -1]
        await store.save("r1", {"state": "aborted", "route": "ro"}, rev)
        assert 0 < await r.ttl(held[0]) <= KEY_TTL_S and await r.exists(held[2]) == 0
        assert await r.ttl(held[3]) == -1 and await store.names() == ["r1"]
    finally:
        await r.aclose()
        await ledger.aclose()
        await state.close()


def test_ctl_status_says_when_the_gateway_drains_or_redis_is_away():
    """An SRE trial's ``tandem ctl status`` during a drain printed the usual view: nothing said new requests got
    503. The status now says so, and that config changes wait while Redis is unreachable."""
    data = {"version": 3, "source": "file", "file": {"status": "applied"}, "layers": {}, "routes": {}}
    assert layers_summary(data) == "config version 3 (file), file: applied"
    text = layers_summary({**data, "draining": True, "in_flight": 2, "redis_degraded": True})
    assert text.splitlines()[1:] == ["  draining: 2 request(s) in flight, new ones get 503",
                                     "  redis unreachable: serving on in-process state; config changes wait for it"]


def test_ctl_status_says_when_the_file_cannot_be_read(tmp_path):
    """A CLI trial deleted the config file under a running gateway: ``ctl status`` said "in sync" (a missing file
    read as no file). It says the file cannot be read and the running version is kept."""
    from gateway.config.config_file import ConfigFile

    path = tmp_path / "gateway.yaml"
    text = "models: [{name: m}]\nbackends: {up: {type: openai, base_url: 'http://127.0.0.1:9/v1'}}\n" \
           "routes: {r: {targets: [{backend: up}]}}\npolicy: {default_route: r}\n"
    path.write_text(text)
    f = ConfigFile(str(path))
    assert f.status(text, {})["status"] == "in sync"
    path.unlink()
    st = f.status(text, {})
    assert st["refused"] and st["status"] == ("file cannot be read (the running version is kept): No such file or "
                                              "directory"), st
    assert ConfigFile(None).status(text, {})["status"] == "in sync"       # a config given without a file
