"""The local engine's price per token from what it costs to run (``local.cost.usd_per_hour``) and what it served.

Each interval (``interval_s``) costs ``usd_per_hour * interval_s / 3600``. That money is spread over the tokens
the engine computed in the interval, a prompt (prefill) token and a generated (decode) token weighted by the
time each takes as the engine measures it (``engine/core/ttft.py``: seconds per prefill token = 1 / prefill rate; per
decode token = a decode step's seconds / the rows a decode step carries). A busy engine is cheap per token, an
idle one dear; an interval that served nothing keeps the last prices. Until the first interval ends the
configured ``prices`` hold for routing. The prices are USD per million tokens, as every backend's.

An interval is closed when the gateway next looks (a request's routing) after ``interval_s``: one looked at late
is charged ``interval_s`` (the idle rest served nothing), not all the time since. An answer is billed at the
price of the interval its tokens were computed in, as it stands when the answer ends (``billed``), not at the
last closed interval's: a FinOps trial's answers after an idle interval were billed at its price, 74 times their
machine time (the ledger 3.7 times the machine's cost).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.billing.prices import Price

# Weight of one sample of the decode batch size (rows per decode step) in its running mean.
_ROWS_ALPHA = 0.2


def token_prices(usd: float, prefill_tokens: int, decode_tokens: int, prefill_s_per_token: float,
                 decode_s_per_token: float) -> tuple[float, float] | None:
    """(input, output) USD per million tokens that spread ``usd`` over the tokens served, each weighted by its
    seconds; None when nothing was served."""
    work = prefill_tokens * prefill_s_per_token + decode_tokens * decode_s_per_token
    if work <= 0:
        return None
    per_second = usd / work
    return per_second * prefill_s_per_token * 1e6, per_second * decode_s_per_token * 1e6


@dataclass
class _Interval:
    start: float
    prompt_total: int
    generation_total: int


class LocalCost:
    """Per-token prices of the local engine, recomputed every ``interval_s`` seconds (state of the gateway)."""

    def __init__(self, usd_per_hour: float, interval_s: float, initial: Price) -> None:
        self.usd_per_hour, self.interval_s = usd_per_hour, interval_s
        self.price = initial
        self._interval: _Interval | None = None
        self._rows = 1.0

    def observe(self, stats, now: float) -> Price:
        """The current price after looking at the engine's ``stats`` (``EngineStats``) at ``now`` (monotonic
        seconds); closes the interval when it is over."""
        state = stats.ttft
        if state is None:
            return self.price
        if state.decode_rows:
            self._rows += _ROWS_ALPHA * (state.decode_rows - self._rows)
        iv = self._interval
        if iv is None:
            self._interval = _Interval(now, stats.prompt_tokens_total, stats.generation_tokens_total)
            return self.price
        if now - iv.start < self.interval_s:
            return self.price
        self.price = self._interval_price(iv, stats, now) or self.price
        self._interval = _Interval(now, stats.prompt_tokens_total, stats.generation_tokens_total)
        return self.price

    def billed(self, stats, now: float) -> Price:
        """The price an answer of the local engine ending at ``now`` is billed at: the open interval's so far (its
        seconds, at most ``interval_s``, over the tokens computed in it by ``now``, the answer's among them); the
        last prices when it computed nothing or none is open."""
        iv = self._interval
        if iv is None or stats.ttft is None:
            return self.price
        return self._interval_price(iv, stats, now) or self.price

    def _interval_price(self, iv: _Interval, stats, now: float) -> Price | None:
        """The price of interval ``iv`` up to ``now`` (charged at most ``interval_s``); None: no tokens in it."""
        state = stats.ttft
        usd = self.usd_per_hour * min(now - iv.start, self.interval_s) / 3600.0
        prices = token_prices(usd, stats.prompt_tokens_total - iv.prompt_total,
                              stats.generation_tokens_total - iv.generation_total, 1.0 / state.prefill_tok_s,
                              state.step_s / max(self._rows, 1.0))
        return None if prices is None else Price(prices[0], prices[1], None)


def running_cost(gw, snap) -> tuple[LocalCost, object] | None:
    """(``gw.local_cost``, the local backend) while the local engine of config generation ``snap`` has
    ``local.cost``; None otherwise (a reload may have removed the setting, leaving the object behind). The ledger's
    price (``Gateway.local_billing_price``) and the budget's estimate (``pipeline.handle``) follow this one rule."""
    local = snap.local if snap is not None else None
    if gw.local_cost is None or local is None or local.cfg.cost is None:
        return None
    return gw.local_cost, local


def local_price(gw, local, now: float) -> Price:
    """The co-located engine's current price for routing: ``gw.local_cost`` (created, or replaced when the
    backend's ``cost`` settings changed with a reload) observing ``local``'s (a ``LocalBackend``) engine."""
    cfg = local.cfg.cost
    lc = gw.local_cost
    if lc is None or (lc.usd_per_hour, lc.interval_s) != (cfg.usd_per_hour, cfg.interval_s):
        lc = gw.local_cost = LocalCost(cfg.usd_per_hour, cfg.interval_s, Price.of(local.cfg.prices))
    return lc.observe(local.engine.get_stats(), now)
