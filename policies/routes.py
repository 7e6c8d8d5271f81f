"""Routes: ordered, weighted targets plus fallbacks, and the canary pick.

The canary arm is chosen by weighted rendezvous hashing (highest random
weight; Thaler & Ravishankar 1998, weighted form: Schindelhauer & Schomaker,
"Weighted distributed hash tables", SPAA 2005): for a key k and each target i
with weight w_i > 0, u_i = sha256(k, target id) mapped to (0, 1) and
score_i = w_i / -ln(u_i); the highest score wins. Target i wins with
probability w_i / sum(w). Raising one target's weight while the others keep
theirs only raises its score, so users move only onto the grown target. With
two arms (a canary) any shift moves users in one direction only: 5 -> 25 ->
100 % only moves users forward, and back again only when it shrinks.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace

from policies.affinity import Affinity, ReplicaLoad, choose, prefix_key
from policies.slo import Handover, Slo, rank

SELECT_MODES = ("weighted", "cheapest", "prefix_affinity")
# What keeps a conversation on one target (its provider's prompt cache): "" none, "prefix" the prompt's leading
# text blocks (as ``prefix_affinity`` hashes them), "user" the request's ``user``.
STICKY_KEYS = ("", "prefix", "user")


@dataclass(frozen=True)
class Target:
    """One place a request can go.

    Attributes:
        backend: the backend's name in the config.
        model: the upstream model name ("" = the backend's mapping decides).
        weight: relative weight (percent by convention), >= 0.
        input_price, output_price: USD per million tokens (for ``cheapest``).
        cached_input_price: USD per million prompt tokens the backend's prompt
            cache serves (None: ``input_price``).
        id: stable identifier used for hashing, weights overrides and CLI
            (default ``backend`` or ``backend/model``).
    """

    backend: str
    model: str = ""
    weight: float = 100.0
    input_price: float = 0.0
    output_price: float = 0.0
    id: str = ""
    cached_input_price: float | None = None

    def __post_init__(self) -> None:
        if self.weight < 0 or not math.isfinite(self.weight):
            raise ValueError(f"weight must be a finite number >= 0, got {self.weight!r}")
        if not self.id:
            object.__setattr__(self, "id", f"{self.backend}/{self.model}" if self.model else self.backend)


@dataclass(frozen=True)
class Route:
    """A named route: ``targets`` (weighted, first choice) then ``fallbacks``
    (tried in order when the chosen target fails). ``select`` is
    ``weighted`` (canary by stable hash), ``cheapest`` (lowest input +
    output price among available targets) or ``prefix_affinity`` (engine
    replicas by prefix-cache affinity and load, ``policies/affinity.py``,
    with ``affinity`` settings). With an ``slo`` the first choice is the
    cheapest target predicted to meet it, else the fastest (``policies/slo.py``)."""

    name: str
    targets: tuple[Target, ...]
    fallbacks: tuple[Target, ...] = ()
    select: str = "weighted"
    affinity: Affinity = Affinity()
    slo: Slo | None = None
    sticky: str = ""


    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError(f"route {self.name!r} needs at least one target")
        if self.sticky not in STICKY_KEYS:
            raise ValueError(f"sticky must be one of {', '.join(map(repr, STICKY_KEYS))}, got {self.sticky!r}")
        if self.select not in SELECT_MODES:
            raise ValueError(f"select must be one of {', '.join(SELECT_MODES)}, got {self.select!r}")
        ids = [t.id for t in self.targets]
        if len(set(ids)) != len(ids):
            raise ValueError(f"route {self.name!r} has duplicate target ids {ids}; give them distinct `id`s")


def hash_unit(key: str, target_id: str) -> float:
    """sha256(key, target_id) as a float in (0, 1) (53 bits, never 0 or 1)."""
    digest = hashlib.sha256(f"{key}\x00{target_id}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 11 | 1) / float(1 << 53)


@dataclass
class Pick:
    """The outcome of choosing among a route's targets, with its reasons.

    ``ranked``: the live targets (weight > 0, backend available) in the order
    a request tries them: ``target`` first, then the others by their
    rendezvous score (weighted: a target with weight w comes next with
    probability proportional to w) or by price (``cheapest``)."""

    target: Target | None
    scores: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    ranked: list[Target] = field(default_factory=list)
    home: str = ""          # prefix_affinity: the key's top-scoring target id
    prefix_key: str = ""    # prefix_affinity: the hashed prefix
    handover: Handover | None = None   # slo: a checkpoint on the engine ``target`` (``policies.slo.Handover``)


def pick_target(route: Route, key: str, unavailable: dict[str, str], prefix: str = "",
                loads: dict[str, ReplicaLoad] | None = None, slo: Slo | None = None,
                estimates: dict | None = None, prompt_tokens: int | None = None,
                max_tokens: int | None = None, home: str = "") -> Pick:
    """Choose the first-choice target of ``route`` for canary key ``key``,
    skipping targets whose backend is in ``unavailable``. ``prefix_affinity``
    routes use ``prefix`` (``affinity.prefix_text`` of the request) and the
    replicas' ``loads`` (target id -> ``ReplicaLoad``) instead of ``key``.
    An ``slo`` (the rule's, else the route's) ranks by ``estimates`` (backend
    name -> ``policies.slo.TTFTEstimate``) and the request's cost
    (``prompt_tokens``, ``max_tokens``) instead; ``home`` (a route's ``sticky``
    target for this conversation) is priced at its cached-input price.

    Returns a Pick whose ``target`` is None when no target is available;
    ``ranked`` holds every live target in the order to try them."""
    skipped = {t.id: unavailable[t.backend] for t in route.targets if t.backend in unavailable}
    live = [t for t in route.targets if t.backend not in unavailable and t.weight > 0]
    if not live:
        return Pick(None, skipped=skipped, reason="no available target with weight > 0")
    if slo is not None:
        ranked, reason, cost, hand = rank(live, slo, estimates or {}, prompt_tokens, max_tokens, home)
        return Pick(ranked[0], scores=cost, skipped=skipped, ranked=ranked, reason=reason, home=home, handover=hand)
    if route.select == "cheapest":
        ranked = sorted(live, key=lambda t: (t.input_price + t.output_price, route.targets.index(t)))
        best = ranked[0]
        return Pick(best, skipped=skipped, ranked=ranked,
                    reason=f"cheapest available: {best.id} at {best.input_price}+{best.output_price} USD/M tokens")
    if route.select == "prefix_affinity":
        return _affinity_pick(route, live, prefix, loads or {}, skipped)
    if len(live) == 1:
        return Pick(live[0], skipped=skipped, ranked=live, reason=f"only available target {live[0].id}")
    scores = {t.id: t.weight / -math.log(hash_unit(key, t.id)) for t in live}
    ranked = sorted(live, key=lambda t: -scores[t.id])
    best = ranked[0]
    total = sum(t.weight for t in live)
    return Pick(best, scores=scores, skipped=skipped, ranked=ranked,
                reason=f"canary by rendezvous hash of {key!r}: {best.id} "
                       f"(weight {best.weight:g} of {total:g})")


def _affinity_pick(route: Route, live: list[Target], prefix: str, loads: dict[str, ReplicaLoad],
                   skipped: dict[str, str]) -> Pick:
    pkey = prefix_key(prefix, route.affinity)
    c = choose(live, pkey, loads, route.affinity)
    best = c.ranked[0]
    lines = [f"{t.id}: load {loads.get(t.id, ReplicaLoad()).load:g}/{c.bound.get(t.id, 0):g}"
             + (f" ({c.spilled[t.id]})" if t.id in c.spilled else "") for t in c.ranked]
    why = "home" if best is c.home else f"spill-over from home {c.home.id}"
    return Pick(best, scores=c.scores, skipped={**skipped, **c.spilled}, ranked=c.ranked,
                reason=f"prefix affinity, key {pkey} (text blocks): {best.id} ({why}); " + "; ".join(lines),
                home=c.home.id, prefix_key=pkey)


def spares(route: Route) -> list[Target]:
    """The members of ``route`` a request tries once its weighted targets (weight > 0) have failed or were skipped
    (breaker open, cooling down, connection refused): its targets of weight 0 in the route's order (they get no
    share of the traffic, but serve it before any fallback), then its ``fallbacks`` in order; a target id already
    listed, or a weighted target's, is not repeated. The one place of that order: ``decide`` appends it to the
    pick's ranked targets; readiness (``candidates``) and the weights warnings read it too."""
    seen = {t.id for t in route.targets if t.weight > 0}
    out = []
    for t in (*(t for t in route.targets if t.weight <= 0), *route.fallbacks):
        if t.id not in seen:
            seen.add(t.id)
            out.append(t)
    return out


