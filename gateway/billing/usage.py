"""The usage ledger and per-tenant budgets: one usage record per accepted
request (admitted past auth, validation, limits and budget; one no backend answered is a record of no tokens
and no cost, flagged ``failed``), and the money in Redis is the sum of those records.

Prices and a response's cost in integer nano-USD: ``gateway/billing/prices.py``;
the Lua scripts: ``gateway/billing/scripts.py`` (their in-process twins are here); UTC days
and budget periods: ``gateway/billing/periods.py``.

State (``gateway.state.SharedState``: Redis when configured, in-process
otherwise and while Redis is down), keys ``<prefix>:<kind>:<id>`` with TTLs:

- ``<prefix>:usage:<tenant>:<YYYYMMDD>`` (hash, UTC day, TTL 400 days): per
  backend ``<backend>|req``, ``|in``, ``|out``, ``|cached``, ``|nusd``, ``|fail`` (requests no backend
  answered, counted in ``|req`` too).
  ``<prefix>:usage:tenants`` (set) lists the tenants seen.
- ``<prefix>:budget:<tenant>:<period id>`` (hash: ``spent``, ``reserved``,
  ``r:<request id>`` = reserved nano-USD) and ``...:res`` (sorted set:
  request id -> expiry ms). Period ids: ``d20261129`` (day) or ``m202611``
  (month), UTC. Every settle adds its cost to the ``spent`` of its tenant's day and month, with a budget or none,
  so a budget set (or set again) mid-period counts what the tenant spent in it before (as LiteLLM checks a
  budget against the spend so far).

- ``<prefix>:ledger:<tenant>:<YYYYMMDD>`` (hash, TTL ``budgets.record_ttl_s``):
  request id -> its usage record ``backend|in|out|cached|nusd|flags`` (flags:
  ``e`` usage estimated, ``d`` client disconnected, ``f`` failed: no backend answered). One record per request:
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
read from Redis (``limit - spent - reserved`` at its last reserve there, that
reserve's own hold included, or at its last read of every budget: at start and every
``BUDGET_READ_S``, ``read_budgets``), of
which it spends at most its share: the remainder divided by the replicas that
reserved on that budget in the last ``PEER_WINDOW_S`` (the reserve script
counts them), since the others spend theirs unseen meanwhile. So the replicas
together stay within the budget, past it only by what was in flight when it
ran out and what others spent after a replica's last read. With ``state.fail_closed_limits`` a tenant with a budget gets 503
``budget_unavailable`` instead.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from gateway.billing.journal import Journal, JournalEntry
from gateway.billing.periods import USAGE_TTL_S, days_since, parse_since, period_end_s, period_id, utc_day
from gateway.billing.prices import NANO
from gateway.billing.report import FIELDS as _FIELDS, usage_rows
from gateway.billing.scripts import RELEASE_LUA, RESERVE_LUA, SETTLE_LUA
from policies import tenant_label

log = logging.getLogger("tandem.gateway.usage")

PEER_WINDOW_S = 60.0               # a replica that reserved on a budget this recently shares it in an outage
BUDGET_READ_S = 15.0               # how often a replica reads every budget's spend (``read_budgets``)


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
    """The one usage record of an accepted request: tokens (OpenAI's names) and cost ``nusd`` (nano-USD) of
    ``backend``'s answer to ``tenant``; ``estimated``: counted by the gateway (the backend gave no usage);
    ``disconnected``: the client left a stream before its end (billed for what it was sent); ``failed``: no
    backend answered (every attempt failed, or the client left before one answered): no tokens, no cost,
    ``backend`` "none" (or the one whose error the client got)."""

    request_id: str
    tenant: str
    backend: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    nusd: int
    estimated: bool = False
    disconnected: bool = False
    failed: bool = False

    def encode(self) -> str:
        """``backend|in|out|cached|nusd|flags``, as the ledger hash stores it."""
        flags = ("e" if self.estimated else "") + ("d" if self.disconnected else "") + ("f" if self.failed else "")
        return (f"{self.backend}|{int(self.prompt_tokens)}|{int(self.completion_tokens)}|{int(self.cached_tokens)}"
                f"|{int(self.nusd)}|{flags}")


@dataclass
class _MemBudget:
    spent: int = 0                 # in process: all spend (no Redis); degraded: this replica's spend since ``base``
    reserved: int = 0
    holds: dict[str, tuple[int, int]] = field(default_factory=dict)   # request id -> (nusd, expiry ms)
    base: int = 0                  # spent + reserved in Redis at this replica's last reserve there (0: no Redis)
    peers: int = 1                 # replicas that reserved on this budget recently, at that reserve


class UsageLedger:
    """Usage and budgets of all tenants on a ``SharedState`` (Redis or in-process).

    Args:
        state: ``gateway.state.SharedState`` (its ``run`` gives atomic Lua on
            Redis with the in-process fallback while Redis is unreachable).
        reservation_ttl_s: seconds after which an unsettled reservation lapses.
        record_ttl_s: seconds a request's usage record is kept in Redis (the
            window in which a replayed settle is recognised).
        journal: where settles made during an outage wait for Redis.
        replica_id: this replica's name in the budgets' peer sets (default: the state's ``replica_id``).
    """

    def __init__(self, state, reservation_ttl_s: float = 600.0, record_ttl_s: float = 8 * 86400,
                 journal: Journal | None = None, replica_id: str | None = None):
        self.state = state
        self.replica_id = replica_id or state.replica_id   # this replica, as budgets' peer sets name it
        self.reservation_ttl_s = reservation_ttl_s
        self.record_ttl_s = record_ttl_s
        self.journal = journal if journal is not None else Journal()
        self.replays = 0               # journal entries replayed onto Redis (a duplicate included)
        self._replaying = asyncio.Lock()
        self._late_logged = -1e9
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

    @staticmethod
    def _fits(b: _MemBudget, est: int, limit: int) -> bool:
        """In process: does ``est`` fit the budget? Degraded, this replica's own spend and holds since its last
        Redis read must also fit its share of what Redis then said was left (``b.peers`` replicas share it)."""
        if b.base + b.spent + b.reserved + est > limit:
            return False
        return b.peers <= 1 or b.spent + b.reserved + est <= (limit - b.base) // b.peers

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
        fail_closed = shared and self.state.fail_closed_limits
        in_process = []                # set when the decision was taken here, not by Redis

        def local() -> list[int]:
            in_process.append(True)
            if fail_closed:            # Redis unreachable: no budget decision in process
                return [-2, 0, 0, 0]
            b = self._budgets.setdefault(bkey, _MemBudget())
            for rid, (amount, exp) in list(b.holds.items()):
                if exp <= now_ms:
                    b.reserved -= amount
                    del b.holds[rid]
            # degraded: what Redis last said was used, plus this replica's own spend and holds since
            spent, reserved = b.base + b.spent, b.reserved
            if not self._fits(b, est, limit):
                return [0, spent, reserved, b.peers]
            b.reserved += est
            b.holds[request_id] = (est, now_ms + hold_ms)
            return [1, spent, reserved, b.peers]

        deadline_ms = int(time.time() * 1000 + self.state.config.socket_timeout_s * 1000)   # Redis's clock
        raw = await self.state.run("usage_reserve", RESERVE_LUA, [bkey, rkey, bkey + ":peers"],
                                   [now_ms, request_id, est, limit, ttl, hold_ms, deadline_ms, self.replica_id,
                                    int(PEER_WINDOW_S * 1000)], local)
        ok, spent, reserved, peers = int(raw[0]), int(raw[1]), int(raw[2]), int(raw[3])
        if ok == -1:                   # Redis ran it past our deadline (clock skew or a stall): decide in process
            if time.monotonic() - self._late_logged > 60:     # once a minute: a skewed clock would say it per request
                self._late_logged = time.monotonic()
                log.warning("budget reserve of %s ran past its deadline on redis (a stall, or this host's clock "
                            "behind Redis's by more than state.socket_timeout_s): checked in process", request_id)
            ok, spent, reserved, peers = local()
        if ok == -2:
            return BudgetCheck(False, None, 0, 0, limit, self.state.config.reconnect_max_s, unavailable=True)
        if shared and not in_process:               # remember Redis's view for an outage
            # this request's own hold counts as used: it is settled on Redis, or in process when Redis goes
            b = self._budgets.setdefault(bkey, _MemBudget())
            b.base, b.peers = spent + reserved + (est if ok == 1 else 0), max(1, peers)
        res = BudgetReservation(tenant, request_id, budget.period, pid, est) if ok else None
        return BudgetCheck(bool(ok), res, spent, reserved, limit, end - now)

    async def read_budgets(self, budgets: Mapping[str, Budget], now_s: float | None = None) -> None:
        """Take Redis's spend and holds of each budget's current period (``budgets``: tenant -> its budget) as
        this replica's view of it (``base``), where the replica holds nothing of its own in process: a replica
        that has not served a tenant since it started otherwise knows nothing of its spend, and a Redis outage
        then would admit a tenant already at its budget (failures.md says it stays refused). One pipelined
        round trip; nothing without Redis or while it is unreachable."""
        if self.state.redis is None or self.state.degraded or not budgets:
            return
        now = time.time() if now_s is None else now_s
        keys = [self._bkeys(tenant, period_id(b.period, now))[0] for tenant, b in budgets.items()]

        async def read(r) -> list:
            pipe = r.pipeline(transaction=False)
            for k in keys:
                pipe.hmget(k, "spent", "reserved")
            return await pipe.execute()

        rows = await self.state.call(read, lambda: None)
        for key, (spent, reserved) in zip(keys, rows or ()):
            b = self._budgets.setdefault(key, _MemBudget())
            if not b.spent and not b.holds:      # an outage's own spend waits for its replay: kept as it is
                b.base = int(spent or 0) + int(reserved or 0)

    async def watch_budgets(self, budgets: Callable[[], Mapping[str, Budget]]) -> None:
        """Run ``read_budgets`` on the current config's budgets (``budgets()``) now and every ``BUDGET_READ_S``
        (a task of the gateway's)."""
        while True:
            try:
                await self.read_budgets(budgets())
            except Exception as e:  # noqa: BLE001 -- Redis failing mid-read: the next round reads again
                log.info("budgets not read: %s", e)
            await asyncio.sleep(BUDGET_READ_S)

    async def release(self, res: BudgetReservation) -> None:
        """Drop a reservation without spending (the request never reached a backend)."""
        bkey, rkey = self._bkeys(res.tenant, res.period_id)

        def local() -> int:
            b = self._budgets.get(bkey)
            if b is not None and res.request_id in b.holds:
                b.reserved -= b.holds.pop(res.request_id)[0]
            if self.state.redis is not None:   # degraded: a hold taken on Redis before the outage goes on rejoin
                self.journal.append(JournalEntry(res.request_id, [bkey, rkey], [res.request_id], 0, "release"))
            return 1

        await self.state.run("usage_release", RELEASE_LUA, [bkey, rkey], [res.request_id], local)

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
            return b.base + b.spent, b.reserved          # degraded: Redis's last word plus our own since

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
        day = utc_day(int(now // 86400))
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
        vals = [1, int(record.prompt_tokens), int(record.completion_tokens), int(record.cached_tokens), int(nusd),
                int(record.failed)]
        spends = [self._bkeys(tenant, period_id(p, now))[0] for p in ("day", "month")]   # the periods' spent
        keys = [ukey, tkey, bkey, rkey, lkey, *spends]
        args = [backend, *vals[:5], USAGE_TTL_S, t, rid, bttl, record.request_id, record.encode(),
                int(self.record_ttl_s), vals[5], *(int(period_end_s(p, now) - now) + 3600 for p in ("day", "month"))]

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
                if v or f != "fail":       # as the script: no ``|fail`` field until one failed
                    u[f"{backend}|{f}"] = u.get(f"{backend}|{f}", 0) + v
            if bttl:
                b = self._budgets.setdefault(bkey, _MemBudget())
                if rid and rid in b.holds:
                    b.reserved -= b.holds.pop(rid)[0]
            if spends[0] not in self._budgets:
                self._prune_budgets({period_id(p, now) for p in ("day", "month")})
            for key in spends:
                self._budgets.setdefault(key, _MemBudget()).spent += int(nusd)
            if self.state.redis is not None:   # degraded: Redis gets it on rejoin
                self.journal.append(JournalEntry(record.request_id, keys, args, int(nusd)))
            return 1

        done = await self.state.run("usage_settle", SETTLE_LUA, keys, args, local)
        if rid and self.state.redis is not None and not self.state.degraded:
            b = self._budgets.get(bkey)   # a hold taken in process during an outage, settled on Redis
            if b is not None and rid in b.holds:
                b.reserved -= b.holds.pop(rid)[0]
        return bool(int(done))

    def _prune_records(self, day: str) -> None:
        """In process, keep the records of ``day`` and the day before only (enough to recognise a repeat)."""
        prev = utc_day(int(_dt.datetime.strptime(day, "%Y%m%d").replace(tzinfo=_dt.timezone.utc).timestamp()
                            // 86400) - 1)
        for k in [k for k in self._records if k.rpartition(":")[2] not in (day, prev)]:
            del self._records[k]

    def _prune_budgets(self, current: set[str]) -> None:
        """In process, drop the budgets of past periods (``current``: today's and this month's period ids) that
        hold nothing: every tenant's day and month get one."""
        for k in [k for k, b in self._budgets.items() if k.rpartition(":")[2] not in current and not b.holds]:
            del self._budgets[k]

    async def replay(self) -> int:
        """Push the journal onto Redis (the state's rejoin hook; also run at start): each entry through the
        settle script, which skips a request already recorded. Returns the entries replayed; those Redis did
        not take (it went away again) stay in the journal."""
        if self.state.redis is None:
            return 0
        async with self._replaying:
            entries, own = self.journal.take()
            done = 0
            try:
                for e in entries:
                    if e.script == "release":
                        await self.state.redis_script("usage_release", RELEASE_LUA, e.keys, e.args)
                    else:
                        await self.state.redis_script("usage_settle", SETTLE_LUA, e.keys, e.args)
                    done += 1
            except Exception as exc:  # noqa: BLE001 -- Redis gone again: the rest waits for the next rejoin
                log.warning("usage journal replay stopped after %d of %d: %s", done, len(entries), exc)
            self.journal.finished(entries, done, own)
            self.replays += done
            self._rebase(entries[:min(done, own)])      # another replica's spend is not in this one's budgets
            if done:
                log.warning("usage journal: %d settles made during the outage replayed onto redis", done)
            return done

    def _rebase(self, replayed: list[JournalEntry]) -> None:
        """The in-process spend that is now in Redis moves into each budget's ``base`` (the next reserve on
        Redis refreshes it), so a next outage does not count it twice."""
        for e in replayed:
            if e.script != "settle":
                continue
            spends = e.keys[5:7] if len(e.keys) >= 7 else e.keys[2:3] if int(e.args[9]) else []   # as the script
            for key in spends:
                if (b := self._budgets.get(key)) is not None:
                    b.spent -= e.nusd
                    b.base += e.nusd

    async def records(self, tenant: str, now_s: float | None = None) -> dict[str, UsageRecord]:
        """The usage records of ``tenant``'s UTC day of ``now_s``: request id -> record (Redis, or in process)."""
        now = time.time() if now_s is None else now_s
        t = tenant_label(tenant)
        lkey = self.state.key("ledger", f"{t}:{utc_day(int(now // 86400))}")

        async def read(r) -> dict[str, str]:
            return await r.hgetall(lkey)

        raw = await self.state.call(read, lambda: dict(self._records.get(lkey, {})))
        return {rid: decode_record(rid, t, v) for rid, v in raw.items()}

    async def report(self, tenant: str | None = None, since: str | None = None,
                     now_s: float | None = None) -> dict:
        """Usage per tenant and backend from the UTC day ``since`` (see
        ``parse_since``) through today: requests, prompt/completion/cached
        tokens, cost USD, plus totals; ``partial`` (why) when Redis is
        configured and unreachable (this replica's in-process counts only).

        Raises:
            ValueError: a bad ``since``."""
        now = time.time() if now_s is None else now_s
        start = parse_since(since, now)
        days = days_since(start, now)

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

        tenants, total = usage_rows(await self.state.call(read, local))
        until = _dt.datetime.fromtimestamp(now, _dt.timezone.utc).date()
        report = {"since": start.isoformat(), "until": until.isoformat(), "tenants": tenants, **total}
        if self.state.mode == "degraded":   # in-process counts: said (a security trial read zeros, without a word)
            report["partial"] = ("Redis is unreachable: these counts are only what this replica served while it "
                                 "could not reach Redis; the whole usage is read again once it answers")
        return report


def decode_record(request_id: str, tenant: str, value: str) -> UsageRecord:
    """A ledger hash value (``UsageRecord.encode``) back into the record."""
    backend, p, c, cached, nusd, flags = value.rsplit("|", 5)
    return UsageRecord(request_id, tenant, backend, int(p), int(c), int(cached), int(nusd), "e" in flags,
                       "d" in flags, "f" in flags)

