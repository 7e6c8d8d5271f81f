"""Gated progressive rollouts (issue 31, item 3): a healthy candidate goes 5 -> 25 -> 100 % with two gateway
replicas sharing one Redis, one of them restarted mid-rollout, each step taken once (one config version per step,
one history entry); a failing candidate (errors, slow first token, different answers) is rolled back with the gate
that failed named; operators' actions and their illegal ones. Real parts: gateways in this process on a real Redis,
fault-injecting upstreams, the admin API over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import httpx
import pytest

from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.rollouts.conftest import ADMIN_TOKEN, gateway, two_upstreams


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", ADMIN_TOKEN)


def config(stable, cand, redis_url: str | None, hold_s: float, gates: str) -> str:
    state = (f"state: {{redis_url: '{redis_url}', key_prefix: r{uuid.uuid4().hex[:8]}, sync_interval_s: 0.1}}\n"
             if redis_url else "")
    state += (f"rollouts:\n  r1:\n    route: main\n    candidate: cand\n    steps: [5, 25, 100]\n"
             f"    hold_s: {hold_s}\n    check_interval_s: 0.05\n    gates: {gates}\n")
    return two_upstreams(stable, cand, extra=state)


@contextlib.asynccontextmanager
async def load(urls: list[str]):
    """Chat requests sent one after another, round robin over ``urls`` (each with its own user), until the end of
    the block; a failed request (the candidate's injected faults) is just counted."""
    stop = asyncio.Event()

    async def run():
        async with httpx.AsyncClient(timeout=30) as c:
            i = 0
            while not stop.is_set():
                url = urls[i % len(urls)]
                try:
                    await c.post(url + "/v1/chat/completions", json={
                        "model": "m1", "user": f"u{i}", "messages": [{"role": "user", "content": "hi"}]})
                except httpx.HTTPError:
                    pass
                i += 1

    task = asyncio.create_task(run())
    try:
        yield
    finally:
        stop.set()
        await task


async def rollout(c) -> dict | None:
    """Rollout r1 as the admin API shows it; None before the controller's first tick started it, and while the
    API answers 503 (this replica's Redis calls timed
    out, as they may on a loaded machine: the rollouts wait for Redis, and so does the client)."""
    resp = await c.get("/admin/rollouts")
    if resp.status_code == 503:
        return None
    return next((r for r in resp.json()["rollouts"] if r["name"] == "r1"), None)   # None: not started yet


async def admin(c, method: str, path: str, **kw) -> httpx.Response:
    """An admin API call, again while it answers 503 ``redis_unavailable`` (this replica's Redis calls timed out
    under the machine's load, as ``rollout`` allows), up to 15 s."""
    end = asyncio.get_running_loop().time() + 15
    while True:
        resp = await c.request(method, path, **kw)
        if resp.status_code != 503 or asyncio.get_running_loop().time() > end:
            return resp
        await asyncio.sleep(0.1)


async def until_state(c, pred, timeout=60.0) -> dict:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        r = await rollout(c)
        if r is not None and pred(r):
            return r
        await asyncio.sleep(0.05)
    raise AssertionError(f"rollout not there: {await rollout(c)}")


def cand_weight(gw) -> float:
    return {t.id: t.weight for t in gw.snapshot.compiled.policy.routes["main"].targets}["cand"]


async def test_a_healthy_candidate_is_promoted_by_two_replicas_one_restarted(redis_url):
    gates = "{parity_min: 0.99, error_rate_max: 0.05, ttft_p95_max_ms: 5000, min_compared: 3}"
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        text = config(stable, cand, redis_url, 1.0, gates)
        async with gateway(text) as (gw_b, url_b, cb):
            async with gateway(text) as (gw_a, url_a, ca):
                async with load([url_a, url_b]):
                    await until_state(ca, lambda r: r["step_index"] == 1)
            assert cand_weight(gw_b) in (25.0, 100.0)
            async with gateway(text) as (gw_a2, url_a2, ca2):         # replica A again, mid-rollout
                async with load([url_a2, url_b]):
                    r = await until_state(ca2, lambda r: r["state"] == "promoted")
                await asyncio.sleep(0.3)                           # B's sync loop reads the last version
                weights = (cand_weight(gw_a2), cand_weight(gw_b))
                history = (await ca2.get("/admin/config")).json()["history"]
    assert [(h["weight"], h["state"]) for h in r["history"]] == [(5, "running"), (25, "running"), (100, "running"),
                                                                  (100, "promoted")]
    assert weights == (100.0, 100.0)
    # one config version per step: the weights changes were made once each, by one replica
    assert [h["overrides"]["main"]["cand"] for h in reversed(history) if h["source"] == "rollout r1"] == [5, 25, 100]
    assert r["parity"]["exact_share"] == 1.0 and r["parity"]["candidate"]["error_rate"] == 0


# each case checks its own gate only: a loaded machine slows every answer, and a candidate must be rolled back for
# its own fault (its TTFT is at least the injected delay, whatever the load)
@pytest.mark.parametrize("fault,gate,limit", [({"status": 500}, "error_rate_max", 0.2),
                                              ({"delay": 0.5}, "ttft_p95_max_ms", 200),
                                              ({"chunks": 6}, "parity_min", 0.99)])
async def test_a_failing_candidate_is_rolled_back_naming_the_gate(redis_url, fault, gate, limit, caplog):
    gates = f"{{{gate}: {limit}, min_compared: 3}}"
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        cand.set_default(fault)
        async with gateway(config(stable, cand, redis_url, 0.5, gates)) as (gw, url, c):
            async with load([url]):
                r = await until_state(c, lambda r: r["state"] != "running")
            weight = cand_weight(gw)
    assert r["state"] == "rolled_back" and r["weight"] == 0 and weight == 0
    assert f"gate {gate}" in r["reason"] and r["history"][-1]["reason"] == r["reason"]
    assert [h["weight"] for h in r["history"]] == [5, 0]
    # the gates shown are the judgement that rolled it back, not an empty judgement of the step it fell back to
    assert r["gates"][gate]["ok"] is False and r["gates"][gate]["value"] is not None
    # an unattended rollback is a warning, for log-based alerts (an ops trial found it at INFO)
    assert [x.levelname for x in caplog.records if "r1: rolled_back" in x.getMessage()] == ["WARNING"]


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "in-process"])
async def test_operators_pause_resume_promote_abort_and_illegal_actions(redis_url, shared):
    gates = "{error_rate_max: 0.5, min_compared: 1000}"             # never judged: only operators move it
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        async with gateway(config(stable, cand, redis_url if shared else None, 60, gates)) as (gw, url, c):
            await until_state(c, lambda r: True)
            assert (await c.post("/admin/rollouts/r1/pause")).json()["state"] == "paused"
            busy = await c.post("/admin/rollouts", json={"name": "r3", "route": "main", "candidate": "stable"})
            slashed = await c.post("/admin/rollouts", json={"name": "a/b", "route": "main", "candidate": "cand"})
            await c.post("/admin/weights", json={"route": "main", "weights": {"cand": 7, "stable": 93}})
            await asyncio.sleep(0.3)                                 # ticks: a paused rollout leaves them
            assert cand_weight(gw) == 7
            assert (await c.post("/admin/rollouts/r1/pause")).status_code == 409
            assert (await c.post("/admin/rollouts/r1/resume")).json()["state"] == "running"
            assert cand_weight(gw) == 5                              # the step's weight again
            promoted = (await c.post("/admin/rollouts/r1/promote")).json()
            refused = await c.post("/admin/rollouts/r1/abort")
            assert refused.status_code == 409     # and it names what the state allows (a trial read "it is promoted")
            assert refused.json()["error"]["message"].endswith("it is promoted (it can: release)"), refused.text
            assert (await c.post("/admin/rollouts/nope/pause")).status_code == 404
            bad = await c.post("/admin/rollouts", json={"name": "r2", "route": "main", "candidate": "ghost"})
            taken = await c.post("/admin/rollouts", json={"name": "r1", "route": "main", "candidate": "cand"})
            held = await c.post("/admin/rollouts", json={"name": "r2", "route": "main", "candidate": "stable"})
            released = await c.post("/admin/rollouts/r1/release")    # its split stays, an override now
            r2 = await c.post("/admin/rollouts", json={"name": "r2", "route": "main", "candidate": "stable",
                                                       "steps": [50], "hold_s": 1})
            aborted = (await admin(c, "POST", "/admin/rollouts/r2/abort")).json()
            weights = {t.id: t.weight for t in gw.snapshot.compiled.policy.routes["main"].targets}
            unauth = await httpx.AsyncClient(base_url=url).get("/admin/rollouts")
            store, loaded = gw.rollouts.store, []
            real_load = store.load
            store.load = lambda name: loaded.append(name) or real_load(name)
            await gw.rollouts.tick()                                 # both finished: neither read per tick
            store.load = real_load
            listed = sorted(r["name"] for r in (await c.get("/admin/rollouts")).json()["rollouts"])
    assert promoted["state"] == "promoted" and promoted["weight"] == 100
    assert bad.status_code == 400 and "ghost" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "candidate"      # the field at fault (an operator's trial read "route")
    assert taken.status_code == 409 and taken.json()["error"]["code"] == "rollout_exists"
    assert "'r1' exists (promoted)" in taken.json()["error"]["message"] and "another name" in taken.json()["error"]["message"]
    # a promoted rollout holds its route until released
    assert held.status_code == 409 and "'r1' (promoted)" in held.json()["error"]["message"]
    assert released.status_code == 200 and released.json()["state"] == "released", released.text
    assert r2.status_code == 201 and r2.json()["baseline"] == "cand" and r2.json()["weight"] == 50
    assert aborted["state"] == "aborted" and weights == {"stable": 0.0, "cand": 100.0}
    assert unauth.status_code == 401
    assert loaded == [] and listed == ["r1", "r2"]        # finished rollouts: listed, never loaded by a tick
    # a paused rollout still steers its route: a second one is refused, naming it; names are one path segment
    assert busy.status_code == 409 and "'r1'" in busy.json()["error"]["message"]
    assert slashed.status_code == 400 and slashed.json()["error"]["param"] == "name"


