"""Operator endpoints (bearer token from the env var named by ``admin.token_env``): POST /admin/reload,
/admin/rollback, /admin/weights, /admin/drain, /admin/explain; GET /admin/config, /admin/usage; and GET /metrics
(Prometheus text; its tenant-labelled series need the admin token whenever virtual keys exist, unless
``admin.public_metrics``). Module-level handlers on ``request.app.state.gw``; errors go through the app's
exception table (``gateway/http/app.py``)."""

from __future__ import annotations

import asyncio
import os

import msgspec
from litestar import Request, Response, get, post
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.billing.prices import NANO
from gateway.billing.usage import Budget
from gateway.config.layers import RolloutConflict
from gateway.config.rollback import KeysRestored
from gateway.config.schema import ConfigError
from gateway.config.status import describe
from gateway.config.versions import VersionConflict
from gateway.errors import ClientError
from gateway.http.transport import read_body
from gateway.observability.scrape import refresh_gauges
from gateway.request.auth import check_admin
from gateway.request.pipeline import build_request, decide_route, explained_form
from gateway.request.validate import parse_json
from gateway.state import StateUnavailable
from policies import tenant_label

_JSON = "application/json"


def _gw(request: Request):
    """The app's ``gateway.runtime.Gateway``, once the caller showed the admin token."""
    gw = request.app.state.gw
    env = gw.snapshot.compiled.config.admin.token_env
    check_admin(request.headers.get("authorization"), os.environ.get(env), env)
    return gw


def operator_view(request: Request) -> bool:
    """Whether ``request`` may see the operational details: the gateway does not tell callers apart
    (``Snapshot.keyed``) and the caller is not another site's page (``Snapshot.check_local``: a trial read
    ``/health/ready``'s backends through a rebound Host), or the caller showed the admin token."""
    snap = request.app.state.gw.snapshot
    if not snap.keyed:
        try:
            snap.check_local(request.headers)
        except ClientError:
            return False
        return True
    try:
        _gw(request)
    except ClientError:
        return False
    return True


# admin answers hold the config's text and the fleet's state: never kept by a browser or a proxy
NO_STORE = {"cache-control": "no-store"}


def _json(result) -> Response:
    return Response(msgspec.json.encode(result), status_code=200, media_type=_JSON, headers=NO_STORE)


def _conflict(e: VersionConflict) -> ClientError:
    """409 ``version_conflict`` naming the current version (the client re-reads it, or rebases explicitly); a
    ``base_version`` beyond it is no version yet: 400 naming the field."""
    headers = {"x-tandem-config-version": str(e.current)}
    if e.base > e.current:
        return ClientError(400, f"base_version {e.base} is not a config version yet: the current version is "
                                f"{e.current}", param="base_version", code="invalid_value", headers=headers)
    return ClientError(409, str(e), code="version_conflict", headers=headers)


async def _body(request: Request) -> dict:
    raw = await read_body(request, 1 << 20)
    body = parse_json(raw) if raw else {}      # 400 for malformed or too deeply nested JSON, or not an object
    base = body.get("base_version")
    if base is not None and (isinstance(base, bool) or not isinstance(base, int)):
        raise ClientError(400, "base_version must be an integer (the config version the change is built on)",
                          param="base_version", code="invalid_type")
    return body


@post("/admin/reload")
async def admin_reload(request: Request) -> Response:
    """Body (optional): ``{"abort_rollouts": true}`` ends the rollouts the new file would orphan (aborted, or
    released when promoted) instead of answering 409 ``rollout_conflict`` naming them."""
    gw = _gw(request)
    body = await _body(request)
    abort = body.get("abort_rollouts", False)
    if not isinstance(abort, bool):
        raise ClientError(400, "abort_rollouts must be a boolean", param="abort_rollouts", code="invalid_type")
    try:
        return _json(await gw.reload("admin", abort_rollouts=abort))
    except VersionConflict as e:
        raise _conflict(e) from None
    except RolloutConflict as e:
        raise ClientError(409, str(e), code="rollout_conflict") from None


