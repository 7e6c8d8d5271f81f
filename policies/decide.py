"""The policy: ordered rules -> a route -> ordered attempts, explained."""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.features import RequestFeatures, Signals
from policies.routes import Pick, Route, Target, home_target, pick_target, spares, sticky_key, with_prices
from policies.rules import Match, match
from policies.slo import Slo


@dataclass(frozen=True)
class Rule:
    """``when match: use route``. A rule with an empty match always matches. Its ``slo`` (e.g. for a tenant or
    a priority) replaces the route's."""

    name: str
    route: str
    match: Match = Match()
    slo: Slo | None = None


@dataclass(frozen=True)
class Policy:
    """Rules in order (first match wins), the routes they name, the
    ``default_route`` when none matches, and where the canary key comes from
    (``canary_key``: ``user``, ``header:<name>`` or ``request_id``; the
    request id is always the last resort)."""

    rules: tuple[Rule, ...]
    routes: dict[str, Route]
    default_route: str
    canary_key: str = "user"

    def __post_init__(self) -> None:
        for r in self.rules:
            if r.route not in self.routes:
                raise ValueError(f"rule {r.name!r} names unknown route {r.route!r}")
        if self.default_route not in self.routes:
            raise ValueError(f"default_route names unknown route {self.default_route!r}")
        if not (self.canary_key in ("user", "request_id") or self.canary_key.startswith("header:")):
            raise ValueError(f"canary_key must be user, request_id or header:<name>, got {self.canary_key!r}")
        # Read for every request (``gateway/request/pipeline.py``): derived once per policy, i.e. per config
        # generation, not per request.
        object.__setattr__(self, "_needs_prefix", any(
            r.select == "prefix_affinity" or r.sticky == "prefix" for r in self.routes.values()))
        object.__setattr__(self, "_has_slo", any(r.slo for r in self.rules) or any(
            r.slo for r in self.routes.values()))

    def fields(self) -> set[str]:
        """Every feature any rule looks at (the gateway computes the costly
        ones, like ``prompt_tokens``, only when listed here)."""
        out: set[str] = set()
        for r in self.rules:
            out |= r.match.fields()
        if self.has_slo():
            out.add("prompt_tokens")   # an SLO prices the prompt and predicts the engine's TTFT for it
        return out

    def needs_prefix(self) -> bool:
        """Some route hashes the prompt's leading text (``prefix_affinity``, ``sticky: prefix``)."""
        return self._needs_prefix

    def has_slo(self) -> bool:
        """Some rule or route routes by a TTFT SLO (the gateway then gathers ``Signals.ttft``)."""
        return self._has_slo


@dataclass
class Decision:
    """Where a request goes, and why.

    Attributes:
        rule: the matched rule's name ("default" when none matched).
        route: the route's name.
        attempts: targets to try in order (the pick, the route's other live
            targets of weight > 0 by rank, then its targets of weight 0, then
            fallbacks), unavailable ones already removed.
        canary_key: the string hashed for the canary arm.
        pick: the canary/cheapest pick with scores and skipped targets.
        trace: one line per rule evaluated.
    """

    rule: str
    route: str
    attempts: list[Target]
    canary_key: str
    pick: Pick
    trace: list[str] = field(default_factory=list)

    def explain(self) -> str:
        """A human-readable multi-line explanation."""
        lines = ["rules:"] + [f"  {t}" for t in self.trace]
        lines.append(f"matched rule: {self.rule} -> route {self.route}")
        lines.append(f"canary key: {self.canary_key!r}")
        for tid, why in self.pick.skipped.items():
            lines.append(f"skipped {tid}: {why}")
        if self.pick.scores:
            lines.append("scores: " + ", ".join(f"{k}={v:.4f}" for k, v in self.pick.scores.items()))
        if self.pick.target is not None:
            lines.append(f"chosen: {self.pick.target.id} ({self.pick.reason})")
        else:
            lines.append(f"chosen: no target ({self.pick.reason}); "
                         + (f"{self.attempts[0].id} serves it (weight 0 or fallback)" if self.attempts
                            else "the gateway answers 503"))
        lines.append("attempts: " + (" -> ".join(t.id for t in self.attempts) or "(none available)"))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "rule": self.rule, "route": self.route, "canary_key": self.canary_key,
            "chosen": self.pick.target.id if self.pick.target else None, "reason": self.pick.reason,
            "scores": self.pick.scores, "skipped": self.pick.skipped,
            "attempts": [{"id": t.id, "backend": t.backend, "model": t.model} for t in self.attempts],
            "trace": self.trace,
        }


def canary_key(policy: Policy, f: RequestFeatures) -> str:
    """The string that decides the canary arm (stable per user)."""
    if policy.canary_key == "user" and f.user:
        return f"user:{f.user}"
    if policy.canary_key.startswith("header:"):
        v = f.headers.get(policy.canary_key[7:].lower())
        if v:
            return f"header:{v}"
    return f"request:{f.request_id}"


def decide(policy: Policy, f: RequestFeatures, s: Signals, explain: bool = False) -> Decision:
    """Evaluate ``policy`` for one request. Pure: no I/O, no clock.

    First matching rule wins (else ``default_route``). The route's first
    choice comes from ``pick_target``; the route's other live targets follow
    in ``Pick.ranked`` order (a failed or cooling-down target fails over to
    its siblings first), then ``routes.spares``: the route's targets of
    weight 0 (no share of the traffic, but the failover before any fallback),
    then the explicit ``fallbacks``; minus unavailable backends and
    duplicates."""
    trace: list[str] | None = [] if explain else None
    chosen_rule = None
    for rule in policy.rules:
        why: list[str] | None = [] if explain else None
        ok = match(rule.match, f, s, why)
        if trace is not None:
            trace.append(f"{rule.name}: {'MATCH' if ok else 'no'}" + (f" [{'; '.join(why)}]" if why else ""))
        if ok:
            chosen_rule = rule
            break
    route_name = chosen_rule.route if chosen_rule else policy.default_route
    route = with_prices(policy.routes[route_name], s.prices)
    key = canary_key(policy, f)
    slo = chosen_rule.slo if chosen_rule is not None and chosen_rule.slo is not None else route.slo
    # A sticky route keeps a conversation on one target (its provider's prompt cache stays warm): its key
    # replaces the canary key of a weighted pick; an SLO pick prices the conversation's home at its cached rate.
    sticky = sticky_key(route, f.prefix_text, f.user)
    if sticky and slo is None:
        key = sticky
    home = home_target([t for t in route.targets if t.backend not in s.unavailable], sticky) if slo else ""
    pick = pick_target(route, key, s.unavailable, f.prefix_text, s.replica_load, slo, s.ttft, f.prompt_tokens,
                       f.max_tokens, home)
    attempts: list[Target] = list(pick.ranked)
    for t in spares(route):
        if t.backend in s.unavailable:
            pick.skipped.setdefault(t.id, s.unavailable[t.backend])
        else:
            attempts.append(t)
    return Decision(chosen_rule.name if chosen_rule else "default", route_name, attempts, key, pick, trace or [])