async def test_a_rollout_without_gates_says_it_was_promoted_on_time_alone(redis_url):
    """A rollout started with no gates moves on its hold alone; a console trial read "every gate held 1 s at each
    step" of one that judged nothing."""
    gates = "{error_rate_max: 0.5, min_compared: 1000}"
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        async with gateway(config(stable, cand, redis_url, 60, gates)) as (gw, url, c):
            await until_state(c, lambda r: True)
            await c.post("/admin/rollouts/r1/abort")
            started = await c.post("/admin/rollouts", json={"name": "bare", "route": "main", "candidate": "cand",
                                                            "steps": [5, 50], "hold_s": 0.2, "gates": {}})
            assert started.status_code == 201, started.text
            for _ in range(600):
                listed = (await admin(c, "GET", "/admin/rollouts")).json()["rollouts"]
                r = next(x for x in listed if x["name"] == "bare")
                if r["state"] != "running":
                    break
                await asyncio.sleep(0.05)
    assert r["state"] == "promoted", r
    assert [h["reason"] for h in r["history"]][1].startswith("no gates: held")
    assert r["reason"] == "no gates: each step held 0.2 s at each step"


async def ctl(url: str, *argv: str) -> tuple[int, str]:
    """``tandem ctl --url URL argv...`` as a subprocess (asynchronously: the gateway serves in this loop)."""
    import os
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "ctl", "--url", url, *argv, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, "TANDEM_ADMIN_TOKEN": ADMIN_TOKEN})
    out, _ = await proc.communicate()
    return proc.returncode, out.decode()


