"""A route's weights as one desired state (issue 47): a reload recomputes the effective weights from the file, the
operators' overrides and the rollouts that hold a route, and never silently undoes one of them. Real parts: gateways
in this process reading a config file, fault-injecting upstreams, the admin API over HTTP. One test per failure the
issue numbers, then the reference model of the precedence rules (``gateway/config/layers.py``) on its own."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
import pytest

from gateway.config.changes import describe_changes
from gateway.config.compile import load_config_text
from gateway.config.layers import RolloutConflict, reapply
from gateway.http.app import create_app
from gateway.runtime import Gateway
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.rollouts.conftest import ADMIN, ADMIN_TOKEN
from tests.gateway.support import serve_app


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", ADMIN_TOKEN)


def text(stable, cand, other_weight: int = 100, cand_in_file: bool = True, rollout: str = "", release: bool = False,
         shadow: bool = False) -> str:
    """Routes ``ro`` (stable 100, cand 0: the rollout's route) and ``other`` (stable only), an optional rollout."""
    cand_target = ", {backend: cand, weight: 0}" if cand_in_file else ""
    return ("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\n" + rollout +
            "models:\n  - name: m1\n"
            f"backends:\n  stable:\n    type: openai\n    base_url: {stable.base_url}\n"
            f"  cand:\n    type: openai\n    base_url: {cand.base_url}\n"
            f"routes:\n  ro:\n    targets: [{{backend: stable, weight: 100}}{cand_target}]\n"
            + ("    release: true\n" if release else "") +
            f"  other:\n    targets: [{{backend: stable, weight: {other_weight}}}]\n"
            + (f"    shadow: {{target: cand}}\n" if shadow else "") +
            "policy:\n  default_route: ro\n")


ROLLOUT = ("rollouts:\n  r1:\n    route: ro\n    candidate: cand\n    steps: [50, 100]\n    hold_s: {hold}\n"
           "    check_interval_s: 0.05\n    gates: {{error_rate_max: 0.5, min_compared: {n}}}\n")


@contextlib.asynccontextmanager
async def served(path):
    gw = Gateway(str(path), load_config_text(path.read_text()), start_engine=False)
    server, task, url = await serve_app(create_app(gw))
    async with httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=30) as c:
        try:
            yield gw, c
        finally:
            server.should_exit = True
            await task


def weights(gw, route: str = "ro") -> dict[str, float]:
    return {t.id: t.weight for t in gw.snapshot.compiled.policy.routes[route].targets}


async def r1(c) -> dict | None:
    """Rollout r1; None before the controller's first tick started it (or while the API answers 503)."""
    resp = await c.get("/admin/rollouts")
    if resp.status_code != 200:
        return None
    return next((r for r in resp.json()["rollouts"] if r["name"] == "r1"), None)


async def until(c, pred, timeout: float = 30.0) -> dict:
    end = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < end:
        r = await r1(c)
        if r is not None and pred(r):
            return r
        await asyncio.sleep(0.05)
    raise AssertionError(f"rollout not there: {await r1(c)}")


async def test_1_an_unrelated_reload_keeps_a_promoted_rollout(tmp_path):
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, rollout=ROLLOUT.format(hold=30, n=1)))
        async with served(path) as (gw, c):
            await until(c, lambda r: r["state"] == "running")
            assert (await c.post("/admin/rollouts/r1/promote")).status_code == 200
            assert weights(gw) == {"stable": 0.0, "cand": 100.0}
            path.write_text(text(stable, cand, other_weight=50, rollout=ROLLOUT.format(hold=30, n=1)))
            resp = await c.post("/admin/reload")
            status = (await c.get("/admin/config")).json()["layers"]["ro"]
            r = await r1(c)
    assert resp.status_code == 200, resp.text
    assert weights(gw) == {"stable": 0.0, "cand": 100.0} and r["state"] == "promoted"
    layer = resp.json()["layers"]["ro"]
    assert layer["decided_by"] == "rollout r1 (promoted)" and "file says stable 100, cand 0" in layer["note"]
    assert status["decided_by"] == "rollout r1 (promoted)" and status["effective"] == {"stable": 0.0, "cand": 100.0}


