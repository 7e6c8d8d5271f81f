"""The rollout controller: moves a candidate target's weight on a route through its ``steps`` while the gates
hold, rolls it back when one fails, and carries out operators' pause, resume, promote and abort.

One controller per gateway (owned by ``gateway.runtime.Gateway``); every replica runs one. State lives in shared
state (``gateway/rollouts/store.py``), so a restarted gateway resumes a rollout where it was and every replica
reports the same one. Two replicas never fight over a step:

- only the replica holding the controller lease (``RolloutStore.lease``) judges gates and moves steps;
- every change of a rollout is a compare-and-set on its revision: a change built on a stale read is refused
  (``Conflict``: the operator's API answers 409, the controller re-reads next tick);
- the weights move through ``Gateway.set_weights`` (rebased on the shared head): the same replicated, versioned
  config change as ``tandem ctl weights``, pushed only while the rollout is at the revision it was read at (a
  ``Guard``: a tick never sets the split of a rollout an operator or a reload ended meanwhile); each tick the lease holder re-applies the weight of a running
  rollout when the live config differs (a change lost to a crash between the two writes is redone); an operator's
  ``tandem ctl weights`` on a route a running or promoted rollout holds is refused naming it (pause or release it
  first);
- with Redis configured, the rollouts and the lease live there only: while it is unreachable nobody acts (the
  store raises ``StateUnavailable`` instead of answering from this replica's in-process copy, which is empty or
  stale: a tick acting on it started the configured rollout again at its first step) and the admin API answers
  503 ``redis_unavailable``.

Judging (each ``check_interval_s``, lease holder only): the gates (``gateway/rollouts/gates.py``) on the parity
report of the pairs compared since the step began. A failing gate: the weight goes back to the last good step
(the previous one; 0 at the first) and the rollout is ``rolled_back`` with the reason. The hold is a window: it
opens (``held_since``) at the first check at which every gate was judged (``min_compared`` pairs) and held, and
closes when a check cannot judge them; the next step (past the last, ``promoted``) comes once a window has stayed
open ``hold_s``. States: running, paused, promoted, rolled_back, aborted, released.

A running, paused or promoted rollout owns its route's split (``gateway/config/layers.py``): a reload keeps it,
and ends it (abort, release) only when told to. A rollout whose weights cannot be applied (its target gone from
the live config) is paused with the reason, once; the controller never retries a config it cannot apply.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from gateway.config.layers import ENDED_STATES, holder, holds_split, rollout_weights
from gateway.config.schema import ConfigError, RolloutConfig
from gateway.config.versions import GuardFailed, VersionConflict
from gateway.rollouts.gates import all_hold, failing, judge
from gateway.rollouts.parity import report
from gateway.rollouts.spec import baseline_of, name_problem, rollout_problems
from gateway.rollouts.store import LIVE, Conflict, RolloutStore, RouteHeld
from gateway.state import StateUnavailable
from gateway.tasks import cancel_task

log = logging.getLogger("tandem.rollouts")

# action -> (states it may be taken in, the state it leads to)
ACTIONS = {"pause": (("running",), "paused"),
           "resume": (("paused", "rolled_back"), "running"),
           "promote": (("running", "paused", "rolled_back"), "promoted"),
           "abort": (("running", "paused", "rolled_back"), "aborted"),
           "release": (("promoted",), "released")}   # the operator or the file takes the route's split back


class IllegalAction(Exception):
    """The action cannot be taken in the rollout's state (the admin API's 409)."""


class RouteBusy(Exception):
    """Another live rollout steers the route (the admin API's 409)."""


def _busy(route: str, other: str, state: str | None) -> RouteBusy:
    """The refusal of a rollout on ``route``, which rollout ``other`` holds (in ``state``; None: not read)."""
    if state == "promoted":                              # its split stands until released
        return RouteBusy(f"route {route!r} is held by rollout {other!r} (promoted): release it first "
                         f"(tandem ctl rollout release {other})")
    return RouteBusy(f"route {route!r} already has rollout {other!r}{f' ({state})' if state else ''}: one rollout "
                     "steers a route at a time; abort it or let it finish first")


class RolloutSpecError(ValueError):
    """A rollout's name or references are wrong (the admin API's 400); ``param``: the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def new_rollout(name: str, spec: RolloutConfig, baseline: str, now: float) -> dict:
    """A rollout's first state: running at its first step."""
    w = float(spec.steps[0])
    return {"name": name, "route": spec.route, "candidate": spec.candidate, "baseline": baseline,
            "state": "running", "steps": [float(s) for s in spec.steps], "step_index": 0, "weight": w,
            "hold_s": spec.hold_s, "step_since": now, "reason": "",
            "history": [{"at": now, "weight": w, "state": "running", "reason": "started"}],
            "spec": spec.model_dump()}


def _moved(r: dict, now: float, state: str, index: int, weight: float, reason: str) -> dict:
    """``r`` after a transition (its history extended)."""
    return {**r, "state": state, "step_index": index, "weight": weight, "step_since": now, "reason": reason,
            "held_since": None,
            "history": [*r["history"], {"at": now, "weight": weight, "state": state, "reason": reason}][-200:]}


class RolloutController:
    """Rollouts of one gateway (see the module docstring). ``gw``: the ``gateway.runtime.Gateway``."""

    def __init__(self, gw, store: RolloutStore):
        self.gw = gw
        self.store = store
        self.holder = uuid.uuid4().hex         # this replica's lease identity
        self.active: dict[str, list[dict]] = {}   # route -> running/paused rollouts (the shadow runner reads it)
        self._task: asyncio.Task | None = None
        self._indexed = False                   # the live set checked against every rollout (first tick)
        self._held: set[str] = set()            # rollouts whose route another holds (warned about once)

    # ----- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop the loop, then hand the lease back (another replica takes over at its next tick; released first,
        a tick still running could take it again)."""
        self._task = await cancel_task(self._task)
        try:
            await self.store.release(self.holder)
        except Exception:  # noqa: BLE001 -- Redis down: the lease expires by itself
            pass

    def _interval(self) -> float:
        specs = self.gw.snapshot.compiled.config.rollouts.values()
        live = [r["spec"]["check_interval_s"] for rs in self.active.values() for r in rs]
        return min([1.0, *(s.check_interval_s for s in specs), *live])

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except StateUnavailable:     # Redis unreachable (SharedState logged it): the rollouts wait for it
                pass
            except Exception:  # noqa: BLE001 -- the next tick retries
                log.exception("rollout controller tick failed")
            await asyncio.sleep(self._interval())

    # ----- the tick --------------------------------------------------------------------------------------------
    async def tick(self, now: float | None = None) -> None:
        """Refresh ``active``; as lease holder, create the config's new rollouts and judge the running ones.

        Reads only the live (running, paused) rollouts: finished ones cost nothing per tick."""
        now = time.time() if now is None else now
        if not self._indexed:
            await self.store.index_live()
            self._indexed = True
        names = set(await self.store.live_names())
        configured = self.gw.snapshot.compiled.config.rollouts
        if not names and not configured:
            self.active = {}
            return                       # nothing to run: no lease taken, one read per tick
        lead = await self.store.lease(self.holder, max(3 * self._interval(), 2.0))
        if lead and configured:
            known = set(await self.store.names())
            for name, spec in configured.items():
                if name not in known:
                    try:
                        names.add((await self.create(name, spec, now))["name"])
                    except (Conflict, RouteBusy, ValueError) as e:
                        log.warning("rollout %s not started: %s", name, e)
        active: dict[str, list[dict]] = {}
        for name in sorted(names):
            r = await self.store.load(name)
            if r is None:
                continue
            if lead and r["state"] in LIVE:
                try:
                    r = await self._judge(r, now)
                except Conflict:              # an operator changed it meanwhile: judged again next tick
                    continue
                except RouteHeld as e:        # two holders, started before saves claimed routes: said once
                    if name not in self._held:
                        self._held.add(name)
                        log.warning("rollout %s not judged: %s; abort one of them", name, e)
                    continue
            if r["state"] in LIVE:
                active.setdefault(r["route"], []).append(r)
        self.active = active

    async def _judge(self, r: dict, now: float) -> dict:
        if r["state"] != "running":      # paused: the operator has the weights (resume sets the step's again)
            return r
        try:
            await self._apply_weight(r)
        except ConfigError as e:         # its target is gone from the live config: say so once, never loop
            return await self._transition(r, now, "paused", r["step_index"], r["weight"],
                                          f"paused: its weights cannot be applied ({e})", apply=False)
        spec = RolloutConfig(**r["spec"])
        step = await self.step_report(r)
        gates = judge(spec.gates, step)
        why = failing(gates)
        window = {"requests": step["requests"], "compared": step["compared"],
                  "candidate_error_rate": step["candidate"]["error_rate"]}
        if why:
            back = r["steps"][r["step_index"] - 1] if r["step_index"] > 0 else 0.0
            return await self._transition(r, now, "rolled_back", max(r["step_index"] - 1, 0), back,
                                          f"rolled back from {r['weight']:g} % to {back:g} %: {why}", gates, window)
        held_since = r.get("held_since")
        if not all_hold(gates):          # too little evidence: the window closes, the hold starts again later
            if held_since is not None:
                r = await self._save(r, held_since=None)
            return r
        if held_since is None:           # the first check at which every gate was judged and held
            return await self._save(r, held_since=now)
        if now - held_since >= r["hold_s"]:
            i = r["step_index"] + 1
            if i >= len(r["steps"]):
                held = "every gate held" if gates else "no gates: each step held"   # promoted on time alone
                return await self._transition(r, now, "promoted", r["step_index"], 100.0,
                                              f"{held} {r['hold_s']:g} s at each step", gates, window)
            held = "gates held" if gates else "no gates: held"
            return await self._transition(r, now, "running", i, r["steps"][i],
                                          f"{held} {now - held_since:.1f} s at {r['weight']:g} %", window=window)
        return r

    async def _save(self, r: dict, **changes) -> dict:
        """``r`` with ``changes``, compare-and-set on its revision (Raises Conflict)."""
        new = {**r, **changes}
        await self.store.save(r["name"], new, r["rev"])
        self._note(new)
        return new

    def _note(self, r: dict) -> None:
        """Update ``active`` with ``r`` at once (other replicas see it at their next tick)."""
        active = {route: [x for x in rs if x["name"] != r["name"]] for route, rs in self.active.items()}
        if r["state"] in LIVE:
            active.setdefault(r["route"], []).append(r)
        self.active = active

    async def _transition(self, r: dict, now: float, state: str, index: int, weight: float, reason: str,
                          gates: dict | None = None, window: dict | None = None, apply: bool = True) -> dict:
        """Compare-and-set the rollout to its new state, then move the weight (unless ``apply`` is false: the
        route's split is no longer the rollout's to set). Raises Conflict.

        ``gates``: the judgement that ended the rollout (rolled back or promoted), kept as its final gates:
        a step begun by the transition has no pairs yet, so judging it again would show the failed gate
        as empty. ``window``: the evidence of the step that ends (pairs compared, candidate errors), kept in the
        history entry."""
        new = _moved(r, now, state, index, weight, reason)
        if window is not None:
            new["history"][-1] = {**new["history"][-1], "window": window}
        if gates is not None:
            new["final_gates"] = gates
        await self.store.save(r["name"], new, r["rev"])
        self._note(new)
        # a rollback is news an operator alerts on (as a breaker opening is): a warning; other steps are info
        log.log(logging.WARNING if state == "rolled_back" else logging.INFO, "rollout %s: %s (%s)", r["name"], state,
                reason)
        if apply and state not in ("released",):
            try:
                await self._apply_weight(new, force=True)
            except ConfigError as e:
                log.warning("rollout %s: weights not applied (%s)", r["name"], e)
        return new

    async def _apply_weight(self, r: dict, force: bool = False) -> None:
        """Set the route's candidate and baseline weights to the rollout's (when ``force`` or they differ); a rollout
        that ended (aborted, rolled back) leaves no override where its split is the file's."""
        route = self.gw.snapshot.compiled.policy.routes.get(r["route"])
        if route is None:
            return
        want = rollout_weights(r)
        if not force and holds_split({t.id: t.weight for t in route.targets}, want):
            return
        for _ in range(3):
            try:
                await self.gw.set_weights(r["route"], want, rebase=True, rollout=r["name"],
                                          guard=self.store.guard(r["name"], r["rev"]),
                                          ended=r["state"] in ENDED_STATES)
                return
            except VersionConflict:
                continue
            except GuardFailed:          # changed since it was read (ended by an operator or a reload): its new
                return                   # state decides, at the next tick

    async def reassert(self) -> None:
        """Set the split of every promoted rollout again where the live config differs (after a version
        rollback, which restores an older version's weights; a running one is set again by the lease holder's next
        tick, or paused by it when it cannot be applied). One that cannot be applied is logged."""
        for r in await self.every():
            if r["state"] != "promoted":
                continue
            try:
                await self._apply_weight(r)
            except ConfigError as e:
                log.warning("rollout %s (%s): its split cannot be set again after the rollback: %s", r["name"],
                            r["state"], e)

    async def every(self) -> list[dict]:
        """Every rollout as stored (a reload's rollout layer).

        Raises:
            StateUnavailable: Redis is configured and unreachable (this replica's copy is not the rollouts: a
                change built on it could take a promoted rollout's route back; ``gateway.runtime`` refuses it)."""
        return [r for n in await self.store.names() if (r := await self.store.load(n)) is not None]

    async def take_back(self, takes) -> None:
        """End the rollouts a reload took its routes back from (``layers.Take``: abort or release, with the
        reason); the reload already set the weights."""
        now = time.time()
        for t in takes:
            r = await self.store.load(t.name)
            if r is None or r["state"] not in ACTIONS[t.action][0]:
                continue
            state = ACTIONS[t.action][1]
            await self._transition(r, now, state, r["step_index"], r["weight"] if state == "released" else 0.0,
                                   t.reason, apply=False)

    # ----- reading ---------------------------------------------------------------------------------------------
    async def step_report(self, r: dict) -> dict:
        """The parity report of the pairs compared since the rollout's current step began."""
        records = [x for x in await self.store.records(r["name"]) if x.get("at", 0) >= r["step_since"]]
        return report(records, await self.store.dropped(r["name"]))

    async def view(self, r: dict) -> dict:
        """The admin API's rollout object (docs/operators/rollouts-reference.md): the rollout, its gates (now, or the
        judgement that ended it) and its parity."""
        spec = RolloutConfig(**r["spec"])
        step = await self.step_report(r)
        records = await self.store.records(r["name"])
        parity = report(records, await self.store.dropped(r["name"])) if records else None
        out = {k: r[k] for k in ("name", "route", "candidate", "baseline", "state", "steps", "step_index", "weight",
                                 "hold_s", "step_since", "reason", "history")}
        out["held_since"] = r.get("held_since")
        gates = r["final_gates"] if r["state"] not in LIVE and "final_gates" in r else judge(spec.gates, step)
        actions = [a for a, (sources, _) in ACTIONS.items() if r["state"] in sources]   # what it may do now
        return {**out, "gates": gates, "parity": parity, "actions": actions}

    async def list(self) -> list[dict]:
        out = []
        for name in await self.store.names():
            r = await self.store.load(name)
            if r is not None:
                out.append(await self.view(r))
        return out

    # ----- operators -------------------------------------------------------------------------------------------
    async def create(self, name: str, spec: RolloutConfig, now: float | None = None) -> dict:
        """Start rollout ``name`` at its first step.

        Raises:
            RolloutSpecError: its name or references are wrong (``gateway.rollouts.spec``), naming the field.
            RouteBusy: another rollout is running or paused on its route (one steers a route at a time).
            Conflict: a rollout of that name exists."""
        routes = self.gw.snapshot.compiled.policy.routes
        if name_problem(name):
            raise RolloutSpecError(name_problem(name), "name")
        problems = rollout_problems("rollout", spec, routes)
        if problems:
            raise RolloutSpecError("; ".join(f"{p}: {m}" for p, m in problems), problems[0][0].split(".", 1)[1])
        # read first, for the holder's state in the answer (and rollouts saved before routes were claimed)
        other = holder(await self.every(), spec.route)
        if other is not None and other["name"] != name:
            raise _busy(spec.route, other["name"], other["state"])
        r = new_rollout(name, spec, baseline_of(spec, routes[spec.route]), time.time() if now is None else now)
        try:
            await self.store.save(name, r, 0)
        except RouteHeld as e:       # started meanwhile on another replica or by another request: the save decides
            raise _busy(spec.route, e.holder, None) from None
        self._note(r)
        log.info("rollout %s started: %s %s -> %s", name, spec.route, spec.candidate, spec.steps)
        await self._apply_weight(r, force=True)
        return await self.view(r)

    async def act(self, name: str, action: str) -> dict:
        """Take ``action`` (pause, resume, promote, abort, release) on rollout ``name``; returns its view. A
        rollout whose targets are gone from the live route (a reload took them out after it was rolled back) can be
        ended, with no weights to move, but not resumed or promoted; nor can one whose route another rollout holds.

        Raises:
            LookupError: no such rollout. IllegalAction: not in this state, or not now (why). Conflict: changed
            meanwhile."""
        r = await self.store.load(name)
        if r is None:
            raise LookupError(f"no rollout {name!r}")
        allowed, state = ACTIONS[action]
        if r["state"] not in allowed:
            can = [a for a, (states, _) in ACTIONS.items() if r["state"] in states]
            raise IllegalAction(f"cannot {action} rollout {name!r}: it is {r['state']}"
                                + (f" (it can: {', '.join(can)})" if can else " and ended"))
        missing = self._missing(r)
        if state in ("running", "promoted"):
            other = holder([x for x in await self.every() if x["name"] != name], r["route"])
            if missing or other is not None:
                raise IllegalAction(f"cannot {action} rollout {name!r}: " + (
                    missing or f"route {r['route']!r} is held by rollout {other['name']!r} ({other['state']})"))
        now = time.time()
        index, weight = r["step_index"], r["weight"]
        if action == "promote":
            weight = 100.0
        elif action == "abort":
            weight = 0.0
        elif action == "resume":      # from the last good step (the first, after a rollback from it)
            weight = r["steps"][index]
        try:
            new = await self._transition(r, now, state, index, weight, f"operator: {action}", apply=not missing)
        except RouteHeld as e:         # taken meanwhile (the check above read before another replica saved)
            raise IllegalAction(f"cannot {action} rollout {name!r}: {e}") from None
        return await self.view(new)

    def _missing(self, r: dict) -> str:
        """Why the live config cannot take rollout ``r``'s split ("" when it can): its route or a target gone."""
        route = self.gw.snapshot.compiled.policy.routes.get(r["route"])
        if route is None:
            return f"route {r['route']!r} is not in the live config"
        ids = {t.id for t in route.targets}
        gone = [r[k] for k in ("candidate", "baseline") if r[k] not in ids]
        return f"route {r['route']!r} has no target {gone[0]!r} now" if gone else ""

    async def reports(self) -> dict[str, dict]:
        """Parity report ``P`` of every shadow and rollout (``GET /admin/parity``)."""
        routes = self.gw.snapshot.compiled.config.routes
        names = set(await self.store.record_names()) | set(await self.store.names())
        names |= {f"shadow/{n}" for n, r in routes.items() if r.shadow is not None}
        return {n: report(await self.store.records(n), await self.store.dropped(n)) for n in sorted(names)}