async def test_tandem_ctl_rollout_starts_steers_and_reports(redis_url):
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        text = two_upstreams(stable, cand, extra=f"state: {{redis_url: '{redis_url}', key_prefix: "
                             f"c{uuid.uuid4().hex[:8]}}}\n", route_extra="    shadow: {target: cand}\n")
        async with gateway(text) as (gw, url, c):
            started = await ctl(url, "rollout", "start", "r9", "main", "cand", "--steps", "10,100", "--hold-s", "600",
                                "--gate", "parity_min=0.9", "--gate", "min_compared=2")
            async with httpx.AsyncClient(timeout=30) as h:
                for i in range(2):
                    await h.post(url + "/v1/chat/completions", json={
                        "model": "m1", "user": f"u{i}", "messages": [{"role": "user", "content": "hi"}]})
            loop = asyncio.get_running_loop()
            end = loop.time() + 15
            while (await admin(c, "GET", "/admin/parity")).json()["reports"]["r9"]["compared"] < 2 \
                    and loop.time() < end:
                await asyncio.sleep(0.05)
            status = await ctl(url, "rollout", "status")
            paused = await ctl(url, "rollout", "pause", "r9")
            taken = await ctl(url, "rollout", "start", "r9", "main", "cand")   # the name of a paused one
            again = await ctl(url, "rollout", "pause", "r9")
            early = await ctl(url, "rollout", "release", "r9")          # only a promoted rollout is released
            await ctl(url, "rollout", "promote", "r9")
            released = await ctl(url, "rollout", "release", "r9")
    assert started[0] == 0 and "rollout r9: running, route main: cand 10 %" in started[1]
    assert "warning" not in started[1], started[1]
    assert status[0] == 0 and "gate parity_min: 1 (limit 0.9): holds" in status[1], status[1]
    assert "parity (statistical): 2/2 pairs compared" in status[1] and "shadow shadow/main:" in status[1]
    assert paused[0] == 0 and "rollout r9: paused" in paused[1]
    assert again[0] == 1 and "409" in again[1]
    assert taken[0] == 1 and "'r9' exists (paused)" in taken[1] and "tandem ctl rollout resume r9" in taken[1]
    assert "another name" in taken[1], taken[1]
    assert early[0] == 1 and "409" in early[1]
    assert released[0] == 0 and "rollout r9: released" in released[1], released[1]


