"""Circuit breakers per target (backend + upstream model), shared across replicas through ``SharedState``.

States (Nygard, "Release It!"; the LiteLLM "cooldown" of a deployment is the open state):

- closed: requests flow; outcomes are counted in a rolling window of ``window_s`` seconds (``buckets`` time
  buckets). It opens when the failure rate reaches ``failure_rate`` over at least ``min_requests`` outcomes,
  or after ``consecutive_failures`` failures in a row, or at once on an upstream 429 / a 503 with Retry-After.
- open: requests are refused until ``open_until``. The cooldown is ``open_s``, or the upstream's ``Retry-After``
  when that is longer; a 429 without Retry-After cools down ``rate_limit_cooldown_s``; a 429 or a 503 with
  Retry-After cools down exactly that long (the upstream said when it is back: a Tandem engine replica restarting
  answers 503 ``engine_loading`` with ``Retry-After: 5``, and a scale-out trial's replica got no traffic for the
  30 s of ``open_s`` after it had loaded). ``open_until`` only ever moves later: a later, shorter cooldown never cuts a
  longer one short. Retry-After is capped at ``max_cooldown_s``.
- half-open: after ``open_until`` at most ``half_open_probes`` probe requests are let through at a time (a probe
  that never reports is forgotten after ``probe_timeout_s``); ``success_to_close`` successes close the breaker,
  one failure re-opens it.

State lives in one Redis HASH per target, ``tandem:cb:<target>``, updated by Lua; in process when there is no
Redis, or while it is unreachable. Cooldowns opened during an outage are pushed to Redis when it returns.
Each replica remembers Redis's last answer, "closed" or "open", for ``cache_s`` (an open one no longer than its
``open_until``), so a breaker opened on another replica is honoured there within ``cache_s``, and one whose record
left Redis (an operator's ``DEL``, eviction, a failover or flush) is closed there within ``cache_s`` too, as
``/health/ready`` (which reads Redis) says; half-open is always asked. While a breaker stays closed or open, a
replica's ``allow`` asks Redis about it once per ``cache_s``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone

from gateway.config.schema import BreakerSettings
from gateway.state import SharedState, now_ms

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
log = logging.getLogger("tandem.breaker")


@dataclass
class BreakerState:
    """A breaker's state now. ``retry_after_s``: seconds until a request may pass (0 when one may now).
    ``previous``: the state before the ``record`` that returned this ("" from ``get``)."""

    target: str
    state: str
    open_until_ms: int = 0
    retry_after_s: float = 0.0
    consecutive_failures: int = 0
    reason: str = ""
    previous: str = ""


@dataclass
class BreakerDecision:
    """Answer of ``Breakers.allow``: ``allowed`` (and ``probe`` when it is a half-open probe)."""

    allowed: bool
    state: str
    retry_after_s: float = 0.0
    probe: bool = False


# Hash fields: ou open_until ms, ps probe slots in use, pt last probe start ms, ok half-open successes,
# cf consecutive failures, s<b>/f<b> successes/failures in bucket b, rs reason.
# allow: ARGV now, probes, probe_timeout_ms. Returns {allowed, state(0 closed 1 open 2 half), retry_ms, probe}.
_ALLOW_LUA = r"""
local k = KEYS[1]; local now = tonumber(ARGV[1]); local probes = tonumber(ARGV[2]); local pto = tonumber(ARGV[3])
local ou = tonumber(redis.call('HGET', k, 'ou') or '0')
if ou == 0 then return {1, 0, 0, 0} end
if now < ou then return {0, 1, ou - now, 0} end
local ps = tonumber(redis.call('HGET', k, 'ps') or '0')
local pt = tonumber(redis.call('HGET', k, 'pt') or '0')
if ps > 0 and now - pt > pto then ps = 0 end
if ps >= probes then return {0, 2, math.max(1, pto - (now - pt)), 0} end
redis.call('HSET', k, 'ps', ps + 1, 'pt', now)
redis.call('PEXPIRE', k, pto + 600000)
return {1, 2, 0, 1}
"""

# record: ARGV now, success(1/0), trip(1/0), cooldown_ms, bucket_ms, buckets, min_req, rate(x1000),
#   consec, success_to_close, ttl_ms, probe(1/0), reason. Returns {state, open_until, consecutive, previous state}.
_RECORD_LUA = r"""
local k = KEYS[1]; local now = tonumber(ARGV[1]); local success = ARGV[2] == '1'; local trip = ARGV[3] == '1'
local cooldown = tonumber(ARGV[4]); local bms = tonumber(ARGV[5]); local nb = tonumber(ARGV[6])
local minreq = tonumber(ARGV[7]); local rate = tonumber(ARGV[8]); local consec = tonumber(ARGV[9])
local to_close = tonumber(ARGV[10]); local ttl = tonumber(ARGV[11]); local probe = ARGV[12] == '1'
local reason = ARGV[13]
local ou = tonumber(redis.call('HGET', k, 'ou') or '0')
local cf = tonumber(redis.call('HGET', k, 'cf') or '0')
local b = math.floor(now / bms)
local prev = 0
if ou > 0 then if now < ou then prev = 1 else prev = 2 end end
local function clear_window()
  local all = redis.call('HKEYS', k)
  for _, f in ipairs(all) do
    local c = string.sub(f, 1, 1)
    if (c == 's' or c == 'f') and tonumber(string.sub(f, 2)) then redis.call('HDEL', k, f) end
  end
