"""Cost accounting and per-tenant budgets.

Prices are USD per million tokens (``backends.<name>.prices``: ``input``,
``output``, optional ``cached_input`` for prompt tokens the upstream served
from its prompt cache). A response's cost is computed from its ``usage``
(OpenAI's ``prompt_tokens``, ``completion_tokens``,
``prompt_tokens_details.cached_tokens``) in integer nano-USD (1e-9 USD), with
exact decimal arithmetic, so sums over many requests never drift.

State (``gateway.state.SharedState``: Redis when configured, in-process
otherwise and while Redis is down), keys ``<prefix>:<kind>:<id>`` with TTLs:

- ``<prefix>:usage:<tenant>:<YYYYMMDD>`` (hash, UTC day, TTL 400 days): per
  backend ``<backend>|req``, ``|in``, ``|out``, ``|cached``, ``|nusd``.
  ``<prefix>:usage:tenants`` (set) lists the tenants seen.
- ``<prefix>:budget:<tenant>:<period id>`` (hash: ``spent``, ``reserved``,
  ``r:<request id>`` = reserved nano-USD) and ``...:res`` (sorted set:
  request id -> expiry ms). Period ids: ``d20261129`` (day) or ``m202611``
  (month), UTC.

- ``<prefix>:ledger:<tenant>:<YYYYMMDD>`` (hash, TTL ``budgets.record_ttl_s``):
  request id -> its usage record ``backend|in|out|cached|nusd|flags`` (flags:
  ``e`` usage estimated, ``d`` client disconnected). One record per request:
  the settle script writes it first (``HSETNX``) and does nothing else when it
  exists, so a settle replayed or run twice counts once.

Budgets: before a request is forwarded, ``reserve`` atomically (one Lua
script) checks ``spent + reserved + estimate <= budget`` and adds the
estimate to ``reserved``; otherwise the request gets 429 ``budget_exceeded``.
The estimate is the request's estimated prompt tokens and its ``max_tokens``
(or ``limits.default_completion_tokens``) at the highest prices among the
decision's targets. ``settle`` replaces the reservation with the real cost
(also one script) and adds the usage. A reservation never settled (a replica
crashed) expires after ``budgets.reservation_ttl_s``. The reserve script
carries its caller's deadline (wall-clock ms: now + ``state.socket_timeout_s``)
and does nothing once Redis's own clock is past it: a script queued behind a
slow Redis, whose caller already gave up and went on in process, holds nothing.

Redis outage (``SharedState`` degraded): a settle goes to the in-process twin
and to the local journal (``gateway/billing/journal.py``), replayed on rejoin.
Budgets are checked in process against the last remaining budget this replica
read from Redis (``spent + reserved`` of the last reserve) plus its own spend
since; with ``state.fail_closed_limits`` a tenant with a budget gets 503
``budget_unavailable`` instead.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import functools
import logging
import time
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from gateway.billing.journal import Journal, JournalEntry

log = logging.getLogger("tandem.gateway.usage")

NANO = 10**9                       # nano-USD per USD
USAGE_TTL_S = 400 * 86400          # usage hashes live 400 days
_FIELDS = ("req", "in", "out", "cached", "nusd")


@dataclass(frozen=True)
class Price:
    """USD per million tokens: ``input`` (prompt), ``output`` (completion),
    ``cached_input`` (cached prompt tokens; None = same as ``input``)."""

    input: float = 0.0
    output: float = 0.0
    cached_input: float | None = None

    @classmethod
    def of(cls, prices: Any) -> "Price":
        """From a ``gateway.config.schema.Prices`` (or anything with those attributes)."""
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


def usage_tokens(usage: dict | None) -> tuple[int, int, int] | None:
    """(prompt, completion, cached prompt) tokens of an OpenAI ``usage`` object; None if absent/odd."""
    if not isinstance(usage, dict):
        return None
    try:
        p = int(usage.get("prompt_tokens") or 0)
        c = int(usage.get("completion_tokens") or 0)
        det = usage.get("prompt_tokens_details") or {}
        cached = int(det.get("cached_tokens") or 0) if isinstance(det, dict) else 0
    except (TypeError, ValueError):
        return None
    return p, c, cached


@functools.lru_cache(maxsize=8)
def _utc_day(day_number: int) -> str:
    """``YYYYMMDD`` of the UTC day ``day_number`` (days since the epoch)."""
    return (_dt.date(1970, 1, 1) + _dt.timedelta(days=day_number)).strftime("%Y%m%d")


def period_id(period: str, now_s: float | None = None) -> str:
    """``d<YYYYMMDD>`` or ``m<YYYYMM>`` (UTC) of ``now_s`` (epoch seconds).

    Raises:
        ValueError: period not "day" or "month"."""
    t = _dt.datetime.fromtimestamp(time.time() if now_s is None else now_s, _dt.timezone.utc)
    if period == "day":
        return t.strftime("d%Y%m%d")
    if period == "month":
        return t.strftime("m%Y%m")
    raise ValueError(f"period must be day or month, got {period!r}")


def period_end_s(period: str, now_s: float) -> float:
    """Epoch seconds when the period containing ``now_s`` ends (UTC)."""
    t = _dt.datetime.fromtimestamp(now_s, _dt.timezone.utc)
    if period == "day":
        start = _dt.datetime(t.year, t.month, t.day, tzinfo=_dt.timezone.utc)
        return (start + _dt.timedelta(days=1)).timestamp()
    y, m = (t.year + 1, 1) if t.month == 12 else (t.year, t.month + 1)
    return _dt.datetime(y, m, 1, tzinfo=_dt.timezone.utc).timestamp()


def parse_since(since: str | None, now_s: float | None = None) -> _dt.date:
    """The first UTC day of a report: ``YYYY-MM-DD``, an ISO datetime, ``Nd``
    (N days back, ``0d`` = today), or None (today).

    Raises:
        ValueError: anything else."""
    now = _dt.datetime.fromtimestamp(time.time() if now_s is None else now_s, _dt.timezone.utc)
    if not since:
        return now.date()
    s = since.strip()
    if s.endswith("d") and s[:-1].isdigit():
        return (now - _dt.timedelta(days=int(s[:-1]))).date()
    try:
        return _dt.date.fromisoformat(s[:10])
    except ValueError:
        raise ValueError(f"since must be YYYY-MM-DD, an ISO datetime or Nd (days back), got {since!r}") from None


def _days(since: _dt.date, now_s: float) -> list[str]:
    today = _dt.datetime.fromtimestamp(now_s, _dt.timezone.utc).date()
    start = max(since, today - _dt.timedelta(days=USAGE_TTL_S // 86400))
    n = (today - start).days
    return [(start + _dt.timedelta(days=i)).strftime("%Y%m%d") for i in range(n + 1)] if n >= 0 else []


# KEYS: budget hash, reservations zset. ARGV: now_ms, request id, estimate nusd, budget nusd, key ttl s, hold ms,
# deadline ms (the caller's wall clock; past it on Redis's clock the caller has given up: -1, nothing done).
# Returns {admitted 1/0, spent, reserved} (before this reservation), or {-1, 0, 0} when late.
_RESERVE_LUA = """
local t = redis.call('TIME')
if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > tonumber(ARGV[7]) then
  return {-1, 0, 0}