def candidates(route: Route) -> list[Target]:
    """Every target a request on ``route`` may be sent to, in the route's order: its weighted targets (weight > 0;
    a request tries them ranked by its pick), then ``spares``. A route can serve while one of them can answer."""
    return [t for t in route.targets if t.weight > 0] + spares(route)


def with_weights(route: Route, weights: dict[str, float]) -> Route:
    """A copy of ``route`` with target weights replaced by ``weights``
    (target id or backend name -> weight).

    Raises:
        ValueError: a key names no target of the route, or a weight < 0.
    """
    by_key = {}
    for t in route.targets:
        by_key[t.id] = t
        by_key.setdefault(t.backend, t)
    unknown = [k for k in weights if k not in by_key]
    if unknown:
        raise ValueError(f"route {route.name!r} has no target {', '.join(map(repr, unknown))}; "
                         f"targets: {', '.join(t.id for t in route.targets)}")
    new_w = {by_key[k].id: float(w) for k, w in weights.items()}
    targets = tuple(Target(t.backend, t.model, new_w.get(t.id, t.weight), t.input_price, t.output_price, t.id,
                           t.cached_input_price) for t in route.targets)
    return Route(route.name, targets, route.fallbacks, route.select, route.affinity, route.slo, route.sticky)


def sticky_key(route: Route, prefix: str, user: str) -> str:
    """The string that keeps a conversation on one target of ``route`` (its ``sticky``): the hash of the
    prompt's leading text blocks (``prefix``: ``affinity.prefix_text``) or the ``user``; "" when the route is
    not sticky or the request has neither."""
    if route.sticky == "prefix" and prefix:
        return "prefix:" + prefix_key(prefix, route.affinity)
    if route.sticky == "user" and user:
        return "user:" + user
    return ""


def home_target(targets: list[Target], key: str) -> str:
    """The id of the target that ``key``'s conversation calls home: the top weighted rendezvous score (as the
    canary pick), so every gateway replica agrees without sharing state."""
    live = [t for t in targets if t.weight > 0]
    if not key or not live:
        return ""
    return max(live, key=lambda t: t.weight / -math.log(hash_unit(key, t.id))).id


def with_prices(route: Route, prices: dict[str, tuple[float, float]]) -> Route:
    """A copy of ``route`` whose targets and fallbacks on a backend in ``prices`` (backend name -> (input,
    output) USD per million tokens) carry those prices; ``route`` itself when none does."""
    def priced(ts: tuple[Target, ...]) -> tuple[Target, ...]:
        return tuple(replace(t, input_price=prices[t.backend][0], output_price=prices[t.backend][1])
                     if t.backend in prices else t for t in ts)
    if not any(t.backend in prices for t in (*route.targets, *route.fallbacks)):
        return route
    return replace(route, targets=priced(route.targets), fallbacks=priced(route.fallbacks))
