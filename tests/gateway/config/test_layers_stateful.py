"""The layers of a route's weights under random operator sequences (issue 47's property test): two gateway
replicas on one real Redis and one config file, driven by hypothesis's rule-based state machine through file edits
with reloads (unrelated ones, ones that change or remove the rollout's candidate, with and without
``abort_rollouts`` or ``release``), ``ctl weights`` changes, rollout start, pause, resume, promote, abort and
release, and replica restarts. After every step both replicas' effective weights must equal a small reference
model written from the precedence rules (docs/operators/desired-state.md): file < operator
override < rollout (running, paused, promoted). A refused change must name why (the rollout it would undo).

The rollouts' gates are never judged (``min_compared`` out of reach), so only operators and reloads move them and
the run is deterministic: a fixed seed, a bounded number of examples and steps, no shrinking (a failure prints its
steps as found). On the code before the layers (a reload reset the weights to the file's), it finds the issue's
failures 1 (a reload undoes a promotion) and 2 (a reload orphaning a running rollout's candidate is accepted)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gateway.config.compile import load_config_text
from gateway.config.layers import RolloutConflict
from gateway.runtime import Gateway

HOLDING = ("running", "paused", "promoted")


def config_text(prefix: str, redis_url: str, file: dict) -> str:
    """The config file: route ``ro`` (stable, and cand unless removed) and route ``other`` (stable)."""
    cand = f", {{backend: cand, weight: {file['cand']}}}" if file["cand"] is not None else ""
    return (f"state: {{redis_url: '{redis_url}', key_prefix: {prefix}, sync_interval_s: 0.02, socket_timeout_s: 2}}\n"
            "reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\n"
            "models:\n  - name: m1\n"
            "backends:\n  stable:\n    type: openai\n    base_url: http://127.0.0.1:9/v1\n"
            "  cand:\n    type: openai\n    base_url: http://127.0.0.1:9/v1\n"
            f"routes:\n  ro:\n    targets: [{{backend: stable, weight: {file['stable']}}}{cand}]\n"
            + ("    release: true\n" if file["release"] else "") +
            f"  other:\n    targets: [{{backend: stable, weight: {file['other']}}}]\n"
            "policy:\n  default_route: ro\n")


def file_weights(file: dict) -> dict[str, dict[str, float]]:
    ro = {"stable": float(file["stable"])}
    if file["cand"] is not None:
        ro["cand"] = float(file["cand"])
    return {"ro": ro, "other": {"stable": float(file["other"])}}


class Model:
    """The precedence rules, written small: the file as last applied, an operator override per route, and at
    most one rollout (on ``ro``) with its state and weight."""

    def __init__(self, file: dict):
        self.file = file
        self.override: dict[str, dict[str, float]] = {}
        self.rollout: dict | None = None      # {"name", "state", "weight"}

    def holds(self) -> bool:
        return self.rollout is not None and self.rollout["state"] in HOLDING

    def effective(self) -> dict[str, dict[str, float]]:
        out = file_weights(self.file)
        for route, w in self.override.items():
            out[route] = {**out[route], **w}
        if self.holds() and self.rollout["state"] != "paused":   # paused: the operator has its weights
            w = self.rollout["weight"]
            out["ro"] = {**out["ro"], "cand": w, "stable": 100.0 - w}
        return out

    def reload(self, new: dict, abort: bool) -> str:
        """The reload's outcome: "" when applied (the model updated), else why it must be refused."""
        old_w, new_w = file_weights(self.file), file_weights(new)
        if self.holds():
            orphan = new["cand"] is None
            if not new["release"] and orphan and not abort:
                return self.rollout["name"]
            if new["release"] or orphan:     # the file takes the route back: the rollout ends
                self.rollout["state"] = "released" if self.rollout["state"] == "promoted" else "aborted"
                self.override.pop("ro", None)
            elif self.rollout["state"] == "paused":
                pass                          # the paused rollout's weights (an operator's) stand
        for route in list(self.override):
            if self.holds() and route == "ro":
                continue
            if old_w[route] != new_w[route]:
                del self.override[route]      # the file changed that route: it is the newer decision
        self.file = new
        return ""


files = st.fixed_dictionaries({"stable": st.sampled_from([100, 80]), "cand": st.sampled_from([0, 20, None]),
                               "other": st.sampled_from([100, 50]), "release": st.booleans()})


