"""The scrape-time gauges of ``GET /metrics`` (``gateway/http/admin.py``): breaker states and budget usage, read
from the shared state when Prometheus scrapes, not on the request path."""

from __future__ import annotations

import logging

from gateway.billing.prices import NANO
from gateway.billing.usage import Budget, UsageLedger
from gateway.observability.metrics import BREAKER_VALUES, GatewayMetrics

log = logging.getLogger("tandem.gateway.telemetry")


async def refresh_gauges(metrics: GatewayMetrics, usage: UsageLedger, snap, breakers) -> None:
    """Read breaker states and budget usage into the scrape-time gauges of ``metrics`` (``snap``: the config
    snapshot, None before the first; ``breakers``: the resilience layer's breaker store)."""
    if snap is None:
        return
    if snap.local is not None:
        metrics.ensure_engine(snap.local)
    states = {}
    names = {(t.backend, t.id)     # a breaker's key is its target id (gateway/resilience/layer.py)
             for route in snap.compiled.policy.routes.values() for t in (*route.targets, *route.fallbacks)}
    for backend, name in sorted(names):
        try:
            st = await breakers.get(name)
            states[(backend, name)] = BREAKER_VALUES.get(str(st.state).lower(), 0)
        except Exception as e:  # noqa: BLE001
            log.debug("breaker %s: %s", name, e)
    metrics.cache["breakers"] = states
    out = {}
    for tenant, b in snap.compiled.config.budgets.tenants.items():
        try:
            spent, reserved, limit = await usage.budget_state(tenant, Budget(b.usd, b.period))
        except Exception:  # noqa: BLE001
            continue
        out[(tenant, b.period)] = ((spent + reserved) / NANO, limit / NANO)
    metrics.cache["budgets"] = out