async def test_a_redis_outage_neither_restarts_nor_moves_a_rollout(redis_url):
    """While this replica's shared state is degraded (Redis unreachable: a timeout under load was enough), its
    controller took the lease in process, found no rollout there, started the configured one again at its first
    step and set that step's weight through the config ledger (the promotion test's extra 5 % versions). Now the
    rollouts wait for Redis: a tick acts on nothing, the rollouts admin API answers 503."""
    from gateway.state import StateUnavailable

    gates = "{error_rate_max: 0.5, min_compared: 1000}"             # never judged: only the operator moves it
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        text = config(stable, cand, redis_url, 60, gates).replace("sync_interval_s: 0.1}",
                                                                   "sync_interval_s: 0.1, reconnect_min_s: 600}")
        async with gateway(text) as (gw, url, c):
            await until_state(c, lambda r: True)
            assert (await c.post("/admin/rollouts/r1/promote")).json()["state"] == "promoted"
            versions = len((await c.get("/admin/config")).json()["history"])
            gw.resilience.state._mark_degraded(ConnectionError("injected outage"))   # no reconnect for 600 s
            with pytest.raises(StateUnavailable):
                await gw.rollouts.tick()
            listed = await c.get("/admin/rollouts")
            paused = await c.post("/admin/rollouts/r1/pause")
            history = (await c.get("/admin/config")).json()["history"]
            weight = cand_weight(gw)
    assert weight == 100.0 and len(history) == versions
    assert listed.status_code == 503 and listed.json()["error"]["code"] == "redis_unavailable"
    assert paused.status_code == 503


async def test_a_rollout_started_onto_a_down_candidate_says_so():
    """The candidate's backend refuses connections and its health probe found it down: the rollout starts (as any
    weight change is applied) and its answer, and ``tandem ctl rollout start``'s output, warn that its first step
    sends traffic there; an up candidate gets no warning (the ctl test above)."""
    import socket

    # a port bound, never listening, for the whole test: the candidate is down, and no other test's server can
    # take the port (freed, it can be reused)
    with socket.socket() as s, FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
        text = two_upstreams(stable, cand).replace(cand.base_url, dead).replace(
            "health: {interval_s: 0}", "health: {interval_s: 0.1}")
        async with gateway(text) as (gw, url, c):
            loop = asyncio.get_running_loop()
            end = loop.time() + 15
            snap = gw.snapshot
            while (await gw.resilience.status(snap.compiled.policy.routes, snap.backends))[0]["cand"]["available"]:
                assert loop.time() < end, "the probe never found the candidate down"
                await asyncio.sleep(0.05)
            code, out = await ctl(url, "rollout", "start", "r8", "main", "cand", "--steps", "10,100")
            listed = (await c.get("/admin/rollouts")).json()["rollouts"]
    assert code == 0 and "rollout r8: running" in out, out
    assert "warning: rollouts.r8: its candidate 'cand' is on backend 'cand', found down now (last probe failed" \
        in out and "the first step sends 10 % of route 'main' there" in out, out
    assert [r["name"] for r in listed] == ["r8"]


