"""Prices and the cost of a response: USD per million tokens in, exact integer nano-USD (1e-9 USD) out.

A response's cost is computed from its ``usage`` (OpenAI's ``prompt_tokens``, ``completion_tokens``,
``prompt_tokens_details.cached_tokens``) with exact decimal arithmetic, so sums over many requests never drift.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

NANO = 10**9                       # nano-USD per USD


@dataclass(frozen=True)
class Price:
    """USD per million tokens: ``input`` (prompt), ``output`` (completion),
    ``cached_input`` (cached prompt tokens; None = same as ``input``)."""

    input: float = 0.0
    output: float = 0.0
    cached_input: float | None = None

    @classmethod
    def of(cls, prices: Any) -> "Price":
        """From a ``gateway.config.backend_schema.Prices`` (or anything with those attributes)."""
        if prices is None:
            return cls()
        return cls(float(prices.input), float(prices.output),
                   None if prices.cached_input is None else float(prices.cached_input))


def cost_nusd(price: Price, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> int:
    """Cost of one response in nano-USD (integer, rounded half-even once).

    ``cached_tokens`` (<= ``prompt_tokens``) are charged at ``cached_input``
    and the rest of the prompt at ``input``; completion tokens at ``output``.
    Prices are USD per 1e6 tokens, so one token at price p costs p * 1000 nano-USD.
    """
    cached = max(0, min(int(cached_tokens or 0), int(prompt_tokens or 0)))
    fresh = max(0, int(prompt_tokens or 0) - cached)
    completion = max(0, int(completion_tokens or 0))
    pico = _pico_prices(price)
    if pico is not None:        # the common case: integer arithmetic in pico-USD per token
        q, r = divmod(fresh * pico[0] + cached * pico[1] + completion * pico[2], 1000)
        return q + (1 if r > 500 or (r == 500 and q % 2 == 1) else 0)
    cached_price = price.input if price.cached_input is None else price.cached_input
    total = (Decimal(fresh) * Decimal(repr(price.input)) + Decimal(cached) * Decimal(repr(cached_price))
             + Decimal(completion) * Decimal(repr(price.output))) * 1000
    return int(total.to_integral_value(rounding=ROUND_HALF_EVEN))


@functools.lru_cache(maxsize=256)
def _pico_prices(price: Price) -> tuple[int, int, int] | None:
    """(input, cached input, output) in pico-USD per token when all are exact (<= 6 decimals), else None."""
    cached = price.input if price.cached_input is None else price.cached_input
    out = []
    for p in (price.input, cached, price.output):
        v = Decimal(repr(p)) * 10**6
        if v != v.to_integral_value():
            return None
        out.append(int(v))
    return out[0], out[1], out[2]


def cost_usd(price: Price, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
    """``cost_nusd`` in USD (float, for display and metrics)."""
    return cost_nusd(price, prompt_tokens, completion_tokens, cached_tokens) / NANO


def monthly_cost_usd(price: Price, tokens_per_month: int, input_share: float = 0.75) -> float:
    """USD per month for ``tokens_per_month`` tokens of which ``input_share``
    are prompt tokens (no cache hits): the ROI table of ``tandem cost estimate``."""
    if not 0.0 <= input_share <= 1.0:
        raise ValueError(f"input_share must be within [0, 1], got {input_share}")
    prompt = round(tokens_per_month * input_share)
    return cost_usd(price, prompt, tokens_per_month - prompt)


# Token counts a backend's ``usage`` may report: a larger one is a fault (a FinOps trial's upstream said 10**15
# tokens: 10 billion USD against a 0.05 USD budget, the tenant locked out for the month).
MAX_REPORTED_TOKENS = 10**9


def _reported_count(value: object) -> int | None:
    """A token count as a backend reports it: a whole number in [0, ``MAX_REPORTED_TOKENS``) (a JSON integer, or a
    float with nothing after the point); None for anything else (negative, fractional, a string, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < MAX_REPORTED_TOKENS:
        return None
    return int(value) if int(value) == value else None


def usage_tokens(usage: dict | None) -> tuple[int, int, int] | None:
    """(prompt, completion, cached prompt) tokens of an OpenAI ``usage`` object (chat's names, or the Responses
    API's: ``input_tokens``, ``output_tokens``, ``input_tokens_details``); None when it is absent or counts nothing
    billable (``{}``, ``total_tokens`` alone) or a count is not one (``_reported_count``): the gateway then counts
    the answer itself (``usage_estimated``). A FinOps trial's ``{}`` was billed 0 USD, unflagged, and a negative
    count gave the client a 500 after the ledger took it."""
    if not isinstance(usage, dict):
        return None
    p = usage.get("prompt_tokens", usage.get("input_tokens"))
    c = usage.get("completion_tokens", usage.get("output_tokens"))
    if p is None and c is None:
        return None
    det = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = det.get("cached_tokens") if isinstance(det, dict) else None
    counts = tuple(_reported_count(0 if v is None else v) for v in (p, c, cached))
    return None if None in counts else counts


def format_usd(x: float) -> str:
    """Money as money: ``$1,234.50``, ``$0.05``; an amount under a dollar keeps up to 4 decimals (``$0.0429``: an
    observability trial's budget refusal said "$0.04 of its $0.04" for $0.0429 of $0.0435), one under a cent 6
    (``$0.000001``, never ``$1e-06``)."""
    if x == 0 or abs(x) >= 1:
        return f"${x:,.2f}"
    if abs(x) < 0.01:
        return f"${x:.6f}"
    whole, frac = f"{x:.4f}".split(".")
    return f"${whole}.{frac.rstrip('0').ljust(2, '0')}"
