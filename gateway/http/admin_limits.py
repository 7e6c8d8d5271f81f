"""``GET /admin/limits``: the rate limits per tenant on the running config version, read-only, behind the admin
token (for the ops console and scripts; spend and budgets are ``GET /admin/usage``'s).

Answer: ``{"config_version", "window_s", "tenants": {TENANT: {"rpm", "tpm", "keys": [{"rpm", "tpm"}, ...]}}}``:
a tenant's own limits (``limits.tenants``, null when unlimited) and, per virtual key of that tenant (``auth.keys``,
in file order, no key material), the key's limits. Every tenant named by either table or by a budget is listed."""

from __future__ import annotations

import msgspec
from litestar import Request, Response, get

from gateway.http.admin import NO_STORE, _gw


def limits_table(cfg) -> dict:
    """The ``tenants`` part of the answer from a ``GatewayConfig``."""
    names = sorted({*cfg.limits.tenants, *(k.tenant for k in cfg.auth.keys), *cfg.budgets.tenants})
    out = {}
    for t in names:
        own = cfg.limits.tenants.get(t)
        out[t] = {"rpm": own.rpm if own else None, "tpm": own.tpm if own else None,
                  "keys": [{"rpm": k.rpm, "tpm": k.tpm} for k in cfg.auth.keys if k.tenant == t]}
    return out


@get("/admin/limits", include_in_schema=False)
async def admin_limits(request: Request) -> Response:
    gw = _gw(request)
    snap = gw.snapshot
    cfg = snap.compiled.config
    body = {"config_version": snap.version, "window_s": cfg.limits.window_s, "tenants": limits_table(cfg)}
    return Response(msgspec.json.encode(body), media_type="application/json", headers=NO_STORE)