@post("/admin/rollback")
async def admin_rollback(request: Request) -> Response:
    """Body (optional): ``{"base_version": N, "restore_keys": bool}``: the version the rollback is meant to
    undo; whether virtual keys that version removed may come back. 409 ``rollout_conflict`` when the version it
    returns to would orphan a rollout (naming it), 409 ``keys_restored`` when it has keys the head removed."""
    gw = _gw(request)
    body = await _body(request)
    restore = body.get("restore_keys", False)
    if not isinstance(restore, bool):
        raise ClientError(400, "restore_keys must be a boolean", param="restore_keys", code="invalid_type")
    try:
        return _json(await gw.rollback(body.get("base_version"), restore_keys=restore))
    except KeysRestored as e:
        raise ClientError(409, str(e), code="keys_restored") from None
    except VersionConflict as e:
        raise _conflict(e) from None
    except RolloutConflict as e:
        raise ClientError(409, str(e), code="rollout_conflict") from None
    except LookupError as e:
        raise ClientError(409, str(e), code="no_previous_version") from None


@post("/admin/weights")
async def admin_weights(request: Request) -> Response:
    """Body: ``{"route": NAME, "weights": {TARGET: PERCENT}, "base_version": N?, "rebase": bool?}``: built on
    ``base_version`` (default: the version this replica runs), or with ``rebase`` on the shared head."""
    gw = _gw(request)
    body = await _body(request)
    unknown = sorted(set(body) - {"route", "weights", "base_version", "rebase"})
    if unknown:
        raise ClientError(400, f"unknown field {unknown[0]!r}; the body is {{\"route\", \"weights\", "
                          "\"base_version\"?, \"rebase\"?}", param=unknown[0], code="unknown_parameter")
    if not isinstance(body.get("route"), str) or not isinstance(body.get("weights"), dict) or not body["weights"]:
        raise ClientError(400, 'expected {"route": NAME, "weights": {TARGET: PERCENT, ...}} naming at least one '
                          'target', param="weights", code="invalid_value")
    for k, v in body["weights"].items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ClientError(400, f"weight of {k!r} must be a number", param=f"weights.{k}", code="invalid_type")
    try:
        return _json(await gw.set_weights(body["route"], body["weights"], body.get("base_version"),
                                          body.get("rebase") is True))
    except VersionConflict as e:
        raise _conflict(e) from None
    except RolloutConflict as e:
        raise ClientError(409, str(e), code="rollout_conflict", param="route") from None
    except ConfigError as e:
        if all(path.startswith("overrides.") for path, _ in e.errors):   # the weights asked for, not the file
            named = f"route {body['route']!r}"   # a message that names the route already is not prefixed again
            raise ClientError(400, "; ".join(m if m.startswith(named) else f"{named}: {m}" for _, m in e.errors),
                              param="weights", code="invalid_value") from None
        raise


@post("/admin/drain")
async def admin_drain(request: Request) -> Response:
    gw = _gw(request)
    asyncio.get_running_loop().create_task(gw.drain())
    return _json({"draining": True, "in_flight": gw.in_flight})


@get("/admin/config")
async def admin_config(request: Request) -> Response:
    return _json(await describe(_gw(request)))


@get("/admin/usage", include_in_schema=False)
async def admin_usage(request: Request) -> Response:
    """Usage per tenant and backend since ``since`` (``?tenant=&since=``), and the budgets' state."""
    gw = _gw(request)
    tenant = request.query_params.get("tenant")
    try:
        report = await gw.usage.report(tenant, request.query_params.get("since"))
    except ValueError as e:
        raise ClientError(400, str(e), param="since", code="invalid_value") from None
    budgets = gw.snapshot.compiled.config.budgets
    report["budgets"] = {}
    for t, b in budgets.tenants.items():
        if tenant is not None and t != tenant_label(tenant):
            continue
        spent, reserved, limit = await gw.usage.budget_state(t, Budget(b.usd, b.period))
        report["budgets"][t] = {"period": b.period, "budget_usd": limit / NANO,
                                "spent_usd": spent / NANO, "reserved_usd": reserved / NANO}
    return _json(report)