end
local function open(ms)
  local until_ = now + ms
  if until_ > ou then ou = until_ end
  redis.call('HSET', k, 'ou', ou, 'ps', 0, 'ok', 0, 'cf', 0, 'rs', reason)
  clear_window()
end
if probe then
  local ps = tonumber(redis.call('HGET', k, 'ps') or '0')
  if ps > 0 then redis.call('HSET', k, 'ps', ps - 1) end
end
if ou > 0 and now < ou then
  -- open: late outcomes of requests admitted before it opened only matter when they carry a cooldown
  if (not success) and trip then open(cooldown) end
elseif ou > 0 then
  -- half-open
  if success then
    local ok = redis.call('HINCRBY', k, 'ok', 1)
    if ok >= to_close then
      redis.call('HSET', k, 'ou', 0, 'ps', 0, 'ok', 0, 'cf', 0, 'rs', '')
      ou = 0
      clear_window()
    end
  else
    open(cooldown)
  end
else
  local f = (success and 's' or 'f') .. b
  redis.call('HINCRBY', k, f, 1)
  if success then cf = 0 else cf = cf + 1 end
  redis.call('HSET', k, 'cf', cf)
  -- drop buckets older than the window, sum the rest
  local total, fails = 0, 0
  local all = redis.call('HGETALL', k)
  for i = 1, #all, 2 do
    local c = string.sub(all[i], 1, 1); local bi = tonumber(string.sub(all[i], 2))
    if (c == 's' or c == 'f') and bi then
      if bi <= b - nb then redis.call('HDEL', k, all[i]) else
        total = total + tonumber(all[i+1])
        if c == 'f' then fails = fails + tonumber(all[i+1]) end
      end
    end
  end
  if not success and (trip or cf >= consec or (total >= minreq and fails * 1000 >= rate * total)) then
    open(cooldown)
  end
