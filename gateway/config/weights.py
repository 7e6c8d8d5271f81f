"""Route weights that can serve: checks run on every config version (file load, reload, ``tandem ctl weights``,
rollback), and the routes-and-weights table the admin API returns (``changes.py`` says what a new version
changed, for its log line).

Rules (``check_weights``). In the file a route's targets either all set ``weight`` (relative shares: 95 and 5
are 95 % and 5 %, 1 and 3 are 25 % and 75 %) or none does (equal shares); each form gives exactly that split.

- some targets of a route with ``weight`` and others without: refused, naming the first without (``[{a, weight:
  5}, {b}]`` reads as "5 % canary" but the default weight 100 made it 4.8 %);
- every target of a route with weight 0: refused (no target would get a share of the traffic: a mistake);
- weights whose sum is not a finite number (each is, but 1e308 + 1e308 is not): refused (no shares to draw by);
- weight on a backend that cannot be called (its ``api_key_env`` unset): a warning naming the share and where it
  goes (``down_share``: the other targets of weight > 0, else the targets of weight 0, then the fallbacks);
- weights that do not sum to 100 where percent is implied (weights given with ``tandem ctl weights``, or every
  target of the route sets ``weight`` in the file): a warning with the real shares.
"""

from __future__ import annotations

import math

from gateway.config.schema import GatewayConfig
from policies import Policy, Route, spares


def _unavailable(cfg: GatewayConfig, env) -> dict[str, str]:
    """Backends that cannot be called with this environment: name -> why."""
    return {n: f"environment variable {b.api_key_env} is unset" for n, b in cfg.backends.items()
            if b.type in ("openai", "anthropic") and b.api_key_env and not env.get(b.api_key_env)}


def newly_keyless(running: GatewayConfig, new: GatewayConfig, env) -> list[tuple[str, str]]:
    """A reload's errors (key path, problem): backends of ``new`` whose API key variable is unset in ``env`` (the
    environment the gateway started with) where ``running`` had the backend callable, or had none of that name.
    At start such a backend is reported and skipped; by a reload it would take the backend out of its routes and
    move its traffic to the other targets (an ops trial's typo in a variable name sent all of a route to its 5 %
    canary, the reload answered as applied)."""
    before = _unavailable(running, env)
    return [(f"backends.{name}.api_key_env",
             f"{why} in the gateway's environment (read at start): the reload would take {name} out of its routes; "
             "correct the name, or set the variable and restart")
            for name, why in _unavailable(new, env).items() if before.get(name) != why]


def _shares(route: Route) -> str:
    total = sum(t.weight for t in route.targets)
    return ", ".join(f"{t.id} {t.weight / total * 100:.1f} %" for t in route.targets)


def check_weights(cfg: GatewayConfig, routes: dict[str, Route], overrides: dict[str, dict[str, float]],
                  env) -> tuple[list[tuple[str, str]], list[str]]:
    """(errors as (key path, problem), warnings) of the routes' weights; see the module docstring."""
    errors: list[tuple[str, str]] = []
    warnings: list[str] = []
    down = _unavailable(cfg, env)
    for name, spec in cfg.routes.items():
        weighted = ["weight" in t.model_fields_set for t in spec.targets]
        if any(weighted) and not all(weighted):
            i = weighted.index(False)
            t = spec.targets[i]
            errors.append((f"routes.{name}.targets[{i}].weight",
                           f"target {t.id or t.backend!r} has no weight while others of the route do; give every "
                           "target a weight (relative shares) or none (equal shares)"))
    for name, route in routes.items():
        path = f"overrides.{name}" if name in overrides else f"routes.{name}.targets"
        total = sum(t.weight for t in route.targets)
        if total <= 0:
            errors.append((path, "every target has weight 0, so none gets a share of the traffic; "
                                 "give one a weight > 0"))
            continue
        if not math.isfinite(total):
            errors.append((path, f"the weights sum to {total:g}, so no share can be drawn; give weights whose sum "
                                 "is a finite number (percent by convention)"))
            continue
        if (lost := down_share(name, route, down)) is not None:
            warnings.append(lost)
        spec = cfg.routes[name].targets if name in cfg.routes else []
        percent = name in overrides or (len(spec) > 1 and all("weight" in t.model_fields_set for t in spec))
        if percent and abs(total - 100) > 1e-6:
            warnings.append(f"routes.{name}: weights sum to {total:g}, not 100; the real shares are {_shares(route)}")
    return errors, warnings