class LayersMachine(RuleBasedStateMachine):
    """Two replicas (``gws[0]``, ``gws[1]``) on one Redis and one file, against ``Model``."""

    redis_url = ""
    tmp_dir = None

    def __init__(self):
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.prefix = f"p{uuid.uuid4().hex[:8]}"
        self.path = self.tmp_dir / f"{self.prefix}.yaml"
        self.gws: list[Gateway] = []
        self.model: Model | None = None
        self.n = 0

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def _replica(self) -> Gateway:
        gw = Gateway(str(self.path), load_config_text(self.path.read_text()), start_engine=False)
        await gw.start()
        return gw

    def write(self, file: dict) -> None:
        self.path.write_text(config_text(self.prefix, self.redis_url, file))

    @initialize()
    def start(self):
        self.model = Model({"stable": 100, "cand": 0, "other": 100, "release": False})
        self.write(self.model.file)
        self.gws = [self.run(self._replica()), self.run(self._replica())]

    def teardown(self):
        for gw in self.gws:
            self.run(gw.stop())
        self.loop.close()

    async def _settle(self) -> None:
        """Both replicas on the shared head, and a few controller ticks (they re-apply a running rollout)."""
        for _ in range(200):
            await asyncio.sleep(0.05)
            head = await self.gws[0].ledger.version()
            if all(gw.snapshot.version == head for gw in self.gws):
                await asyncio.sleep(0.15)
                if all(gw.snapshot.version == head for gw in self.gws) and await self.gws[0].ledger.version() == head:
                    return
        raise AssertionError("the replicas did not converge on the shared config")

    # ----- rules ---------------------------------------------------------------------------------------------
    @rule(new=files, abort=st.booleans(), i=st.integers(0, 1))
    def edit_and_reload(self, new, abort, i):
        before = self.model.file
        expected_refusal = Model.__new__(Model)
        expected_refusal.__dict__ = {**self.model.__dict__, "override": dict(self.model.override),
                                     "rollout": dict(self.model.rollout) if self.model.rollout else None}
        why = expected_refusal.reload(new, abort)
        self.write(new)
        try:
            self.run(self.gws[i].reload("test", abort_rollouts=abort))
            refused = ""
        except RolloutConflict as e:
            refused = str(e)
        if why:
            assert refused and f"rollout {why}" in refused, f"the reload should be refused naming {why}: {refused}"
            self.write(before)               # the operator puts the file back
        else:
            assert not refused, f"refused: {refused}"
            self.model = expected_refusal
        self.run(self._settle())

    @precondition(lambda self: self.model.file["cand"] is not None)
    @rule(cand=st.sampled_from([0.0, 30.0, 70.0]), i=st.integers(0, 1))
    def ctl_weights(self, cand, i):
        r = self.model.rollout
        held = r is not None and r["state"] in ("running", "promoted")
        try:
            self.run(self.gws[i].set_weights("ro", {"cand": cand, "stable": 100.0 - cand}, rebase=True))
            refused = ""
        except RolloutConflict as e:
            refused = str(e)
        if held:
            assert refused and f"rollout {r['name']}" in refused, f"a change under rollout {r['name']} not refused"
        else:
            assert not refused, refused
            self.model.override["ro"] = {**self.model.override.get("ro", {}), "cand": cand, "stable": 100.0 - cand}
        self.run(self._settle())

    @precondition(lambda self: self.model.file["cand"] is not None and not (
        self.model.rollout and self.model.rollout["state"] in ("running", "paused")))
    @rule(i=st.integers(0, 1))
    def start_rollout(self, i):
        from gateway.config.schema import RolloutConfig
        from gateway.rollouts.controller import RouteBusy

        self.n += 1
        name = f"r{self.n}"
        spec = RolloutConfig(route="ro", candidate="cand", baseline="stable", steps=[50, 100], hold_s=3600,
                             check_interval_s=0.05, gates={"error_rate_max": 0.5, "min_compared": 10 ** 6})
        try:
            self.run(self.gws[i].rollouts.create(name, spec))
        except RouteBusy as e:               # a promoted rollout holds the route until released
            assert self.model.holds() and self.model.rollout["name"] in str(e), str(e)
            return
        assert not self.model.holds(), f"started over rollout {self.model.rollout}"
        self.model.rollout = {"name": name, "state": "running", "weight": 50.0}
        self.model.override.pop("ro", None)
        self.run(self._settle())

    @precondition(lambda self: self.model.rollout is not None)
    @rule(action=st.sampled_from(["pause", "resume", "promote", "abort", "release"]), i=st.integers(0, 1))
    def act(self, action, i):
        from gateway.rollouts.controller import ACTIONS, IllegalAction

        r = self.model.rollout
        allowed, state = ACTIONS[action]
        try:
            self.run(self.gws[i].rollouts.act(r["name"], action))
        except IllegalAction:
            assert r["state"] not in allowed
            return
        assert r["state"] in allowed
        eff = self.model.effective()["ro"]
        if action == "pause":                  # the operator has the weights it ran with
            self.model.override["ro"] = {"cand": eff["cand"], "stable": eff["stable"]}
        elif action == "resume":
            r["weight"] = 50.0 if r["weight"] not in (50.0, 100.0) else r["weight"]
            self.model.override.pop("ro", None)
        elif action == "promote":
            r["weight"] = 100.0
            self.model.override.pop("ro", None)
        elif action == "abort":                # the route goes back to the candidate at 0, as an override
            r["weight"] = 0.0
            self.model.override["ro"] = {"cand": 0.0, "stable": 100.0}
        elif action == "release":              # the promoted split stays, now an operator's override
            self.model.override["ro"] = {"cand": 100.0, "stable": 0.0}
        r["state"] = state
        self.run(self._settle())

    @rule(i=st.integers(0, 1))
    def restart_replica(self, i):
        self.run(self.gws[i].stop())
        self.gws[i] = self.run(self._replica())
        self.run(self._settle())

    # ----- the property --------------------------------------------------------------------------------------
    @invariant()
    def both_replicas_match_the_model(self):
        if self.model is None:
            return
        want = self.model.effective()
        for k, gw in enumerate(self.gws):
            have = {n: {t.id: t.weight for t in r.targets} for n, r in gw.snapshot.compiled.policy.routes.items()}
            assert have == want, f"replica {k}: effective {have}, the layers say {want}"


@pytest.fixture
def machine(redis_url, tmp_path):
    LayersMachine.redis_url, LayersMachine.tmp_dir = redis_url, tmp_path
    return LayersMachine


def test_the_layers_hold_under_random_operator_sequences(machine):
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(machine, settings=settings(
        max_examples=8, stateful_step_count=12, deadline=None, derandomize=True, database=None,
        phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck)))