end
local keep = ttl
if ou > now and ou - now + 600000 > keep then keep = ou - now + 600000 end
redis.call('PEXPIRE', k, keep)
local st = 0
if ou > 0 then if now < ou then st = 1 else st = 2 end end
return {st, ou, tonumber(redis.call('HGET', k, 'cf') or '0'), prev}
"""

# merge (rejoin): ARGV open_until. Moves open_until later only.
_MERGE_LUA = r"""
local k = KEYS[1]; local ou = tonumber(ARGV[1])
local cur = tonumber(redis.call('HGET', k, 'ou') or '0')
if ou > cur then redis.call('HSET', k, 'ou', ou, 'ps', 0, 'ok', 0); redis.call('PEXPIREAT', k, ou + 600000) end
return 1
"""

_STATES = (CLOSED, OPEN, HALF_OPEN)


def iso_ms(ms: int) -> str:
    """Wall-clock milliseconds as an ISO-8601 UTC time (``2026-11-30T21:55:03.120Z``)."""
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _log_transition(s: BreakerState, now: int) -> None:
    """One WARNING per transition this replica caused (the Lua script reports the state before it ran)."""
    if s.state == OPEN:
        why = s.reason or "failure"
        if s.previous == HALF_OPEN:
            why += " (half-open probe failed)"
        log.warning("breaker %s open for %.1fs (until %s): %s", s.target, (s.open_until_ms - now) / 1000,
                    iso_ms(s.open_until_ms), why)
    elif s.state == CLOSED:
        log.warning("breaker %s closed: half-open probe succeeded", s.target)


class Breakers:
    """All circuit breakers of a gateway, keyed by target name (e.g. ``"deepseek/deepseek-chat"``).

    The gateway calls ``allow`` before an attempt, and ``record`` after it with the outcome.
    """

    def __init__(self, state: SharedState, config: BreakerSettings | None = None,
                 per_target: dict[str, BreakerSettings] | None = None):
        self.state = state
        self.config = config or BreakerSettings()
        self.per_target = per_target or {}
        self._local: dict[str, dict] = {}
        self._opened_while_degraded: dict[str, int] = {}
        self._cache: dict[str, tuple[int, int, int]] = {}  # target -> (0 closed | 1 open, valid until, open until) ms
        state.on_rejoin(self._push_local_cooldowns)

    def _cfg(self, target: str) -> BreakerSettings:
        return self.per_target.get(target, self.config)

    def _key(self, target: str) -> str:
        return self.state.key("cb", target)

    async def allow(self, target: str, now: int | None = None) -> BreakerDecision:
        """May a request go to ``target`` now? Takes a half-open probe slot when it is a probe."""
        cfg = self._cfg(target)
        now = now_ms() if now is None else now
        args = [now, cfg.half_open_probes, int(cfg.probe_timeout_s * 1000)]
        cached = self._cached(target, now)
        if cached is not None:
            return cached
        raw = await self.state.run("cb_allow", _ALLOW_LUA, [self._key(target)], args,
                                   lambda: self._allow_local(self._key(target), args))
        a, st, retry, probe = (int(x) for x in raw)
        if probe:
            log.warning("breaker %s half-open: cooldown over, one probe request let through", target)
        self._remember(target, st, now, now + retry)
        return BreakerDecision(allowed=a == 1, state=_STATES[st], retry_after_s=retry / 1000, probe=probe == 1)

    def _cached(self, target: str, now: int) -> BreakerDecision | None:
        """The answer from this replica's recent view of the shared state, or None to ask Redis.

        Closed or open is trusted for ``cache_s`` after Redis said so, open no longer than its ``open_until``
        (a half-open breaker is always asked): a record that left Redis (deleted, evicted, flushed) is seen
        within ``cache_s``, as ``get`` (readiness) sees it at once. Only with a reachable Redis.
        """
        c = self._cache.get(target)
        if c is None or self.state.redis is None or self.state.degraded:
            return None
        st, valid_until, open_until = c
        if now >= valid_until:
            return None
        if st == 0:
            return BreakerDecision(allowed=True, state=CLOSED)
        return BreakerDecision(allowed=False, state=OPEN, retry_after_s=(open_until - now) / 1000)

    def _remember(self, target: str, st: int, now: int, open_until: int) -> None:
        """Keep Redis's answer ``st`` (0 closed, 1 open until ``open_until``, 2 half-open: not kept) of ``now``."""
        if self.state.redis is None or self.state.degraded:
            return
        valid_until = now + int(self.config.cache_s * 1000)
        if st == 0:
            self._cache[target] = (0, valid_until, 0)
        elif st == 1:
            self._cache[target] = (1, min(valid_until, open_until), open_until)
        else:
            self._cache.pop(target, None)

    def _allow_local(self, key: str, args: list) -> list[int]:
        now, probes, pto = args
        h = self._local.setdefault(key, {})
        ou = h.get("ou", 0)
        if ou == 0:
            return [1, 0, 0, 0]
        if now < ou:
            return [0, 1, ou - now, 0]
        ps, pt = h.get("ps", 0), h.get("pt", 0)
        if ps > 0 and now - pt > pto:
            ps = 0
        if ps >= probes:
            return [0, 2, max(1, pto - (now - pt)), 0]
        h["ps"], h["pt"] = ps + 1, now
        return [1, 2, 0, 1]

    async def record(self, target: str, success: bool, *, status: int | None = None,
                     retry_after_s: float | None = None, probe: bool = False, reason: str = "",
                     now: int | None = None) -> BreakerState:
        """Record one attempt's outcome; returns the breaker's new state.

        status: the upstream HTTP status of a failure (None for a transport error / timeout).
        retry_after_s: the upstream's ``Retry-After`` in seconds, when it sent one.
        probe: the attempt was let through as a half-open probe (``BreakerDecision.probe``).
        A 429, or a 503 with Retry-After, opens the breaker at once.
        """
        cfg = self._cfg(target)
        now = now_ms() if now is None else now
        trip = (not success) and (status == 429 or (status == 503 and retry_after_s is not None))
        if trip:
            cooldown = retry_after_s if retry_after_s is not None else cfg.rate_limit_cooldown_s
        else:
            cooldown = max(cfg.open_s, retry_after_s or 0.0)
        cooldown = min(cooldown, cfg.max_cooldown_s)
        bucket_ms = max(1, int(cfg.window_s * 1000 / cfg.buckets))
        args = [now, int(success), int(trip), int(cooldown * 1000), bucket_ms, cfg.buckets, cfg.min_requests,
                int(cfg.failure_rate * 1000), cfg.consecutive_failures, cfg.success_to_close,
                int(cfg.window_s * 1000) + 60000, int(probe), reason or (f"status {status}" if status else "error")]
        key = self._key(target)
        raw = await self.state.run("cb_record", _RECORD_LUA, [key], args, lambda: self._record_local(key, args))
        st, ou, cf, prev = (int(x) for x in raw)
        self._remember(target, st, now, ou)
        if self.state.redis is not None and self.state.degraded and st == 1:  # opened in process
            self._opened_while_degraded[target] = max(ou, self._opened_while_degraded.get(target, 0))
        out = BreakerState(target=target, state=_STATES[st], open_until_ms=ou,
                           retry_after_s=max(0.0, (ou - now) / 1000) if st == 1 else 0.0,
                           consecutive_failures=cf, reason=args[-1] if st else "", previous=_STATES[prev])
        if st != prev:
            _log_transition(out, now)
        return out

    async def reset(self, target: str, reason: str) -> None:
        """Close ``target``'s breaker now, forgetting its failures (``reason`` logged): for a backend known to be
        new since they happened (the local engine loaded again after its core died: its failures were the dead
        one's). The record is deleted (shared: every replica sees it at its next read, as ``_cached`` allows)."""
        key = self._key(target)
        await self.state.call(lambda r: r.delete(key), lambda: None)
        self._local.pop(key, None)   # the in-process record (Redis unreachable, or none configured)
        self._cache.pop(target, None)
        log.warning("breaker %s closed: %s", target, reason)

    def _record_local(self, key: str, args: list) -> list[int]:
        """Python twin of ``_RECORD_LUA``."""
        (now, success, trip, cooldown, bms, nb, minreq, rate, consec, to_close, _ttl, probe, reason) = args
        h = self._local.setdefault(key, {})
        ou, cf, b = h.get("ou", 0), h.get("cf", 0), now // bms
        prev = 0 if ou == 0 else (1 if now < ou else 2)
        win: dict = h.setdefault("win", {})

        def open_(ms: int) -> None:
            nonlocal ou
            ou = max(ou, now + ms)
            h.update(ou=ou, ps=0, ok=0, cf=0, rs=reason)
            win.clear()

        if probe and h.get("ps", 0) > 0:
            h["ps"] -= 1
        if ou > 0 and now < ou:
            if not success and trip:
                open_(cooldown)
        elif ou > 0:
            if success:
                h["ok"] = h.get("ok", 0) + 1
                if h["ok"] >= to_close:
                    h.update(ou=0, ps=0, ok=0, cf=0, rs="")
                    ou = 0
                    win.clear()
            else:
                open_(cooldown)
        else:
            s, f = win.get(b, (0, 0))
            win[b] = (s + 1, f) if success else (s, f + 1)
            cf = 0 if success else cf + 1
            h["cf"] = cf
            for old in [x for x in win if x <= b - nb]:
                del win[old]
            total = sum(s + f for s, f in win.values())
            fails = sum(f for _, f in win.values())
            if not success and (trip or cf >= consec or (total >= minreq and fails * 1000 >= rate * total)):
                open_(cooldown)
        st = 0 if ou == 0 else (1 if now < ou else 2)
        return [st, ou, h.get("cf", 0), prev]

    async def get(self, target: str, now: int | None = None) -> BreakerState:
        """Current state of ``target``'s breaker (no side effects)."""
        now = now_ms() if now is None else now
        key = self._key(target)

        async def read(r) -> dict:
            return await r.hgetall(key)

        h = await self.state.call(read, lambda: {k: v for k, v in self._local.get(key, {}).items() if k != "win"})
        ou, cf = int(h.get("ou", 0) or 0), int(h.get("cf", 0) or 0)
        st = CLOSED if ou == 0 else (OPEN if now < ou else HALF_OPEN)
        return BreakerState(target=target, state=st, open_until_ms=ou,
                            retry_after_s=max(0.0, (ou - now) / 1000) if st == OPEN else 0.0,
                            consecutive_failures=cf, reason=str(h.get("rs", "")))

    async def soonest_half_open(self, targets: list[str], now: int | None = None) -> float:
        """Seconds until the first of ``targets`` leaves the open state (0 if one is not open): the 503 Retry-After."""
        now = now_ms() if now is None else now
        waits = [(await self.get(t, now)).retry_after_s for t in targets]
        return min(waits) if waits else 0.0

    async def _push_local_cooldowns(self) -> None:
        """On rejoin: cooldowns opened in process during the outage move Redis's ``open_until`` later, never earlier."""
        self._cache.clear()
        pending, self._opened_while_degraded = self._opened_while_degraded, {}
        for target, ou in pending.items():
            if ou > now_ms():
                await self.state.run("cb_merge", _MERGE_LUA, [self._key(target)], [ou], lambda: 1)
