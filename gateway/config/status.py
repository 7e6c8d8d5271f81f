"""What ``GET /admin/config`` and ``tandem ctl status`` show of a running ``gateway.runtime.Gateway``: its version,
routes, backends, history, the file on disk, and per route the layer that decides its weights."""

from __future__ import annotations

from gateway.config.compile import load_config_text
from gateway.config.layers import Layered, RolloutConflict, layer_view, over_file, route_weights
from gateway.config.weights import add_effective_shares, down_share, routes_table
from gateway.resilience.layer import Resilience
from gateway.state import StateUnavailable


async def describe(gw) -> dict:
    """The running config for GET /admin/config."""
    s = gw.snapshot
    try:
        history = [h.summary() for h in await gw.ledger.history()]
    except Exception as e:  # noqa: BLE001
        gw._redis_failed(e)
        history = []
    backends, targets = await gw.resilience.status(s.compiled.policy.routes, s.backends)
    routes = routes_table(s.compiled.policy)
    add_effective_shares(routes, backends, targets)
    return {
        "version": s.version, "source": s.source, "overrides": s.compiled.overrides,
        "public_models": s.compiled.public_models,
        "routes": routes,
        "backends": {n: {"type": b.kind, **backends[n]} for n, b in s.backends.items()}, "targets": targets,
        "routes_serving": gw.resilience.routes_serving(s.compiled.policy.routes, backends, targets),   # /health/ready's
        "history": history, "warnings": s.warnings, "redis_degraded": gw.redis_degraded,
        "file": gw.config_file.status(s.compiled.text, s.compiled.overrides), "layers": await layers(gw),
        "usage_journal": len(gw.usage.journal),   # settles waiting for Redis (replayed on rejoin)
        "draining": gw.draining, "in_flight": gw.in_flight, "text": s.compiled.text,
    }


async def layers(gw) -> dict:
    """route -> its effective weights, the file's, and the layer that decides (``layers.layer_view``)."""
    text, overrides = gw.snapshot.compiled.text, gw.snapshot.compiled.overrides
    current = load_config_text(text, {})
    try:
        rollouts = await gw.rollouts.every()
    except StateUnavailable:         # Redis unreachable: the live rollouts this replica last read
        rollouts = [r for rs in gw.rollouts.active.values() for r in rs]
    try:
        layered = over_file(text, current, overrides, rollouts, owners=gw.snapshot.owners)
    except RolloutConflict as e:
        layered = Layered(overrides, {r: {"decided_by": "operator", "note": str(e)} for r in overrides})
    s = gw.snapshot    # the file on disk differs when a rollback, or another replica's file, runs instead
    return layer_view(route_weights(current.policy), layered, gw.config_file.weights_if_differs(text),
                      f"version {s.version} ({s.source})")


def routes_now(snap, health: tuple[dict, dict] | None) -> dict[str, dict]:
    """A change's answer's routes (``snap``: the ``Snapshot`` it made): each target's weight and share, and what
    requests get now (``weights.add_effective_shares``: a weighted target whose backend is down or breaker open
    gets none); the weights alone without ``health`` (``Resilience.status_or_none``: (backends, targets))."""
    routes = routes_table(snap.compiled.policy)
    if health is not None:
        add_effective_shares(routes, *health)
    return routes


def down_warnings(snap, health: tuple[dict, dict] | None) -> list[str]:
    """Warnings for weight on backends ``health`` (``Resilience.status_or_none``) finds down
    (``Resilience.down_backends``, ``weights.down_share``), not already among ``snap``'s warnings; none without it."""
    if health is None:
        return []
    down = {n: why for n, (why, _) in Resilience.down_backends(health).items()}
    tried = frozenset(n for n, why in down.items() if why.startswith("last probe failed"))  # still routed to
    return [w for name, r in snap.compiled.policy.routes.items()
            if (w := down_share(name, r, down, tried)) is not None and w not in snap.warnings]