end
local now = tonumber(ARGV[1])
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, rid in ipairs(expired) do
  local a = redis.call('HGET', KEYS[1], 'r:' .. rid)
  if a then
    redis.call('HINCRBY', KEYS[1], 'reserved', 0 - tonumber(a))   -- not '-' .. a: -0 is no integer to Redis
    redis.call('HDEL', KEYS[1], 'r:' .. rid)
  end
end
if #expired > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) end
local spent = tonumber(redis.call('HGET', KEYS[1], 'spent') or '0')
local reserved = tonumber(redis.call('HGET', KEYS[1], 'reserved') or '0')
if spent + reserved + tonumber(ARGV[3]) > tonumber(ARGV[4]) then
  return {0, spent, reserved}
end
redis.call('HINCRBY', KEYS[1], 'reserved', ARGV[3])
redis.call('HSET', KEYS[1], 'r:' .. ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return {1, spent, reserved}
"""

def _drop_reservation_lua(budget: str, zset: str, rid: str) -> str:
    """Lua that drops reservation ``rid`` (if still held) from ``budget``'s reserved total and ``zset``."""
    return f"""
local a = redis.call('HGET', {budget}, 'r:' .. {rid})
if a then
  redis.call('HINCRBY', {budget}, 'reserved', 0 - tonumber(a))
  redis.call('HDEL', {budget}, 'r:' .. {rid})
  redis.call('ZREM', {zset}, {rid})
end
"""


# KEYS: usage day hash, tenants set, budget hash ('' slot unused when no budget), reservations zset, ledger hash.
# ARGV: backend, requests, in, out, cached, nusd, usage ttl s, tenant, request id ('' = no reservation),
#       budget key ttl s ('0' = no budget), request id (the record's key), record, record ttl s.
# Returns 1, or 0 when the request's record exists already (settled before: nothing done).
_SETTLE_LUA = """
if redis.call('HSETNX', KEYS[5], ARGV[11], ARGV[12]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[5], ARGV[13])
local b = ARGV[1]
redis.call('HINCRBY', KEYS[1], b .. '|req', ARGV[2])
redis.call('HINCRBY', KEYS[1], b .. '|in', ARGV[3])
redis.call('HINCRBY', KEYS[1], b .. '|out', ARGV[4])
redis.call('HINCRBY', KEYS[1], b .. '|cached', ARGV[5])
redis.call('HINCRBY', KEYS[1], b .. '|nusd', ARGV[6])
redis.call('EXPIRE', KEYS[1], ARGV[7])
redis.call('SADD', KEYS[2], ARGV[8])
redis.call('EXPIRE', KEYS[2], ARGV[7])
if ARGV[10] ~= '0' then
  if ARGV[9] ~= '' then
""" + _drop_reservation_lua("KEYS[3]", "KEYS[4]", "ARGV[9]") + """
  end
  redis.call('HINCRBY', KEYS[3], 'spent', ARGV[6])
  redis.call('EXPIRE', KEYS[3], ARGV[10])
  redis.call('EXPIRE', KEYS[4], ARGV[10])
end
return 1
"""

# KEYS: budget hash, reservations zset. ARGV: request id.  Drops a reservation (request refused before any call).
_RELEASE_LUA = _drop_reservation_lua("KEYS[1]", "KEYS[2]", "ARGV[1]") + "return 1\n"


def format_usd(x: float) -> str:
    """Money as money: ``$1,234.50``, ``$0.05``; an amount under a cent keeps 6 decimals (``$0.000001``, never
    ``$1e-06``)."""
    if x == 0 or abs(x) >= 0.01:
        return f"${x:,.2f}"
    return f"${x:.6f}"


PERIOD_ADJECTIVE = {"day": "daily", "month": "monthly"}


@dataclass
class Budget:
    """A tenant's budget: ``usd`` per ``period`` ("day" | "month", UTC)."""

    usd: float
    period: str = "month"


@dataclass
class BudgetReservation:
    """An admitted request's hold on its tenant's budget (nano-USD)."""

    tenant: str
    request_id: str
    period: str
    period_id: str
    nusd: int


@dataclass
class BudgetCheck:
    """``reserve``'s answer: admitted, and the budget's state before it (nano-USD)."""

    admitted: bool
    reservation: BudgetReservation | None = None
    spent_nusd: int = 0
    reserved_nusd: int = 0
    budget_nusd: int = 0
    resets_in_s: float = 0.0
    unavailable: bool = False      # fail-closed: Redis unreachable, the budget cannot be checked


@dataclass(frozen=True)
class UsageRecord:
    """The one usage record of an answered request: tokens (OpenAI's names) and cost ``nusd`` (nano-USD) of
    ``backend``'s answer to ``tenant``; ``estimated``: counted by the gateway (the backend gave no usage);
    ``disconnected``: the client left a stream before its end (billed for what it was sent)."""

    request_id: str
    tenant: str
    backend: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    nusd: int
    estimated: bool = False
    disconnected: bool = False

    def encode(self) -> str:
        """``backend|in|out|cached|nusd|flags``, as the ledger hash stores it."""
        flags = ("e" if self.estimated else "") + ("d" if self.disconnected else "")
        return (f"{self.backend}|{int(self.prompt_tokens)}|{int(self.completion_tokens)}|{int(self.cached_tokens)}"
                f"|{int(self.nusd)}|{flags}")


@dataclass
class _MemBudget:
    spent: int = 0                 # in process: all spend (no Redis); degraded: this replica's spend since ``base``
    reserved: int = 0
    holds: dict[str, tuple[int, int]] = field(default_factory=dict)   # request id -> (nusd, expiry ms)
    base: int = 0                  # spent + reserved in Redis at this replica's last reserve there (0: no Redis)


def tenant_label(tenant: str) -> str:
    """The tenant as stored and labelled (anonymous mode has no tenant)."""
    return tenant or "anonymous"


class UsageLedger:
    """Usage and budgets of all tenants on a ``SharedState`` (Redis or in-process).

    Args:
        state: ``gateway.state.SharedState`` (its ``run`` gives atomic Lua on
            Redis with the in-process fallback while Redis is unreachable).
        reservation_ttl_s: seconds after which an unsettled reservation lapses.
        record_ttl_s: seconds a request's usage record is kept in Redis (the
            window in which a replayed settle is recognised).
        journal: where settles made during an outage wait for Redis.
    """

    def __init__(self, state, reservation_ttl_s: float = 600.0, record_ttl_s: float = 8 * 86400,
                 journal: Journal | None = None):
        self.state = state
        self.reservation_ttl_s = reservation_ttl_s
        self.record_ttl_s = record_ttl_s
        self.journal = journal if journal is not None else Journal()
        self.replays = 0               # journal entries replayed onto Redis (a duplicate included)
        self._replaying = asyncio.Lock()
        if getattr(state, "redis", None) is not None:
            state.on_rejoin(self.replay)
        # The in-process fallback lives in the state's own memory (one per process, like the other fallbacks).
        mem = getattr(state, "memory", None)
        mem = mem if isinstance(mem, dict) else {}
        self._usage: dict[tuple[str, str], dict[str, int]] = mem.setdefault("usage:days", {})  # (tenant, day) -> counts
        self._budgets: dict[str, _MemBudget] = mem.setdefault("usage:budgets", {})            # budget key -> state
        self._records: dict[str, dict[str, str]] = mem.setdefault("usage:records", {})        # ledger key -> records

    def _bkeys(self, tenant: str, pid: str) -> tuple[str, str]:
        k = self.state.key("budget", f"{tenant_label(tenant)}:{pid}")
        return k, k + ":res"

    # -- budgets -------------------------------------------------------------------------------------------------
    async def reserve(self, tenant: str, request_id: str, estimate_nusd: int, budget: Budget,
                      now_s: float | None = None) -> BudgetCheck:
        """Atomically admit a request of estimated cost ``estimate_nusd`` if it
        fits in the remaining budget; hold that amount until ``settle``."""
        now = time.time() if now_s is None else now_s
        pid = period_id(budget.period, now)
        limit = int(Decimal(repr(budget.usd)) * NANO)
        end = period_end_s(budget.period, now)
        ttl = int(end - now) + 3600
        hold_ms = int(self.reservation_ttl_s * 1000)
        bkey, rkey = self._bkeys(tenant, pid)
        est = max(0, int(estimate_nusd))
        now_ms = int(now * 1000)
        shared = self.state.redis is not None
        fail_closed = shared and self.state.config.fail_closed_limits

        def local() -> list[int]:
            if fail_closed:            # Redis unreachable: no budget decision in process
                return [-2, 0, 0]
            b = self._budgets.setdefault(bkey, _MemBudget())
            for rid, (amount, exp) in list(b.holds.items()):
                if exp <= now_ms:
                    b.reserved -= amount
                    del b.holds[rid]
            # degraded: what Redis last said was used, plus this replica's own spend and holds since
            spent, reserved = b.base + b.spent, b.reserved
            if spent + reserved + est > limit:
                return [0, spent, reserved]
            b.reserved += est
            b.holds[request_id] = (est, now_ms + hold_ms)
            return [1, spent, reserved]

        deadline_ms = int(time.time() * 1000 + self.state.config.socket_timeout_s * 1000)   # Redis's clock
        raw = await self.state.run("usage_reserve", _RESERVE_LUA, [bkey, rkey],
                                   [now_ms, request_id, est, limit, ttl, hold_ms, deadline_ms], local)
        ok, spent, reserved = int(raw[0]), int(raw[1]), int(raw[2])
        if ok == -1:                   # Redis ran it past our deadline (clock skew or a stall): decide in process
            log.warning("budget reserve of %s ran past its deadline on redis: checked in process", request_id)
            ok, spent, reserved = local()
        if ok == -2:
            return BudgetCheck(False, None, 0, 0, limit, self.state.config.reconnect_max_s, unavailable=True)
        if shared and not self.state.degraded:      # remember Redis's view for an outage
            self._budgets.setdefault(bkey, _MemBudget()).base = spent + reserved
        res = BudgetReservation(tenant, request_id, budget.period, pid, est) if ok else None
        return BudgetCheck(bool(ok), res, spent, reserved, limit, end - now)

    async def release(self, res: BudgetReservation) -> None:
        """Drop a reservation without spending (the request never reached a backend)."""
        bkey, rkey = self._bkeys(res.tenant, res.period_id)

        def local() -> int:
            b = self._budgets.get(bkey)
            if b is not None and res.request_id in b.holds:
                b.reserved -= b.holds.pop(res.request_id)[0]
            return 1

        await self.state.run("usage_release", _RELEASE_LUA, [bkey, rkey], [res.request_id], local)

    async def budget_state(self, tenant: str, budget: Budget, now_s: float | None = None) -> tuple[int, int, int]:
        """(spent, reserved, budget) nano-USD of ``tenant``'s current period."""
        now = time.time() if now_s is None else now_s
        bkey, _ = self._bkeys(tenant, period_id(budget.period, now))
        limit = int(Decimal(repr(budget.usd)) * NANO)

        async def read(r) -> tuple[int, int]:
            spent, reserved = await r.hmget(bkey, "spent", "reserved")
            return int(spent or 0), int(reserved or 0)

        def local() -> tuple[int, int]:
            b = self._budgets.get(bkey, _MemBudget())
            return b.spent, b.reserved

        spent, reserved = await self.state.call(read, local)
        return spent, reserved, limit

    # -- accounting ----------------------------------------------------------------------------------------------
    async def settle(self, record: UsageRecord, reservation: BudgetReservation | None = None,
                     budget: Budget | None = None, now_s: float | None = None) -> bool:
        """Account one request's usage ``record`` to its tenant and backend for
        today (UTC); with a ``reservation``, replace it by the real cost in the
        budget of its period. Once per request id: returns False (nothing done)
        when its record exists already. While Redis is unreachable the settle
        is applied in process and journaled for replay (returns True)."""
        now = time.time() if now_s is None else now_s
        tenant, backend, nusd = record.tenant, record.backend, record.nusd
        t = tenant_label(tenant)
        day = _utc_day(int(now // 86400))
        ukey = self.state.key("usage", f"{t}:{day}")
        tkey = self.state.key("usage", "tenants")
        lkey = self.state.key("ledger", f"{t}:{day}")
        period = reservation.period if reservation is not None else (budget.period if budget else None)
        if period is not None:
            pid = reservation.period_id if reservation is not None else period_id(period, now)
            bkey, rkey = self._bkeys(tenant, pid)
            bttl = int(period_end_s(period, now) - now) + 3600
        else:
            bkey, rkey, bttl = ukey, tkey, 0          # unused slots (the script ignores them)
        rid = reservation.request_id if reservation is not None else ""
        vals = [1, int(record.prompt_tokens), int(record.completion_tokens), int(record.cached_tokens), int(nusd)]
        keys = [ukey, tkey, bkey, rkey, lkey]
        args = [backend, *vals, USAGE_TTL_S, t, rid, bttl, record.request_id, record.encode(),
                int(self.record_ttl_s)]

        def local() -> int:
            records = self._records.get(lkey)
            if records is None:
                self._prune_records(day)
                records = self._records[lkey] = {}
            if record.request_id in records:
                return 0
            records[record.request_id] = record.encode()
            u = self._usage.setdefault((t, day), {})
            for f, v in zip(_FIELDS, vals):
                u[f"{backend}|{f}"] = u.get(f"{backend}|{f}", 0) + v
            if bttl:
                b = self._budgets.setdefault(bkey, _MemBudget())
                if rid and rid in b.holds:
                    b.reserved -= b.holds.pop(rid)[0]
                b.spent += int(nusd)
            if self.state.redis is not None:   # degraded: Redis gets it on rejoin
                self.journal.append(JournalEntry(record.request_id, keys, args, int(nusd)))
            return 1

        done = await self.state.run("usage_settle", _SETTLE_LUA, keys, args, local)
        if rid and self.state.redis is not None and not self.state.degraded:
            b = self._budgets.get(bkey)   # a hold taken in process during an outage, settled on Redis
            if b is not None and rid in b.holds:
                b.reserved -= b.holds.pop(rid)[0]
        return bool(int(done))

    def _prune_records(self, day: str) -> None:
        """In process, keep the records of ``day`` and the day before only (enough to recognise a repeat)."""
        prev = _utc_day(int(_dt.datetime.strptime(day, "%Y%m%d").replace(tzinfo=_dt.timezone.utc).timestamp()
                            // 86400) - 1)
        for k in [k for k in self._records if k.rpartition(":")[2] not in (day, prev)]:
            del self._records[k]

    async def replay(self) -> int:
        """Push the journal onto Redis (the state's rejoin hook; also run at start): each entry through the
        settle script, which skips a request already recorded. Returns the entries replayed; those Redis did
        not take (it went away again) stay in the journal."""
        if self.state.redis is None:
            return 0
        async with self._replaying:
            entries = self.journal.take()
            done = 0
            try:
                for e in entries:
                    await self.state.redis_script("usage_settle", _SETTLE_LUA, e.keys, e.args)
                    done += 1
            except Exception as exc:  # noqa: BLE001 -- Redis gone again: the rest waits for the next rejoin
                log.warning("usage journal replay stopped after %d of %d: %s", done, len(entries), exc)
                self.journal.put_back(entries[done:])
            else:
                self.journal.compact()
            self.replays += done
            self._rebase(entries[:done])
            if done:
                log.warning("usage journal: %d settles made during the outage replayed onto redis", done)
            return done

    def _rebase(self, replayed: list[JournalEntry]) -> None:
        """The in-process spend that is now in Redis moves into each budget's ``base`` (the next reserve on
        Redis refreshes it), so a next outage does not count it twice."""
        for e in replayed:
            bkey, bttl = e.keys[2], int(e.args[9])
            b = self._budgets.get(bkey) if bttl else None
            if b is not None:
                b.spent -= e.nusd
                b.base += e.nusd

    async def records(self, tenant: str, now_s: float | None = None) -> dict[str, UsageRecord]:
        """The usage records of ``tenant``'s UTC day of ``now_s``: request id -> record (Redis, or in process)."""
        now = time.time() if now_s is None else now_s
        t = tenant_label(tenant)
        lkey = self.state.key("ledger", f"{t}:{_utc_day(int(now // 86400))}")

        async def read(r) -> dict[str, str]:
            return await r.hgetall(lkey)

        raw = await self.state.call(read, lambda: dict(self._records.get(lkey, {})))
        return {rid: decode_record(rid, t, v) for rid, v in raw.items()}

    async def report(self, tenant: str | None = None, since: str | None = None,
                     now_s: float | None = None) -> dict:
        """Usage per tenant and backend from the UTC day ``since`` (see
        ``parse_since``) through today: requests, prompt/completion/cached
        tokens, cost USD, plus totals.

        Raises:
            ValueError: a bad ``since``."""
        now = time.time() if now_s is None else now_s
        start = parse_since(since, now)
        days = _days(start, now)

        async def read(r) -> dict[str, list[dict]]:
            tenants = [tenant_label(tenant)] if tenant is not None else sorted(
                await r.smembers(self.state.key("usage", "tenants")))
            pipe = r.pipeline(transaction=False)
            for t in tenants:
                for d in days:
                    pipe.hgetall(self.state.key("usage", f"{t}:{d}"))
            rows = await pipe.execute()
            out, i = {}, 0
            for t in tenants:
                out[t] = rows[i:i + len(days)]
                i += len(days)
            return out

        def local() -> dict[str, list[dict]]:
            tenants = [tenant_label(tenant)] if tenant is not None else sorted({t for t, _ in self._usage})
            return {t: [self._usage.get((t, d), {}) for d in days] for t in tenants}

        raw = await self.state.call(read, local)
        tenants: dict[str, dict] = {}
        total = {f: 0 for f in _FIELDS}
        for t, hashes in raw.items():
            backends: dict[str, dict[str, int]] = {}
            for h in hashes:
                for k, v in h.items():
                    b, _, f = k.rpartition("|")
                    if f in _FIELDS:
                        row = backends.setdefault(b, {x: 0 for x in _FIELDS})
                        row[f] += int(v)
            if not backends:
                continue
            tsum = {f: sum(row[f] for row in backends.values()) for f in _FIELDS}
            for f in _FIELDS:
                total[f] += tsum[f]
            tenants[t] = {"backends": {b: _row(row) for b, row in sorted(backends.items())}, **_row(tsum)}
        until = _dt.datetime.fromtimestamp(now, _dt.timezone.utc).date()
        return {"since": start.isoformat(), "until": until.isoformat(), "tenants": tenants, **_row(total)}


def decode_record(request_id: str, tenant: str, value: str) -> UsageRecord:
    """A ledger hash value (``UsageRecord.encode``) back into the record."""
    backend, p, c, cached, nusd, flags = value.rsplit("|", 5)
    return UsageRecord(request_id, tenant, backend, int(p), int(c), int(cached), int(nusd), "e" in flags,
                       "d" in flags)


def _row(r: dict[str, int]) -> dict:
    return {"requests": r["req"], "prompt_tokens": r["in"], "completion_tokens": r["out"],
            "cached_tokens": r["cached"], "cost_usd": r["nusd"] / NANO}