async def test_1b_an_operator_override_survives_an_unrelated_reload_and_yields_to_a_file_change(tmp_path):
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand))
        async with served(path) as (gw, c):
            await c.post("/admin/weights", json={"route": "ro", "weights": {"stable": 75, "cand": 25}})
            path.write_text(text(stable, cand, other_weight=50))           # another route only
            kept = (await c.post("/admin/reload")).json()["layers"]["ro"]
            after_unrelated = weights(gw)
            path.write_text(text(stable, cand, other_weight=50).replace("weight: 100}, {backend: cand, weight: 0}",
                                                                         "weight: 90}, {backend: cand, weight: 10}"))
            dropped = (await c.post("/admin/reload")).json()["layers"]["ro"]
            after_file = weights(gw)
    assert after_unrelated == {"stable": 75.0, "cand": 25.0} and kept["decided_by"] == "operator"
    assert after_file == {"stable": 90.0, "cand": 10.0} and dropped["decided_by"] == "file"
    assert "operator override stable 75, cand 25 dropped" in dropped["note"]


async def test_weights_that_change_nothing_keep_the_version_and_its_source(tmp_path):
    """desired-state.md: a change that changes nothing keeps the running version and its source. An operator
    trial's ``ctl weights`` equal to the file's made version 2 (weights) and an operator override ("no change"
    in the log); a ``base_version`` beyond the current one answered 409 "the config changed meanwhile"."""
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand))
        async with served(path) as (gw, c):
            first = gw.snapshot.version
            same = (await c.post("/admin/weights", json={"route": "ro", "weights": {"stable": 100, "cand": 0}})).json()
            layer = (await c.get("/admin/config")).json()["layers"]["ro"]
            changed = (await c.post("/admin/weights", json={"route": "ro", "weights": {"cand": 20}})).json()
            again = (await c.post("/admin/weights", json={"route": "ro", "weights": {"stable": 100.0, "cand": 20}}))
            future = await c.post("/admin/weights", json={"route": "ro", "weights": {"cand": 30},
                                                          "base_version": changed["version"] + 5})
            final = weights(gw)
            # back to the file's split: no override is left (a new user's README story 3 ended [operator])
            back = (await c.post("/admin/weights", json={"route": "ro", "weights": {"cand": 0}})).json()
            back_layer = (await c.get("/admin/config")).json()["layers"]["ro"]
            back_overrides = gw.snapshot.compiled.overrides
    assert (same["version"], same["source"]) == (first, "file") and layer["decided_by"] == "file"
    assert changed["version"] == first + 1 and again.json()["version"] == changed["version"]
    assert again.json()["source"] == "weights"
    assert future.status_code == 400 and future.json()["error"]["param"] == "base_version", future.text
    assert "not a config version yet" in future.json()["error"]["message"] and final == {"stable": 100.0, "cand": 20.0}
    assert back["version"] == changed["version"] + 1 and back_layer["decided_by"] == "file", back_layer
    assert "ro" not in back_overrides


async def test_2_a_reload_removing_a_running_rollouts_candidate_is_refused_naming_it(tmp_path, caplog):
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, rollout=ROLLOUT.format(hold=30, n=1000)))
        async with served(path) as (gw, c):
            await until(c, lambda r: r["state"] == "running")
            path.write_text(text(stable, cand, cand_in_file=False))
            refused = await c.post("/admin/reload")
            still = (await r1(c))["state"], weights(gw)
            file = (await c.get("/admin/config")).json()["file"]    # it said "runtime override active" (a trial)
            aborted = await c.post("/admin/reload", json={"abort_rollouts": True})
            await asyncio.sleep(0.3)                 # a few controller ticks: nothing may loop on the new config
            r = await r1(c)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "rollout_conflict"
    assert "rollout r1 (running)" in refused.json()["error"]["message"]
    assert "removes its candidate 'cand'" in refused.json()["error"]["message"]
    assert still == ("running", {"stable": 50.0, "cand": 50.0})
    assert file["differs"] and file["refused"] and file["status"].startswith("file not applied (the running "
                                                                           "version is kept): "), file
    assert "removes its candidate 'cand'" in file["status"]
    assert aborted.status_code == 200 and weights(gw) == {"stable": 100.0}
    assert r["state"] == "aborted" and "abort_rollouts" in r["reason"]
    assert not [rec for rec in caplog.records if "tick failed" in rec.getMessage()]


