"""The rollouts admin API (its objects: docs/operators/rollouts-reference.md), behind the admin token:
GET /admin/rollouts, POST /admin/rollouts (start one), POST /admin/rollouts/{name}/{action} (pause, resume,
promote, abort), GET /admin/parity. The controller is ``gateway/rollouts/controller.py``."""

from __future__ import annotations

import msgspec
import pydantic
from litestar import Request, Response, get, post

from gateway.config.compile import validation_problems
from gateway.config.schema import RolloutConfig
from gateway.errors import ClientError
from gateway.http.admin import _body, _gw, _json
from gateway.rollouts.controller import ACTIONS, IllegalAction, RolloutSpecError, RouteBusy
from gateway.rollouts.spec import name_problem
from gateway.rollouts.store import Conflict


@get("/admin/rollouts")
async def list_rollouts(request: Request) -> Response:
    return _json({"rollouts": await _gw(request).rollouts.list()})


@post("/admin/rollouts")
async def start_rollout(request: Request) -> Response:
    """Body: ``{"name", "route", "candidate", "steps", "hold_s", "gates", ...}`` (a ``rollouts:`` entry and its
    name) -> 201 with the rollout and ``warnings`` (the candidate's backend found down now: started all the same,
    as every weight change is). 400 for a bad body or reference, 409 when the name is taken."""
    gw = _gw(request)
    body = await _body(request)
    name = body.pop("name", None)
    if name_problem(name):
        raise ClientError(400, name_problem(name), param="name")
    body.pop("base_version", None)
    try:
        spec = RolloutConfig(**body)
    except pydantic.ValidationError as e:
        path, problem = validation_problems(e)[0]
        raise ClientError(400, f"{path}: {problem}", param=path or None) from None
    lowered = share_lowered(gw, name, spec)      # the split before the rollout sets its first step
    try:
        view = await gw.rollouts.create(name, spec)
    except RolloutSpecError as e:
        raise ClientError(400, str(e), param=e.param) from None
    except RouteBusy as e:
        raise ClientError(409, str(e), param="route", code="route_has_rollout") from None
    except Conflict:
        existing = await gw.rollouts.store.load(name)
        raise ClientError(409, name_taken(name, existing["state"] if existing else None), param="name",
                          code="rollout_exists") from None
    view = {**view, "warnings": lowered + await candidate_down(gw, name, spec)}
    return Response(msgspec.json.encode(view), status_code=201, media_type="application/json")


def name_taken(name: str, state: str | None) -> str:
    """The 409's message when rollout ``name`` exists (in ``state``; None: not read back): what to do instead."""
    other = "start the new one under another name"
    if state in ACTIONS["resume"][0]:
        todo = f"to continue it: tandem ctl rollout resume {name}; else {other}"
    elif state == "running":
        todo = f"it is still stepping (tandem ctl rollout status {name}); {other}"
    else:
        todo = f"a name stays with its rollout's record: {other}"
    return f"a rollout named {name!r} exists{f' ({state})' if state else ''}; {todo}"


def share_lowered(gw, name: str, spec: RolloutConfig) -> list[str]:
    """The warning for a rollout that starts its candidate below the share it has now (an ops trial's canary at
    100 % went to 50 % without a word): the first step sets the split, whatever it was. [] when it does not lower
    it (or the route is unknown: the create refuses that)."""
    route = gw.snapshot.compiled.policy.routes.get(spec.route)
    weights = {t.id: t.weight for t in route.targets} if route is not None else {}
    total = sum(weights.values())
    share = 100 * weights.get(spec.candidate, 0.0) / total if total else 0.0
    if share <= spec.steps[0] + 1e-9:
        return []
    return [f"rollouts.{name}: its candidate {spec.candidate!r} had {share:g} % of route {spec.route!r}; the rollout "
            f"starts it at its first step, {spec.steps[0]:g} %"]


async def candidate_down(gw, name: str, spec: RolloutConfig) -> list[str]:
    """The warning for a rollout started onto a candidate whose backend the health probes or breakers find down
    now (``Resilience.down_backends``): its first step sends traffic there. [] when it is up or that state cannot be
    read (Redis slow or down: the rollout is started either way)."""
    snap = gw.snapshot
    health = await gw.resilience.status_or_none(snap.compiled.policy.routes, snap.backends)
    down = gw.resilience.down_backends(health) if health is not None else {}
    backend, reason = next(((b, why) for b, (why, ids) in down.items() if spec.candidate in ids), (None, None))
    if backend is None:
        return []
    return [f"rollouts.{name}: its candidate {spec.candidate!r} is on backend {backend!r}, found down now "
            f"({reason}); the first step sends {spec.steps[0]:g} % of route {spec.route!r} there: those "
            "requests fail over while it stays down, and the gates judge the candidate on those failures"]


@post("/admin/rollouts/{name:str}/{action:str}")
async def rollout_action(request: Request) -> Response:
    gw = _gw(request)
    name, action = request.path_params["name"], request.path_params["action"]
    if action not in ACTIONS:
        raise ClientError(404, f"unknown action {action!r}; one of {', '.join(ACTIONS)}", param="action")
    try:
        return _json(await gw.rollouts.act(name, action))
    except LookupError as e:
        raise ClientError(404, str(e), param="name", code="rollout_not_found") from None
    except (IllegalAction, Conflict) as e:
        raise ClientError(409, str(e), code="illegal_action" if isinstance(e, IllegalAction) else "conflict") \
            from None


@get("/admin/parity")
async def parity(request: Request) -> Response:
    return _json({"reports": await _gw(request).rollouts.reports()})


ROLLOUT_HANDLERS = [list_rollouts, start_rollout, rollout_action, parity]
