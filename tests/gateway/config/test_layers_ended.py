"""What a rollout leaves when it ends, and the file digest the watcher compares (a new user's trial on
config.example.yaml, each reproduced there 2-3 times): an aborted rollout's weights shown as an operator's override
that a reload kept; a ``ctl rollback`` after an abort bringing the aborted canary back; a saved edit never applied
by the watcher after a no-change reload and a rollout; a no-change reload relabelling the running version. Real
parts: gateways in this process reading a config file on disk, the admin API over HTTP, the versions in process and
on a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest

from gateway.config.layers import reapply
from gateway.config.rollback import without_ended
from gateway.commands import _version_summary
from gateway.config.versions import ConfigState, text_digest
from tests.gateway.config.test_layers import served, text, weights
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.rollouts.conftest import ADMIN_TOKEN

START = {"name": "r1", "route": "ro", "candidate": "cand", "steps": [5, 100], "hold_s": 30,
         "check_interval_s": 0.05, "gates": {"min_compared": 1000}}


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", ADMIN_TOKEN)


@pytest.fixture(params=["memory", "redis"])
def state(request) -> str:
    """The config lines that put the versions and rollouts in process, or on a real Redis (a fresh prefix)."""
    if request.param == "memory":
        return ""
    url = request.getfixturevalue("redis_url")
    return f"state: {{redis_url: '{url}', key_prefix: e{uuid.uuid4().hex[:8]}, sync_interval_s: 0.05}}\n"


@contextlib.contextmanager
def upstreams():
    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        yield stable, cand


async def eventually(pred, timeout: float = 20.0) -> bool:
    """Whether ``pred()`` turns true within ``timeout`` seconds (the file watcher polls every 0.05 s)."""
    end = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > end:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_an_aborted_rollout_leaves_the_file_deciding_its_route(tmp_path, state):
    """Abort put the route back at the file's weights, but as an override shown ``[operator]`` (no operator set
    it), which a reload with the same file kept: the route is the file's again, no override left."""
    with upstreams() as (stable, cand):
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, rollout=state))
        async with served(path) as (gw, c):
            assert (await c.post("/admin/rollouts", json=START)).status_code == 201
            assert weights(gw) == {"stable": 95.0, "cand": 5.0}
            assert (await c.post("/admin/rollouts/r1/abort")).status_code == 200
            after_abort = (await c.get("/admin/config")).json()
            reload = (await c.post("/admin/reload")).json()
    assert weights(gw) == {"stable": 100.0, "cand": 0.0}
    assert after_abort["layers"]["ro"]["decided_by"] == "file", after_abort["layers"]["ro"]
    assert "ro" not in after_abort["overrides"] and after_abort["file"]["status"] == "in sync"
    assert reload["layers"]["ro"]["decided_by"] == "file", reload["layers"]["ro"]


def test_a_split_an_ended_rollout_left_is_labelled_as_its_own_and_goes_when_the_file_says_the_same():
    """A gate rollback to 5 % leaves an override that is the rollout's (``owners``), not an operator's; a reload
    whose file says 95/5 drops it, one that left the route alone keeps it under the rollout's name."""
    file = {"ro": {"A": 100.0, "B": 0.0}}
    left = {"ro": {"B": 5.0, "A": 95.0}}
    rolled_back = {"name": "r1", "route": "ro", "candidate": "B", "baseline": "A", "state": "rolled_back",
                   "weight": 5.0}
    kept = reapply(file, file, left, [rolled_back], set(), owners={"ro": "r1"})
    same = reapply(file, {"ro": {"A": 95.0, "B": 5.0}}, left, [rolled_back], set(), owners={"ro": "r1"})
    assert kept.routes["ro"]["decided_by"] == "rollout r1 (rolled_back)" and kept.overrides == left
    assert "rollout r1 (rolled_back) holds B 5, A 95" in kept.routes["ro"]["note"] and kept.owners == {"ro": "r1"}
    assert same.overrides == {} and same.routes.get("ro", {}).get("decided_by", "file") == "file"
    operator = reapply(file, file, left, [rolled_back], set())          # set by hand: still the operator's
    assert operator.routes["ro"]["decided_by"] == "operator"