def test_a_rollout_is_refused_where_weights_do_not_steer_the_route():
    # a trial's rollout on a select: cheapest route was accepted: "fb 5 %" while every request went to the
    # cheaper target, and its abort left the candidate a spare (weight 0)
    from gateway.config.compile import load_config_text
    from gateway.config.schema import RolloutConfig
    from gateway.rollouts.spec import rollout_problems

    class Up:
        base_url = "http://127.0.0.1:9/v1"

    cheap = "  cheap:\n    select: cheapest\n    targets: [{backend: stable}, {backend: cand}]\n"
    routes = load_config_text(two_upstreams(Up, Up, route_extra=cheap)).policy.routes
    problems = rollout_problems("rollout", RolloutConfig(route="cheap", candidate="cand"), routes)
    assert [p for p, _ in problems] == ["rollout.route"] and "picks its target by cheapest" in problems[0][1]
    assert rollout_problems("rollout", RolloutConfig(route="main", candidate="cand"), routes) == []


async def test_a_refused_rollout_body_says_the_validators_sentence():
    # the console's form showed pydantic's "Value error, steps must be ..." (an ops trial)
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        async with gateway(two_upstreams(stable, cand)) as (gw, url, c):
            r = await c.post("/admin/rollouts", json={"name": "r9", "route": "main", "candidate": "cand",
                                                      "steps": [50, 20]})
            huge = await c.post("/admin/rollouts", json={"name": "r9", "route": "main", "candidate": "cand",
                                                         "hold_s": 1e308})
    assert r.status_code == 400 and r.json()["error"]["param"] == "steps", r.text
    assert r.json()["error"]["message"] == "steps: steps must be increasing percentages in (0, 100]", r.text
    # a hold of 1e308 s was taken, and the console printed its 300 digits (a security trial)
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "hold_s", huge.text


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "in-process"])
async def test_rollouts_started_at_once_on_one_route_give_one_rollout(redis_url, shared):
    # an ops trial: six concurrent POST /admin/rollouts on one route over two replicas all got 201, and six
    # controllers fought over the split (the busy check read the live rollouts, then saved by name only)
    state = (f"state: {{redis_url: '{redis_url}', key_prefix: r{uuid.uuid4().hex[:8]}, sync_interval_s: 0.1}}\n"
             if shared else "")
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        text = two_upstreams(stable, cand, extra=state)
        async with gateway(text) as (gw_a, url_a, ca), gateway(text) as (gw_b, url_b, cb):
            clients = [ca, cb] if shared else [ca]
            answers = await asyncio.gather(*(
                clients[i % len(clients)].post("/admin/rollouts", json={
                    "name": f"race{i}", "route": "main", "candidate": "cand", "steps": [5, 50], "hold_s": 60})
                for i in range(6)))
            listed = (await ca.get("/admin/rollouts")).json()["rollouts"]
            winner = next(r["name"] for r in listed)
            aborted = await ca.post(f"/admin/rollouts/{winner}/abort")
            again = await clients[-1].post("/admin/rollouts", json={"name": "after", "route": "main",
                                                                     "candidate": "cand"})
    assert sorted(a.status_code for a in answers) == [201] + [409] * 5, [a.text for a in answers]
    assert {a.json()["error"]["code"] for a in answers if a.status_code == 409} == {"route_has_rollout"}
    assert [r["state"] for r in listed] == ["running"]
    # the route is free again once the one rollout ends
    assert aborted.json()["state"] == "aborted" and again.status_code == 201, again.text


async def test_a_rollout_that_starts_its_candidate_lower_says_so():
    # an ops trial: a rollout started on a canary an operator had at 12 % (and another at 100 %) set it to the first
    # step's 5 % without a word; the split is the rollout's from its first step, and its answer now says so
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        async with gateway(two_upstreams(stable, cand)) as (gw, url, c):
            await c.post("/admin/weights", json={"route": "main", "weights": {"cand": 12, "stable": 88}})
            lowered = await c.post("/admin/rollouts", json={"name": "r1", "route": "main", "candidate": "cand",
                                                            "steps": [5, 100], "hold_s": 60})
            await c.post("/admin/rollouts/r1/abort")
            raised = await c.post("/admin/rollouts", json={"name": "r2", "route": "main", "candidate": "cand",
                                                           "steps": [50, 100], "hold_s": 60})
    assert lowered.status_code == 201 and lowered.json()["warnings"] == [
        "rollouts.r1: its candidate 'cand' had 12 % of route 'main'; the rollout starts it at its first step, 5 %"]
    assert raised.status_code == 201 and raised.json()["warnings"] == []
