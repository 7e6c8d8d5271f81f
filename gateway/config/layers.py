"""A route's weights as one desired state: layers with a written precedence, recomputed by every reload.

| layer | set by | holds until |
|---|---|---|
| file | the config file as last applied (start, reload, file watcher) | replaced by the next file |
| operator | ``tandem ctl weights``, the console, ``POST /admin/weights`` (versioned changes) | a reload whose file changes that route's targets or weights (the file is then the newer decision) |
| ended rollout | the split an aborted or rolled-back rollout left, where it is not the file's (``owners``) | a reload whose file says the same or changes the route; an operator's change |
| rollout | a running, paused or promoted rollout (``gateway/rollouts/controller.py``) | rolled back, aborted, or released (the operator's ``release``, or ``release: true`` on the route in the file) |

A higher layer wins: rollout over operator over file. A reload keeps the layers above the file (an unrelated edit
never undoes a promotion or a ``ctl weights`` change), takes a route back from an operator override only where the
file changed that route (kubectl apply's three-way merge: the last-applied file against the new one), and names
per route the layer that decides and the layer it overrides. A reload that would leave a rollout steering a target
the file removed is refused (``RolloutConflict``, the admin API's 409) unless it says what to do: ``abort_rollouts``
or the route's ``release``; the rollout then ends with that reason. A version rollback to a config that would
orphan one is refused the same way (``orphaned``; end the rollout first). While Redis is unreachable the layers
above the file cannot be read, so no change to them is made (``gateway.runtime``: 503, the running version stays).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.config.compile import Compiled, load_config_text
from gateway.config.schema import ConfigError

HOLDING_STATES = ("running", "paused", "promoted")   # a rollout in these owns its route's split
ENDED_STATES = ("aborted", "rolled_back")   # a rollout in these left the split it ended with, as its own layer


class RolloutConflict(Exception):
    """A reload that would orphan a rollout (the admin API's 409 ``rollout_conflict``); ``problems``: one line
    each, naming the rollout and what the file did."""

    def __init__(self, problems: list[str], hint: str = ". Reload with abort_rollouts (tandem ctl reload "
                 "--abort-rollouts) to end them, or set release: true on the route in the file"):
        super().__init__("; ".join(problems) + hint)
        self.problems = problems


@dataclass(frozen=True)
class Take:
    """A rollout the reload takes its route back from: ``action`` "abort" (running, paused) or "release"
    (promoted), with ``reason``."""

    name: str
    action: str
    reason: str


@dataclass
class Layered:
    """What a reload applies: ``overrides`` (route -> {target id: weight}, every layer above the file), per route
    the deciding layer and a note when a layer is overridden (``routes``), and the rollouts it ends (``takes``)."""

    overrides: dict[str, dict[str, float]]
    routes: dict[str, dict] = field(default_factory=dict)
    takes: list[Take] = field(default_factory=list)
    file: dict[str, dict[str, float]] = field(default_factory=dict)   # the new file's weights (``over_file``)
    owners: dict[str, str] = field(default_factory=dict)   # route -> the rollout whose split its override is


def route_weights(policy) -> dict[str, dict[str, float]]:
    """route -> {target id: weight} of a ``policies.Policy`` (the file's, when compiled without overrides)."""
    return {name: {t.id: t.weight for t in r.targets} for name, r in policy.routes.items()}


def _fmt(weights: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in weights.items())


def holder(rollouts: list[dict], route: str, states=HOLDING_STATES) -> dict | None:
    """The rollout in ``states`` that holds ``route`` (None when none does)."""
    return next((r for r in rollouts if r["route"] == route and r["state"] in states), None)


def rollout_weights(r: dict) -> dict[str, float]:
    """The split a rollout ``r`` (the store's dict) holds on its route: candidate and baseline."""
    return {r["candidate"]: float(r["weight"]), r["baseline"]: 100.0 - float(r["weight"])}


def holds_split(weights: dict[str, float], want: dict[str, float]) -> bool:
    """Whether a route's ``weights`` (target id -> weight, any total) give each target of ``want`` (a rollout's
    split, ``rollout_weights``: percent) its share."""
    total = sum(weights.values()) or 1.0
    return all(abs(100 * weights.get(k, 0.0) / total - v) < 1e-6 for k, v in want.items())


def same_as_file(file: dict[str, float] | None, weights: dict[str, float],
                 over: dict[str, float] | None = None) -> bool:
    """Whether ``weights`` (an override of one route) changes nothing in ``file`` (that route's file weights) under
    ``over``, the override the route has already (None: none; a weights change that changes nothing)."""
    if file is None:
        return False
    now = {**file, **(over or {})}
    return {**now, **weights} == now


def ended_owner(rollouts: list[dict], owners: dict[str, str], route: str) -> dict | None:
    """The rollout in ``ENDED_STATES`` whose split ``route``'s override is (``ConfigState.owners``), if any."""
    name = owners.get(route)
    return next((r for r in rollouts if r["name"] == name and r["state"] in ENDED_STATES), None)


def _orphaned(r: dict, new_file: dict[str, dict[str, float]], by: str = "the file") -> str:
    """What ``new_file`` (``by``: "the file", or the version a rollback returns to) did to a target rollout ``r``
    steers ("" when nothing)."""
    targets = new_file.get(r["route"])
    if targets is None:
        return f"{by} removes route {r['route']!r}"
    for role in ("candidate", "baseline"):
        if r[role] not in targets:
            return f"{by} removes its {role} {r[role]!r} from route {r['route']!r}"
    return ""


def orphaned(new_file: dict[str, dict[str, float]], rollouts: list[dict], by: str) -> list[str]:
    """One line per rollout in ``HOLDING_STATES`` that routes ``new_file`` (route -> {target id: weight}) would
    orphan, naming it and what ``by`` did (a version rollback's check: ``RolloutConflict(orphaned(...))``)."""
    return [f"rollout {r['name']} ({r['state']}) steers route {r['route']!r}: {why}" for r in rollouts
            if r["state"] in HOLDING_STATES and (why := _orphaned(r, new_file, by))]


def reapply(old_file: dict[str, dict[str, float]], new_file: dict[str, dict[str, float]],
            overrides: dict[str, dict[str, float]], rollouts: list[dict], release: set[str],
            abort_rollouts: bool = False, owners: dict[str, str] | None = None) -> Layered:
    """The layers over a newly applied file (see the module docstring).

    Args:
        old_file: route -> {target id: weight} of the file as last applied (no overrides).
        new_file: the same of the file being applied.
        overrides: the running version's overrides (operator and rollout layers together).
        rollouts: every rollout (the store's dicts); those in ``HOLDING_STATES`` own their route.
        release: routes whose file section says ``release: true``.
        abort_rollouts: end the rollouts the file would orphan instead of refusing the reload.
        owners: route -> the rollout whose split the route's override is (``ConfigState.owners``): one left by a
            rollout that ended (aborted, rolled back) is that rollout's layer, not an operator's, and goes when the
            file says the same weights or changes the route.

    Raises:
        RolloutConflict: the file would orphan a rollout and neither ``abort_rollouts`` nor ``release`` says what
            to do (nothing changes).
    """
    holds = {r["route"]: r for r in rollouts if r["state"] in HOLDING_STATES}
    out = Layered({})
    problems = []
    for route, r in sorted(holds.items()):
        what = f"rollout {r['name']} ({r['state']})"
        orphan = _orphaned(r, new_file)
        if route in release or (orphan and abort_rollouts):
            action = "release" if r["state"] == "promoted" else "abort"
            why = "the file releases the route" if route in release else f"{orphan} (abort_rollouts)"
            out.takes.append(Take(r["name"], action, f"reload: {why}"))
            if route in new_file:
                out.routes[route] = {"decided_by": "file", "note": f"{what} ended: {why}"}
            continue
        if orphan:
            problems.append(f"{what} steers route {route!r}: {orphan}")
            continue
        # a paused rollout's route has the weights operators gave it since the pause (the running split at first)
        held = dict(overrides[route]) if r["state"] == "paused" and route in overrides else rollout_weights(r)
        out.overrides[route] = held
        out.owners[route] = r["name"]
        note = ""
        if any(new_file[route].get(k) != v for k, v in held.items()):
            note = f"{route}: file says {_fmt(new_file[route])}; {what} holds {_fmt(held)}"
        out.routes[route] = {"decided_by": what, "note": note}
    if problems:
        raise RolloutConflict(problems)
    for route, weights in overrides.items():
        if route in out.overrides or route in out.routes or route not in new_file:
            continue
        ended = ended_owner(rollouts, owners or {}, route)
        what = "operator override" if ended is None else f"rollout {ended['name']} ({ended['state']})"
        if ended is not None and same_as_file(new_file[route], weights):
            continue                     # what the rollout left is what the file says: no layer above it
        if old_file.get(route) == new_file[route]:
            out.overrides[route] = dict(weights)
            if ended is not None:
                out.owners[route] = ended["name"]
            out.routes[route] = {"decided_by": "operator" if ended is None else what,
                                 "note": f"{route}: file says {_fmt(new_file[route])}; {what} holds {_fmt(weights)}"}
        else:
            out.routes[route] = {"decided_by": "file",
                                 "note": f"{route}: the file changed the route; {what} {_fmt(weights)} dropped"}
    return out


def over_file(old_text: str, new: Compiled, overrides: dict[str, dict[str, float]], rollouts: list[dict],
              abort_rollouts: bool = False, owners: dict[str, str] | None = None) -> Layered:
    """``reapply`` of config texts: the file ``new`` (compiled without overrides) over ``old_text``, the file as last
    applied (one that no longer loads here keeps no operator override), its ``release`` routes read from ``new``.
    Serves a reload, a replica started on an edited file, and the current state (``new`` the running file).

    Raises:
        RolloutConflict: as ``reapply``.
    """
    try:
        old = route_weights(load_config_text(old_text, {}).policy)
    except ConfigError:
        old = {}
    file = route_weights(new.policy)
    out = reapply(old, file, overrides, rollouts, {n for n, r in new.config.routes.items() if r.release},
                  abort_rollouts, owners)
    out.file = file
    return out


def layer_view(file: dict[str, dict[str, float]], layered: Layered,
               on_disk: dict[str, dict[str, float]] | None = None, running: str = "") -> dict[str, dict]:
    """route -> {"effective", "file", "decided_by", "note"} of ``layered`` over ``file`` (route -> {target id:
    weight}, the running version's file text): the reload's answer (``layers``), its log and ``tandem ctl status``.
    ``on_disk``: the weights of the config file on disk when its text is not the running one (a rollback, or
    another replica's file, runs instead of it); a route whose weights there differ is then decided by the running
    version (``running``, e.g. "version 7 (rollback)"), not the file, and ``file`` is what the disk says; one a
    layer above the file decides keeps that layer, its note saying what the disk says too."""
    out = {}
    for route, weights in file.items():
        decided = layered.routes.get(route, {})
        view = {"effective": {**weights, **layered.overrides.get(route, {})}, "file": weights,
                "decided_by": decided.get("decided_by", "file"), "note": decided.get("note", "")}
        disk = None if on_disk is None else on_disk.get(route)
        if on_disk is not None and disk != weights:
            says = f"the file on disk says {_fmt(disk) if disk else 'no such route'}"
            if view["decided_by"] == "file":
                view.update(file=disk or {}, decided_by=running or "running version",
                            note=f"{says}; `tandem ctl reload` applies it")
            else:   # a layer above decides it: its note's "file" is the running version's
                view["note"] = "; ".join(n for n in (view["note"], f"{says} ({running or 'running version'} runs "
                                                                   f"another file text)") if n)
        out[route] = view
    return out