async def test_a_rollback_after_an_abort_does_not_bring_the_canary_back(tmp_path, state):
    """``ctl rollback`` right after an abort returned to the version with the aborted rollout's 5 % split: its
    candidate got traffic again. The rollback undoes config changes, not the rollout's end: the route keeps the
    weights it has, and the answer says so."""
    with upstreams() as (stable, cand):
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, rollout=state))
        async with served(path) as (gw, c):
            assert (await c.post("/admin/rollouts", json=START)).status_code == 201
            assert (await c.post("/admin/rollouts/r1/abort")).status_code == 200
            back = await c.post("/admin/rollback", json={})
            layer = (await c.get("/admin/config")).json()["layers"]["ro"]
            head = await gw.ledger.head()
    assert back.status_code == 200, back.text
    assert weights(gw) == {"stable": 100.0, "cand": 0.0} and head.overrides.get("ro") is None
    assert any("rollout r1's split (cand 5, stable 95), which is not brought back: the rollout is aborted" in w
               for w in back.json()["warnings"]), back.json()["warnings"]
    assert layer["decided_by"] != "operator", layer


async def test_a_rollback_after_an_abort_and_a_file_edit_keeps_the_weights_the_route_has(tmp_path, state, caplog):
    """README's story 3 (a new user's trial): the file says 95/5, a rollout started and aborted leaves 100/0 (its
    own override: not the file's), the file is edited to 100/0 (that override goes), then ``ctl rollback``: it
    returned to the version with the aborted rollout's override, dropped that override and so ran the old file's
    95/5, the canary back at 5 %. Returned to as stored, that version gives the route what it has now (100/0, the
    aborted rollout's own override over the old file): it stays so, and nothing is said to be kept."""
    with upstreams() as (stable, cand):
        path = tmp_path / "c.yaml"
        b = text(stable, cand, rollout=state)
        a = b.replace("weight: 100}, {backend: cand, weight: 0}", "weight: 95}, {backend: cand, weight: 5}")
        path.write_text(a)
        async with served(path) as (gw, c):
            assert (await c.post("/admin/rollouts", json=START)).status_code == 201
            assert (await c.post("/admin/rollouts/r1/abort")).status_code == 200
            assert weights(gw) == {"stable": 100.0, "cand": 0.0}
            path.write_text(b)                                            # the README's sed
            assert (await c.post("/admin/reload")).status_code == 200
            assert "ro" not in (await gw.ledger.head()).overrides
            edited = (await gw.ledger.head()).version
            with caplog.at_level("INFO", logger="tandem.gateway"):
                back = await c.post("/admin/rollback", json={})
            after = weights(gw)
            status = (await c.get("/admin/config")).json()
    assert back.status_code == 200, back.text
    # the log says nothing changed in effect (the old text's weights, under the override, not in effect); status
    # names what the disk says
    applied = [r.getMessage() for r in caplog.records if " applied (rollback)" in r.getMessage()]
    assert applied and applied[-1].endswith("(rollback): route ro: cand 0 -> 5, stable 100 -> 95 in the config "
                                            "text, not in effect (an override holds the route)"), applied
    said = f"config rollback: version {back.json()['version']} returns to version {edited - 1}"
    assert said in [r.getMessage() for r in caplog.records], [r.getMessage() for r in caplog.records]
    assert "the file on disk says stable 100, cand 0" in status["layers"]["ro"]["note"], status["layers"]["ro"]
    assert after == {"stable": 100.0, "cand": 0.0}, (after, back.json()["warnings"])
    assert not any("rollout r1's split" in w for w in back.json()["warnings"]), back.json()["warnings"]
    layer = status["layers"]["ro"]
    assert layer["effective"] == {"stable": 100.0, "cand": 0.0} and layer["decided_by"] == "rollout r1 (aborted)", layer


