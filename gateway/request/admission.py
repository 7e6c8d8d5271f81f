"""Admission: what a routed request must pass before any backend is called. First the RPM/TPM limits of its
virtual key and tenant (``gateway/resilience/ratelimit.py``), then its tenant's budget (``gateway/billing/
usage.py``), which gives the rate limits' admission back when it refuses: a 429 is an admission decision, taken
here, never by observability.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.billing.prices import NANO, Price, cost_nusd, format_usd
from gateway.billing.usage import PERIOD_ADJECTIVE, Budget, BudgetReservation, UsageLedger
from gateway.errors import ClientError
from gateway.request.auth import bearer
from gateway.resilience.layer import Resilience
from gateway.resilience.ratelimit import RateReservation
from gateway.values import GatewayRequest
from policies import tenant_label


@dataclass(frozen=True)
class Admission:
    """An admitted request's holds: its rate-limit ``rate`` reservation (``tokens`` reserved), its ``budget``
    reservation (of ``budget_spec``), and the ``x-ratelimit-*`` headers of the answer."""

    tokens: int
    rate: RateReservation | None = None
    budget: BudgetReservation | None = None
    budget_spec: Budget | None = None
    headers: dict[str, str] = field(default_factory=dict)


def reserved_completion_tokens(req: GatewayRequest, cfg) -> int:
    """The completion tokens admission reserves for ``req``: ``max_tokens`` (else
    ``limits.default_completion_tokens``) for each completion it generates (``GatewayRequest.sequences``: ``n``,
    completions' ``best_of``); the TPM limits and the budget reserve the same count."""
    return (req.max_tokens if req.max_tokens is not None else cfg.limits.default_completion_tokens) * req.sequences


def estimate_nusd(cfg, targets, prompt_tokens: int, completion_tokens: int,
                  live: Mapping[str, Price] | None = None) -> int:
    """Estimate of a request's cost, nano-USD: ``prompt_tokens`` and ``completion_tokens``
    (``reserved_completion_tokens``) at the highest input and output prices among ``targets`` (``live``: backend ->
    the price it is billed at now, the local engine's from ``local.cost``, instead of its configured one). Not a
    bound: an estimated prompt (~4 characters a token) can be shorter than an upstream's count with its template
    (an ops trial: 10 reserved, 15 billed); the settle after the answer bills the real count."""
    best = Price()
    for t in targets:
        b = cfg.backends.get(t.backend)
        if b is not None:
            p = (live or {}).get(t.backend) or Price.of(b.prices)
            best = Price(max(best.input, p.input), max(best.output, p.output))
    return cost_nusd(best, prompt_tokens, completion_tokens)


def _budget_exceeded(req: GatewayRequest, budget: Budget, check, est: int) -> ClientError:
    """The 429 ``budget_exceeded`` of a request its tenant's budget refused: what was spent and what requests in
    flight hold, and the request's estimate; one estimated above the whole budget says so, as no later period admits
    it (a budget trial read "has used $0.0095" with nothing spent, and a retry-after for a request that never fits)."""
    held = f" (and {format_usd(check.reserved_nusd / NANO)} held by requests in flight)" if check.reserved_nusd else ""
    why = (f"this request alone is estimated at {format_usd(est / NANO)}, more than the whole budget: lower its "
           "max_tokens" if est > budget.usd * NANO else f"this request is estimated at {format_usd(est / NANO)}")
    return ClientError(
        429, f"Budget exceeded: tenant '{tenant_label(req.tenant)}' has used {format_usd(check.spent_nusd / NANO)}"
             f"{held} of its {format_usd(budget.usd)} {PERIOD_ADJECTIVE[budget.period]} budget ({why}: its prompt "
             "counted roughly, its max_tokens in full, at its targets' highest prices).",
        code="budget_exceeded", headers={"retry-after": str(int(check.resets_in_s) + 1)})


async def admit(req: GatewayRequest, targets, resilience: Resilience, usage: UsageLedger, cfg,
                live: Mapping[str, Price] | None = None) -> Admission:
    """Check and record the request's rate limits, then reserve its estimated cost in its tenant's budget.

    Args:
        req: the request (``prompt_tokens`` and ``max_tokens`` size the reservations).
        targets: the decision's targets (their highest prices bound the cost).
        cfg: the ``GatewayConfig`` of the request's config generation.
        live: ``estimate_nusd``'s (a budget trial's local answers were reserved at the configured prices).

    Raises:
        ClientError: 429 ``rate_limit_exceeded`` (503 ``rate_limiter_unavailable`` fail-closed) or 429
            ``budget_exceeded``, with ``Retry-After``.
    """
    completion = reserved_completion_tokens(req, cfg)
    tokens = int(req.prompt_tokens or 0) + completion
    # Rate limits before the budget: a request they reject must not hold a budget reservation.
    rl = await resilience.admit(req.tenant, bearer(req.headers.get("authorization")), tokens, req.request_id,
                                guessed=completion if req.max_tokens is None else 0)
    if not rl.allowed:
        raise rl.error()
    bcfg = cfg.budgets.tenants.get(tenant_label(req.tenant))
    if bcfg is None:
        return Admission(tokens, rl.reservation, headers=rl.headers())
    budget = Budget(bcfg.usd, bcfg.period)
    est = estimate_nusd(cfg, targets, req.prompt_tokens, completion, live)
    check = await usage.reserve(req.tenant, req.request_id, est, budget)
    if check.unavailable or not check.admitted:    # refused: it reaches no backend, so it uses no rate limit
        await resilience.release(rl.reservation)
    if check.unavailable:
        raise ClientError(503, "Budget unavailable: shared state is unreachable and budgets fail closed "
                               "(state.fail_closed_limits); retry later.", code="budget_unavailable",
                          headers={"retry-after": str(int(check.resets_in_s) + 1)})
    if not check.admitted:
        raise _budget_exceeded(req, budget, check, est)
    return Admission(tokens, rl.reservation, check.reservation, budget, rl.headers())