async def test_ctl_weights_on_a_route_a_rollout_holds_is_refused_naming_it(tmp_path):
    """The rollout's layer is above an operator's: a change under a running rollout was accepted and undone by its
    next tick (under a promoted one, by the next reload); it is refused, naming the rollout; paused, it is taken."""
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, rollout=ROLLOUT.format(hold=30, n=1000)))
        async with served(path) as (gw, c):
            await until(c, lambda r: r["state"] == "running")
            change = {"route": "ro", "weights": {"stable": 70, "cand": 30}}
            refused = await c.post("/admin/weights", json=change)
            await c.post("/admin/rollouts/r1/pause")
            taken = await c.post("/admin/weights", json=change)
            after = weights(gw)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "rollout_conflict"
    assert "rollout r1 (running) holds route 'ro'" in refused.json()["error"]["message"]
    assert taken.status_code == 200 and after == {"stable": 70.0, "cand": 30.0}


async def test_a_version_rollback_keeps_a_promoted_rollouts_split(tmp_path):
    """A rollback undoes a config change, not a rollout: after a promotion it restored the version of the step
    before (the candidate at 50 % while the rollout said promoted, until someone noticed)."""
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, rollout=ROLLOUT.format(hold=30, n=1000)))
        async with served(path) as (gw, c):
            await until(c, lambda r: r["state"] == "running")
            assert (await c.post("/admin/rollouts/r1/promote")).status_code == 200
            back = await c.post("/admin/rollback", json={})
            r = await r1(c)
            after = weights(gw)
            head = (await gw.ledger.history())[0]
    assert back.status_code == 200, back.text
    assert r["state"] == "promoted" and after == {"stable": 0.0, "cand": 100.0}
    # in the rollback's own version: it served the step before's 50 % until the split was set again in a version
    # of its own (~0.3 s in an ops trial)
    assert (head.version, head.source) == (back.json()["version"], "rollback")
    assert head.overrides["ro"] == {"stable": 0.0, "cand": 100.0} and head.owners["ro"] == "r1"


async def test_a_rollback_under_a_running_rollout_says_its_controller_sets_the_split_again(tmp_path):
    """The console's "Roll back" during a running rollout answered done, with no warning, and the controller set
    the step's split again a second later (as desired-state.md says): the answer says so, naming the rollout."""
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, rollout=ROLLOUT.format(hold=30, n=1000)))
        async with served(path) as (gw, c):
            await until(c, lambda r: r["state"] == "running" and weights(gw)["cand"] == 50)
            back = await c.post("/admin/rollback", json={})
            await until(c, lambda r: weights(gw)["cand"] == 50)
    assert back.status_code == 200, back.text
    assert back.json()["warnings"] == [
        "rollout r1 (running) steers route 'ro': its controller sets its step's split again at its next tick; to "
        "return the route to its baseline, abort it (tandem ctl rollout abort r1)"]


async def test_2b_a_rollback_that_would_orphan_a_rollout_is_refused_naming_it(tmp_path):
    """A version rollback to the config before the candidate was in the route: it was accepted, leaving the
    rollout (paused here; running, its controller failed on it every tick; promoted, it kept saying promoted over a
    route without its candidate) on a route without its candidate. Refused as such a reload is, naming the rollout;
    once it is aborted the rollback goes through."""
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, cand_in_file=False))
        async with served(path) as (gw, c):
            path.write_text(text(stable, cand))
            await c.post("/admin/reload")                                   # version 2: cand in the route
            start = await c.post("/admin/rollouts", json={"name": "r1", "route": "ro", "candidate": "cand",
                                                          "steps": [50, 100], "hold_s": 30, "check_interval_s": 0.05,
                                                          "gates": {"min_compared": 1000}})
            assert start.status_code in (200, 201), start.text
            await c.post("/admin/rollouts/r1/pause")          # the split stays; no tick sets it again
            assert (await c.post("/admin/rollback", json={})).status_code == 200                # back to 2: cand
            refused = await c.post("/admin/rollback", json={})                                 # back to 1: none
            still = weights(gw), (await r1(c))["state"]
            await c.post("/admin/rollouts/r1/abort")
            back = await c.post("/admin/rollback", json={})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "rollout_conflict", refused.text
    msg = refused.json()["error"]["message"]
    assert "rollout r1 (paused) steers route 'ro': the version it returns to removes its candidate 'cand'" in msg
    assert still == ({"stable": 100.0, "cand": 0.0}, "paused")
    assert back.status_code == 200, back.text