async def test_a_rollback_undoes_an_operators_change_made_after_an_abort(tmp_path, state):
    """An ops trial: weights, a rollout started and aborted (its 0 % split: not the file's), then an operator's
    40/60, then ``ctl rollback``: it kept 40/60, saying the aborted rollout's split is not brought back, though that
    split is what the abort left. It returns to it now."""
    with upstreams() as (stable, cand):
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, rollout=state).replace("weight: 100}, {backend: cand, weight: 0}",
                                                                  "weight: 95}, {backend: cand, weight: 5}"))
        async with served(path) as (gw, c):
            assert (await c.post("/admin/rollouts", json=START)).status_code == 201
            assert (await c.post("/admin/rollouts/r1/abort")).status_code == 200
            assert weights(gw) == {"stable": 100.0, "cand": 0.0}                # what the abort left
            changed = await c.post("/admin/weights", json={"route": "ro", "weights": {"stable": 40, "cand": 60}})
            assert changed.status_code == 200, changed.text
            back = await c.post("/admin/rollback", json={})
    assert back.status_code == 200, back.text
    assert weights(gw) == {"stable": 100.0, "cand": 0.0}, back.json()
    assert not any("not brought back" in w for w in back.json()["warnings"]), back.json()["warnings"]


def _state(text: str, overrides: dict | None = None, owners: dict | None = None) -> ConfigState:
    return ConfigState(text, overrides or {}, "test", owners=owners or {})


def test_a_rollback_keeps_the_weights_a_route_has_where_returning_would_bring_an_ended_split_back():
    """Per route of the version returned to that holds an ended rollout's override: the weights the route has at
    the head (its override, else its file weights) stay, as an override over the old file where they differ from
    it, and the warning names them; a route whose weights returning would not change is returned as stored."""
    with upstreams() as (stable, cand):
        plain = text(stable, cand)                                          # ro: stable 100, cand 0
        old = plain.replace("weight: 100}, {backend: cand, weight: 0}", "weight: 95}, {backend: cand, weight: 5}")
        edited = plain.replace("weight: 100}, {backend: cand, weight: 0}", "weight: 90}, {backend: cand, weight: 10}")
    aborted = [{"name": "r1", "route": "ro", "candidate": "cand", "baseline": "stable", "state": "aborted",
                "weight": 0.0}]                                      # an abort leaves the candidate at 0 %
    running_split = _state(plain, {"ro": {"cand": 5.0, "stable": 95.0}}, {"ro": "r1"})   # r1 at 5 %, since aborted
    # aborted right after: the head is the file (100/0): no override needed over the same file
    state, warnings = without_ended(_state(plain), running_split, aborted)
    assert state.overrides == {} and state.owners == {}
    assert warnings == ["route ro: the version rolled back to holds rollout r1's split (cand 5, stable 95), which is "
                        "not brought back: the rollout is aborted; the route keeps stable 100, cand 0"]
    # the file changed the route since (90/10): kept over the old file's 95/5 as an override
    running_old = _state(old, {"ro": {"cand": 25.0, "stable": 75.0}}, {"ro": "r1"})
    state, warnings = without_ended(_state(edited), running_old, aborted)
    assert state.overrides == {"ro": {"stable": 90.0, "cand": 10.0}} and state.owners == {}
    assert warnings[0].endswith("the route keeps stable 90, cand 10")
    # the version returned to holds what the abort left (0/100): returning to it undoes the change after it (a
    # file edit, an operator's 40/60: an ops trial's rollback kept 40/60, saying the abort's split is not brought
    # back)
    left = _state(old, {"ro": {"cand": 0.0, "stable": 100.0}}, {"ro": "r1"})
    assert without_ended(_state(edited), left, aborted) == (None, [])
    assert without_ended(_state(plain, {"ro": {"stable": 60.0, "cand": 40.0}}), left, aborted) == (None, [])
    # an operator's weights at the head (80/20) are kept with the head's owners (none)
    state, _ = without_ended(_state(plain, {"ro": {"stable": 80.0, "cand": 20.0}}), running_split, aborted)
    assert state.overrides == {"ro": {"stable": 80.0, "cand": 20.0}}
    # the file edited to what the aborted rollout left (the README's story): returned as stored
    assert without_ended(_state(plain), left, aborted) == (None, [])


