"""A rollout's checked references, one rule for the config file (``rollouts:``) and ``POST /admin/rollouts``: its
route exists and its weights steer it (not ``cheapest`` nor SLO), its candidate is one of the route's targets, its baseline another one (default: the route's first
target that is not the candidate)."""

from __future__ import annotations

import re

from gateway.config.schema import GatewayConfig, RolloutConfig
from gateway.config.weights import weights_steer

SHADOW_TENANT = "shadow"    # the ledger line of shadow and parity calls: no tenant's usage
# a rollout's name is one URL path segment (/admin/rollouts/{name}/{action}) and never a shadow's report key
# ("shadow/<route>")
ROLLOUT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def name_problem(name: object) -> str:
    """Why ``name`` cannot name a rollout ("" when it can): letters, digits, ``_ . -``, at most 64."""
    if isinstance(name, str) and ROLLOUT_NAME.fullmatch(name):
        return ""
    return (f"rollout name {name!r}: letters, digits, '_', '.' and '-' only, starting with a letter or digit, "
            f"at most 64 characters")


def baseline_of(spec: RolloutConfig, route) -> str:
    """The target id that gives up the weight the candidate gets (``policies.Route``); "" when there is none."""
    if spec.baseline:
        return spec.baseline
    return next((t.id for t in route.targets if t.id != spec.candidate), "")


def rollout_problems(path: str, spec: RolloutConfig, routes: dict) -> list[tuple[str, str]]:
    """(key path, problem) pairs of ``spec`` against the compiled routes (name -> ``policies.Route``)."""
    route = routes.get(spec.route)
    if route is None:
        return [(f"{path}.route", f"unknown route {spec.route!r}; defined: {', '.join(routes)}")]
    if not weights_steer(route):
        how = "by predicted TTFT and cost (slo)" if route.slo is not None else f"by {route.select}"
        return [(f"{path}.route", f"route {spec.route!r} picks its target {how}: its weights do not set the traffic "
                 "shares, so a rollout's steps could not steer it; roll out on a weighted route")]
    ids = [t.id for t in route.targets]
    if spec.candidate not in ids:
        return [(f"{path}.candidate", f"{spec.candidate!r} is not a target of route {spec.route!r}; "
                 f"its targets: {', '.join(ids)}")]
    base = baseline_of(spec, route)
    if base not in ids or base == spec.candidate:
        return [(f"{path}.baseline", f"route {spec.route!r} needs a target other than the candidate to take the "
                 f"weight back; its targets: {', '.join(ids)}")]
    return []


def config_problems(cfg: GatewayConfig, routes: dict) -> list[tuple[str, str]]:
    """Problems of the config's shadows, rollouts and tenants (the ``shadow`` ledger line is reserved)."""
    errors: list[tuple[str, str]] = []
    for name, r in cfg.routes.items():
        if r.shadow is not None and r.shadow.target not in cfg.backends:
            errors.append((f"routes.{name}.shadow.target", f"unknown backend {r.shadow.target!r}; defined: "
                           f"{', '.join(cfg.backends)}"))
    on_route: dict[str, str] = {}
    for name, spec in cfg.rollouts.items():
        if name_problem(name):
            errors.append((f"rollouts.{name}", name_problem(name)))
        if spec.route in on_route:
            errors.append((f"rollouts.{name}.route", f"route {spec.route!r} already has rollout "
                           f"{on_route[spec.route]!r}: one rollout steers a route at a time"))
        on_route.setdefault(spec.route, name)
        errors += rollout_problems(f"rollouts.{name}", spec, routes)
    for i, k in enumerate(cfg.auth.keys):
        if k.tenant == SHADOW_TENANT:
            errors.append((f"auth.keys[{i}].tenant", f"{SHADOW_TENANT!r} is reserved for shadow traffic's ledger line"))
    return errors