async def test_a_tick_that_read_a_rollout_before_a_reload_ended_it_sets_no_split(tmp_path):
    """A controller tick reads a running rollout, then a reload with the route's ``release: true`` ends it and
    puts the file's weights back, then the tick sets the split it read: it was pushed over the reload (the
    property test found the rollout aborted and its 50 % split live). The tick's change is guarded by the
    revision it read, which the ending moved on: nothing is pushed."""
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, rollout=ROLLOUT.format(hold=30, n=1000)))
        async with served(path) as (gw, c):
            await until(c, lambda r: r["state"] == "running")
            read = await gw.rollouts.store.load("r1")                        # what the tick read
            path.write_text(text(stable, cand, rollout=ROLLOUT.format(hold=30, n=1000), release=True))
            assert (await c.post("/admin/reload")).status_code == 200
            version = gw.snapshot.version
            await gw.rollouts._apply_weight(read, force=True)               # the tick's write, after the reload
            after = weights(gw), gw.snapshot.version, (await r1(c))["state"]
    assert after == ({"stable": 100.0, "cand": 0.0}, version, "aborted")


async def test_2c_a_controller_that_cannot_apply_its_weights_pauses_once(tmp_path, redis_url, caplog):
    """A shared version without the rollout's candidate, pushed by a writer that does not check the layers (an
    older replica during an upgrade): the controller pauses the rollout with the reason, once, instead of failing
    every tick."""
    import uuid

    from gateway.config.versions import ConfigState, RedisLedger

    prefix = f"l{uuid.uuid4().hex[:8]}"
    state = f"state: {{redis_url: '{redis_url}', key_prefix: {prefix}, sync_interval_s: 0.05}}\n"
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, rollout=state))
        async with served(path) as (gw, c):
            start = await c.post("/admin/rollouts", json={"name": "r1", "route": "ro", "candidate": "cand",
                                                          "steps": [50, 100], "hold_s": 30, "check_interval_s": 0.05,
                                                          "gates": {"min_compared": 1000}})
            assert start.status_code in (200, 201), start.text
            older = RedisLedger(redis_url, prefix)
            try:
                await older.push(ConfigState(text(stable, cand, cand_in_file=False, rollout=state), {}, "reload"))
            finally:
                await older.aclose()
            r = await until(c, lambda r: r["state"] == "paused")
            await asyncio.sleep(0.3)
    assert "cannot be applied" in r["reason"]
    assert not [rec for rec in caplog.records if "tick failed" in rec.getMessage()]


async def test_3_the_hold_counts_from_the_first_check_every_gate_was_judged(tmp_path):
    """hold_s 1.5 and no traffic for longer than that: the gates are unjudged, so the hold has not begun; the
    first pairs open it, and the step waits a whole hold_s from then."""
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, rollout=ROLLOUT.format(hold=1.5, n=2)))
        async with served(path) as (gw, c):
            await until(c, lambda r: r["state"] == "running")
            await asyncio.sleep(2.0)
            assert (await r1(c))["held_since"] is None
            async with httpx.AsyncClient(base_url=str(c.base_url), timeout=30) as client:
                for i in range(6):
                    await client.post("/v1/chat/completions", json={
                        "model": "m1", "user": f"u{i}", "messages": [{"role": "user", "content": "hi"}]})
            opened = await until(c, lambda r: r["held_since"] is not None)
            stepped = await until(c, lambda r: r["step_index"] == 1 or r["state"] == "promoted")
    moved = stepped["history"][1]
    assert moved["at"] - opened["held_since"] >= 1.5
    assert moved["window"]["compared"] >= 2