def down_share(name: str, route: Route, down: dict[str, str], tried: frozenset[str] = frozenset()) -> str | None:
    """The warning for the share of route ``name``'s weight on backends in ``down`` (name -> why it cannot be
    called: an unset key at load, a failed health probe or open breakers at run time); None when there is none.
    It says where those requests go, in the order a request tries (``policies.spares``): the route's other
    targets of weight > 0, else its targets of weight 0, then its fallbacks, those not down themselves.
    ``tried``: those of them routing still calls (a failed probe: breakers, not probes, take a backend out), so
    the warning says each request tries them first."""
    total = sum(t.weight for t in route.targets)
    lost = [t for t in route.targets if t.weight > 0 and t.backend in down]
    if not lost or total <= 0:
        return None
    pct = sum(t.weight for t in lost) / total * 100
    where = "; ".join(f"{t.id}: {down[t.backend]}" for t in lost)
    rest = "the route's other targets of weight > 0" if pct < 100 else _spares_text(route, down)
    if any(t.backend in tried for t in lost):
        return (f"routes.{name}: {pct:.1f} % of the weight is on backends found down ({where}); each of those "
                f"requests still tries them first (until failed calls open their breakers), then goes to {rest}")
    return (f"routes.{name}: {pct:.1f} % of the weight is on unavailable backends ({where}); those requests go to "
            f"{rest}")


def _spares_text(route: Route, down: dict[str, str]) -> str:
    """Where a request goes once every weighted target of ``route`` is out: its ``spares`` not in ``down``."""
    zero = {t.id for t in route.targets if t.weight <= 0}
    up = [t.id for t in spares(route) if t.backend not in down]
    skipped = [t.id for t in spares(route) if t.backend in down]
    parts = [f"{what} ({', '.join(ids)})" for what, ids in (
        ("its targets of weight 0", [i for i in up if i in zero]), ("its fallbacks", [i for i in up if i not in zero]))
        if ids]
    if not parts:
        return (f"none: the route's other targets and fallbacks ({', '.join(skipped)}) are down too, so they get 503"
                if skipped else "none: the route has no other target and no fallbacks, so they get 503")
    return ", then ".join(parts) + (f" ({', '.join(skipped)}: down too)" if skipped else "")


def weights_steer(route: Route) -> bool:
    """Whether ``route``'s weights set its traffic shares (``weighted`` and ``prefix_affinity`` routes); on a
    ``cheapest`` or SLO route a weight only makes a target a choice (> 0) or a spare (0: ``policies.spares``)."""
    return route.select != "cheapest" and route.slo is None


def routes_table(policy: Policy) -> dict[str, dict]:
    """route -> ``{"select", "weights_steer", "targets": [{"id", "backend", "weight", "share_pct"}],
    "fallbacks": [ids]}`` (``weights_steer``: ``weights_steer``'s)."""
    out = {}
    for name, r in policy.routes.items():
        total = sum(t.weight for t in r.targets) or 1.0
        out[name] = {"select": r.select, "weights_steer": weights_steer(r),
                     "fallbacks": [t.id for t in r.fallbacks],
                     "targets": [{"id": t.id, "backend": t.backend, "weight": t.weight,
                                  "share_pct": round(100 * t.weight / total, 2)} for t in r.targets]}
    return out


def add_effective_shares(table: dict[str, dict], backends: dict[str, dict], targets: dict[str, dict]) -> None:
    """Add to each target of ``routes_table``'s ``table`` what requests actually get now: ``effective_pct`` (its
    share among the targets that can serve: weight > 0, backend available, breaker not open; the router picks
    among those in proportion to their weights; when none can, the first target of weight 0 that can gets 100)
    and ``out`` (why it gets nothing: the backend's reason, its open breaker or its weight 0; "" when it serves).
    ``backends`` and ``targets``: ``Resilience.status``' answer."""
    for route in table.values():
        def why(t: dict) -> str:
            b = backends.get(t["backend"], {})
            if not b.get("available", True):
                return f"backend unavailable: {b.get('reason') or 'unknown'}"
            if targets.get(t["id"], {}).get("breaker") == "open":
                return "breaker open"
            return "weight 0" if t["weight"] <= 0 else ""

        for t in route["targets"]:
            t["out"] = why(t)
        total = sum(t["weight"] for t in route["targets"] if not t["out"])
        for t in route["targets"]:
            t["effective_pct"] = round(100 * t["weight"] / total, 2) if total and not t["out"] else 0.0
        if not total:   # no weighted target serves: the first target of weight 0 that can takes it all
            spare = next((t for t in route["targets"] if t["out"] == "weight 0"), None)   # (``policies.spares``)
            if spare is not None:
                spare["out"], spare["effective_pct"] = "", 100.0