async def test_an_edit_back_to_the_text_last_applied_is_applied_after_a_rollback_and_a_rollout(tmp_path, state):
    """The trial's sequence: the file applied at 100/0 (its text ``b``), ``ctl rollback`` (to ``a``, 95/5), the
    file put back to ``a`` (the watcher: no change), ``ctl reload``, a rollout started and paused, the file edited to
    ``b``: never applied. The no-change pushes left ``b``'s digest on the shared head, the rollout's push carried
    it back, and the watcher took the edit for a touch."""
    with upstreams() as (stable, cand):
        path = tmp_path / "c.yaml"
        watch = "reload: {watch: true, poll_interval_s: 0.05}\n"
        a = text(stable, cand, rollout=state).replace("reload: {watch: false}\n", watch)
        a = a.replace("weight: 100}, {backend: cand, weight: 0}", "weight: 95}, {backend: cand, weight: 5}")
        b = text(stable, cand, rollout=state).replace("reload: {watch: false}\n", watch)
        path.write_text(a)
        async with served(path) as (gw, c):
            path.write_text(b)
            assert await eventually(lambda: gw.snapshot.compiled.text == b)
            assert (await c.post("/admin/rollback", json={})).status_code == 200
            path.write_text(a)                                            # git checkout
            version = gw.snapshot.version
            assert await eventually(lambda: gw.file_digest == text_digest(a))   # the watcher read it
            assert (await c.post("/admin/reload")).status_code == 200
            assert gw.snapshot.version == version
            assert (await c.post("/admin/rollouts", json=START)).status_code == 201
            assert (await c.post("/admin/rollouts/r1/pause")).status_code == 200
            path.write_text(b)                                            # the README's sed
            applied = await eventually(lambda: gw.snapshot.compiled.text == b)
            status = (await c.get("/admin/config")).json()["file"]["status"]
    assert applied, f"the edit was not applied: file {status!r}"


async def test_a_reload_that_changes_nothing_keeps_the_versions_source(tmp_path, state):
    """``ctl reload`` with nothing changed answered the same version with a new source ("11 (file)" became
    "11 (admin)"): nothing was applied, so the running version's source stays."""
    with upstreams() as (stable, cand):
        path = tmp_path / "c.yaml"
        path.write_text(text(stable, cand, rollout=state))
        async with served(path) as (gw, c):
            await c.post("/admin/weights", json={"route": "other", "weights": {"stable": 50}})
            before = (await c.get("/admin/config")).json()
            again = (await c.post("/admin/weights", json={"route": "other", "weights": {"stable": 50}})).json()
            reload = (await c.post("/admin/reload")).json()
            path.write_text(path.read_text())
            reload2 = (await c.post("/admin/reload")).json()
    assert (before["version"], before["source"]) == (2, "weights")
    for answer in (again, reload, reload2):
        assert (answer["version"], answer["source"]) == (2, "weights"), answer
        # and ctl says so (a new user read the previous version's header as a new one)
        head = _version_summary(answer).splitlines()[0]
        assert answer["unchanged"] is True and head.startswith("config version 2 (weights)") and head.endswith(
            ": unchanged, the change is the config it runs"), head


async def test_a_watched_edit_that_would_orphan_a_rollout_is_refused_without_a_traceback(tmp_path, caplog):
    """An ops trial: the watcher's reload refused an edit that took a promoted rollout's candidate out (right),
    then logged "reload on file change failed" with a RolloutConflict traceback, where SIGHUP and the admin API
    log the one refusal line."""
    with upstreams() as (stable, cand):
        path = tmp_path / "c.yaml"
        watch = "reload: {watch: true, poll_interval_s: 0.05}\n"
        path.write_text(text(stable, cand).replace("reload: {watch: false}\n", watch))
        async with served(path) as (gw, c):
            assert (await c.post("/admin/rollouts", json=START)).status_code == 201
            assert (await c.post("/admin/rollouts/r1/promote")).status_code == 200
            caplog.clear()
            path.write_text(text(stable, cand, cand_in_file=False).replace("reload: {watch: false}\n", watch))
            status = ""
            while not status.startswith("file not applied"):
                await asyncio.sleep(0.05)
                status = (await c.get("/admin/config")).json()["file"]["status"]
    assert "rollout r1" in status, status
    refusals = [r for r in caplog.records if "refused, keeping version" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].exc_info is None
    assert not [r for r in caplog.records if r.exc_info is not None], [r.getMessage() for r in caplog.records]