def test_4_a_change_is_described_by_its_key_paths_not_as_file_text():
    old = load_config_text(text(FakeUrl, FakeUrl))
    new = load_config_text(text(FakeUrl, FakeUrl, shadow=True))
    assert describe_changes(old, new) == "routes.other.shadow added"
    assert describe_changes(new, load_config_text(new.text + "\n# note\n")) == "no change"
    # the usage ledger's settings are its start's (a trial's reload logged a journal_path "added" never used)
    before = load_config_text(new.text + "budgets: {record_ttl_s: 30}\n")
    journaled = load_config_text(new.text + "budgets: {journal_path: j.jsonl, record_ttl_s: 60}\n")
    assert describe_changes(before, journaled) == ("budgets.record_ttl_s changed (read at start: a restart applies it); "
                                                "budgets.journal_path added (read at start: a restart applies it)")
    # weights are reported as they take effect, not again as the targets' key path; where an override keeps them
    # (a file edit under a rollout that holds the route), as the file's change not in effect; a target's other
    # keys still are
    moved = text(FakeUrl, FakeUrl).replace("weight: 100}, {backend: cand, weight: 0}",
                                           "weight: 95}, {backend: cand, weight: 5}")
    assert describe_changes(old, load_config_text(moved)) == "route ro: cand 0 -> 5, stable 100 -> 95"
    held = {"ro": {"stable": 100.0, "cand": 0.0}}
    assert describe_changes(load_config_text(old.text, held), load_config_text(moved, held)) == \
        "route ro: cand 0 -> 5, stable 100 -> 95 in the config text, not in effect (an override holds the route)"
    # the file's edit replaced an override that had the same weights (a trial's log said an override held the route
    # while tandem ctl status said [file])
    took = {"ro": {"stable": 95.0, "cand": 5.0}}
    assert describe_changes(load_config_text(old.text, took), load_config_text(moved)) == (
        "route ro: cand 0 -> 5, stable 100 -> 95 in the config text, which now decides it (the same weights as the "
        "override it replaces)")
    renamed = old.text.replace("{backend: cand, weight: 0}", "{backend: cand, weight: 0, id: c2}")
    line = describe_changes(old, load_config_text(renamed))
    assert "routes.ro.targets changed" in line, line


class FakeUrl:
    base_url = "http://127.0.0.1:9/v1"


# ----- the precedence rules on their own ------------------------------------------------------------------------
FILE = {"ro": {"A": 100.0, "B": 0.0}, "other": {"A": 100.0}}


def rollout(state: str, weight: float = 100.0) -> dict:
    return {"name": "late", "route": "ro", "candidate": "B", "baseline": "A", "state": state, "weight": weight}


@pytest.mark.parametrize("state,holds", [("running", True), ("paused", True), ("promoted", True),
                                         ("rolled_back", False), ("aborted", False), ("released", False)])
def test_which_rollout_states_hold_their_route(state, holds):
    out = reapply(FILE, FILE, {"ro": {"B": 100.0, "A": 0.0}}, [rollout(state)], set())
    assert ("rollout late" in out.routes["ro"]["decided_by"]) is holds
    assert out.overrides["ro"] == {"B": 100.0, "A": 0.0}     # held by the rollout, or kept as the operator's


def test_release_in_the_file_takes_the_route_back():
    out = reapply(FILE, FILE, {"ro": {"B": 100.0, "A": 0.0}}, [rollout("promoted")], {"ro"})
    assert out.overrides == {} and [t.action for t in out.takes] == ["release"]


def test_an_orphaning_file_is_refused_unless_told():
    gone = {"ro": {"A": 100.0}, "other": {"A": 100.0}}
    with pytest.raises(RolloutConflict, match="rollout late \\(running\\) steers route 'ro'"):
        reapply(FILE, gone, {}, [rollout("running", 50)], set())
    out = reapply(FILE, gone, {}, [rollout("running", 50)], set(), abort_rollouts=True)
    assert out.overrides == {} and [(t.name, t.action) for t in out.takes] == [("late", "abort")]


logging.getLogger("tandem.rollouts").setLevel(logging.INFO)


def _shared_state(redis_url: str) -> str:
    import uuid

    return f"state: {{redis_url: '{redis_url}', key_prefix: l{uuid.uuid4().hex[:8]}, sync_interval_s: 0.1}}\n"


def _applied_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("config version ")]