@post("/admin/explain")
async def admin_explain(request: Request) -> Response:
    """The routing decision the gateway would make now for a request, sending nothing (``tandem route explain
    --url``): on the live config version (runtime weights included), engine signals, backends' keys and breakers.
    Body: ``{"request": {...}, "headers": {...}, "tenant": "...", "request_id": "...", "endpoint": "..."}``
    (``endpoint``: ``explained_form``'s); a client key in ``headers.authorization`` names the tenant as the
    gateway would.

    Raises:
        ClientError: 400 for a malformed body, and the request's own 400/401/404 as the gateway would answer."""
    gw = _gw(request)
    snap = gw.snapshot
    raw = await read_body(request, snap.max_body_size)
    spec = parse_json(raw)
    if not isinstance(spec.get("request"), dict):
        raise ClientError(400, 'expected {"request": {...}, "headers": {...}, "tenant": "..."}', param="request",
                          code="invalid_type")
    for name, kind, types in (("headers", "an object of header names to values", (dict,)),
                              ("tenant", "a string", (str,)), ("request_id", "a string", (str,)),
                              ("endpoint", "a string", (str,))):
        if spec.get(name) is not None and not isinstance(spec[name], types):
            raise ClientError(400, f"{name}: expected {kind}, got {type(spec[name]).__name__}", param=name,
                              code="invalid_type")
    headers = {str(k).lower(): str(v) for k, v in (spec.get("headers") or {}).items()}
    endpoint, body, source = explained_form(spec["request"], spec.get("endpoint"))
    # a client key names the tenant as the gateway would; else the tenant given; neither: the key the request
    # lacks, refused as the gateway would refuse it (401 where keys exist: an ops trial's explain said "routed")
    tenant = None if "authorization" in headers or not spec.get("tenant") else str(spec["tenant"])
    req = build_request(snap, endpoint, b"", headers, str(spec.get("request_id") or "explain"), tenant=tenant,
                        body=body, source=source)
    decision, _ = await decide_route(gw, req, explain=True)
    breakers = {t.id: (await gw.resilience.breakers.get(t.id)).state for t in decision.attempts}
    return _json({"config_version": snap.version, "model": req.model, "public_model": req.public_model,
                  "priority": req.priority, "prompt_tokens": req.prompt_tokens, "tenant": req.tenant,
                  "decision": decision.to_dict(), "explanation": decision.explain(), "breakers": breakers,
                  "unavailable": {n: b.unavailable_reason for n, b in snap.backends.items() if not b.available}})


@get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text. With virtual keys configured (``auth.keys``) it needs the admin token: a client key
    must not read every tenant's usage and spend; ``admin.public_metrics`` opens it."""
    gw = request.app.state.gw
    compiled = gw.snapshot.compiled
    if gw.snapshot.keyed and not compiled.config.admin.public_metrics:
        _gw(request)
    gw.snapshot.check_local(request.headers)     # a page of another site, by DNS rebinding: 403
    await refresh_gauges(gw.obs.metrics, gw.obs.usage, gw.snapshot, gw.resilience.breakers)
    try:
        gw.parity_metrics.reports, gw.parity_metrics.rollouts = await gw.rollouts.reports(), await gw.rollouts.list()
    except StateUnavailable:             # Redis unreachable: the parity and rollout series keep their last values
        pass
    return Response(generate_latest(gw.obs.registry), media_type=CONTENT_TYPE_LATEST.split(";")[0],
                    headers={"content-type": CONTENT_TYPE_LATEST})


ADMIN_HANDLERS = [admin_reload, admin_rollback, admin_weights, admin_drain, admin_config, admin_usage, admin_explain,
                  metrics]