async def test_a_replica_started_on_an_edited_file_keeps_the_layers_above_it(tmp_path, redis_url, caplog):
    """A replica (re)started on a file that changed since the shared head was applied pushes that file under the
    layers above the head's file, as a reload would: an operator's override of a route the edit left alone stays
    (it was pushed without them: the override was lost on every replica). Its log line says what the edit changed
    from the shared version (an SRE trial's said only "the first version this process runs")."""
    state = _shared_state(redis_url)
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, rollout=state))
        async with served(path) as (gw, c):
            await c.post("/admin/weights", json={"route": "ro", "weights": {"stable": 75, "cand": 25}})
        path.write_text(text(stable, cand, other_weight=50, rollout=state))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tandem.gateway"):
            async with served(path) as (gw2, c2):
                layer = (await c2.get("/admin/config")).json()["layers"]["ro"]
                other = weights(gw2, "other")
    assert weights(gw2) == {"stable": 75.0, "cand": 25.0} and layer["decided_by"] == "operator"
    assert other == {"stable": 50.0}
    assert _applied_lines(caplog)[0].endswith("route other: stable 100 -> 50"), _applied_lines(caplog)


async def test_a_replica_started_on_a_file_that_would_orphan_a_rollout_says_it_runs_the_shared_version(
        tmp_path, redis_url, caplog):
    """A replica restarted on a file that removes a running rollout's candidate runs the shared version, as a
    reload refuses the file: ``/admin/config`` says why the file is not applied, and the log line does not say the
    file was (an SRE trial's read "applied (file ...)" and then "runtime override active, file differs")."""
    state = _shared_state(redis_url)
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, rollout=state + ROLLOUT.format(hold=30, n=1000)))
        async with served(path) as (gw, c):
            await until(c, lambda r: r["state"] == "running")
        path.write_text(text(stable, cand, cand_in_file=False, rollout=state))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tandem.gateway"):
            async with served(path) as (gw2, c2):
                file = (await c2.get("/admin/config")).json()["file"]
                running = weights(gw2)
    assert running == {"stable": 50.0, "cand": 50.0}
    assert file["refused"] and file["status"].startswith("file not applied (the running version is kept): "), file
    assert "removes its candidate 'cand'" in file["status"]
    line = _applied_lines(caplog)[0]
    assert "the shared version, not the file" in line and "(file" not in line, line


async def test_a_weights_change_warns_of_weight_on_a_backend_its_probe_finds_down(tmp_path):
    """A target whose backend the health probes find down (a keyless canary engine not started) gets a warning
    naming the share that moves, as an unset key does (the README's canary story promises it)."""
    with FaultUpstream("stable") as stable:
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, FakeUrl).replace("health: {interval_s: 0}", "health: {interval_s: 0.1}"))
        async with served(path) as (gw, c):
            end = asyncio.get_running_loop().time() + 30
            while (await c.get("/health/ready")).json()["backends"]["cand"]["available"]:
                assert asyncio.get_running_loop().time() < end, "the probe never found cand down"
                await asyncio.sleep(0.1)
            resp = await c.post("/admin/weights", json={"route": "ro", "weights": {"stable": 75, "cand": 25}})
            whole = await c.post("/admin/weights", json={"route": "ro", "weights": {"stable": 0, "cand": 100}})
            back = await c.post("/admin/rollback", json={})   # to 75/25: a rollback warns as a change does
    warned = [w for w in resp.json()["warnings"] if w.startswith("routes.ro:")]
    assert len(warned) == 1 and "25.0 % of the weight is on backends found down (cand: last probe failed" \
        in warned[0], warned
    # routing still calls a backend whose probe failed (breakers, not probes, take it out): the warning says so
    # rather than promising the other targets or fallbacks (new-user trial: "fallbacks only", then a 502)
    assert "each of those requests still tries them first (until failed calls open their breakers), then goes to " \
        "the route's other targets of weight > 0" in warned[0]
    # promoted onto the down arm: the share goes to the target left at weight 0, which routing tries before any
    # fallback (new-user trial: the warning promised the keyless fallbacks, then 502 and 503s)
    warned = [w for w in whole.json()["warnings"] if w.startswith("routes.ro:")]
    assert len(warned) == 1 and warned[0].endswith("then goes to its targets of weight 0 (stable)"), warned
    assert back.status_code == 200 and any(w.startswith("routes.ro: 25.0 % of the weight is on backends found down")
                                           for w in back.json()["warnings"]), back.json()
