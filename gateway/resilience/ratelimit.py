"""RPM and TPM limits per virtual key, tenant and backend, exact across replicas.

Algorithm: a sliding-window log. Each limited entity (``Limit``: scope + id) keeps the admissions of the last
``window_s`` seconds (a Redis ZSET request_id -> admission time in ms, and a HASH request_id -> reserved tokens
with a running ``__sum``). An admission checks every limit of the request at once (one Lua script, atomic on
the Redis server) and records itself in all of them only if all allow it, so for any 60 s interval at most
``rpm`` requests and ``tpm`` tokens are admitted, whatever the number of gateway replicas sharing the Redis.

Tokens are reserved at admission (estimated prompt tokens + ``max_tokens``) and ``reconcile`` replaces the
reservation with the real usage (prompt_tokens + completion_tokens) once it is known.

Header formats follow OpenAI's rate-limit headers (``x-ratelimit-limit-requests``, ``-remaining-``, ``-reset-``
with durations like ``"1s"``, ``"6m0s"``, ``"250ms"``, and the ``-tokens`` forms); ``Retry-After`` is whole
seconds, rounded up.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from gateway.errors import ClientError
from gateway.state import SharedState, now_ms


@dataclass(frozen=True)
class Limit:
    """One limited entity: scope ``key`` | ``tenant`` | ``backend`` (any string), its id, and its limits.

    rpm: requests per window (None: unlimited). tpm: tokens per window (None: unlimited).
    """

    scope: str
    id: str
    rpm: int | None = None
    tpm: int | None = None


@dataclass
class RateReservation:
    """What an admission recorded: reconcile or release it later."""

    request_id: str
    limits: list[Limit]
    tokens: int


@dataclass
class RateLimitResult:
    """Outcome of ``RateLimiter.acquire``.

    allowed: the request may proceed (its reservation is recorded).
    status: HTTP status for a rejection: 429 (limit reached) or 503 (fail-closed while Redis is unreachable).
    limit: the limit that rejected the request (None when allowed).
    retry_after_s: seconds until this request would fit (None: it never fits, e.g. tokens > tpm).
    The ``*_requests`` / ``*_tokens`` fields describe the tightest limit; ``reset_*_s`` are seconds.
    """

    allowed: bool
    status: int = 200
    reservation: RateReservation | None = None
    limit: Limit | None = None
    retry_after_s: float | None = None
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float = 0.0
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float = 0.0
    message: str = ""

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers, plus ``Retry-After`` on a rejection."""
        h: dict[str, str] = {}
        if self.limit_requests is not None:
            h["x-ratelimit-limit-requests"] = str(self.limit_requests)
            h["x-ratelimit-remaining-requests"] = str(max(0, self.remaining_requests or 0))
            h["x-ratelimit-reset-requests"] = format_duration(self.reset_requests_s)
        if self.limit_tokens is not None:
            h["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            h["x-ratelimit-remaining-tokens"] = str(max(0, self.remaining_tokens or 0))
            h["x-ratelimit-reset-tokens"] = format_duration(self.reset_tokens_s)
        if not self.allowed and self.retry_after_s is not None:
            h["retry-after"] = str(retry_after_header(self.retry_after_s))
        return h

    def error(self) -> ClientError:
        """The rejection as the client's OpenAI error (429, or 503 fail-closed), with these headers."""
        if self.status == 503:
            return ClientError(503, self.message or "rate limiter unavailable", code="rate_limiter_unavailable",
                               headers=self.headers())
        return ClientError(429, self.message, code="rate_limit_exceeded", headers=self.headers())


def format_duration(seconds: float) -> str:
    """OpenAI/Go-style duration: ``"250ms"`` under a second, else ``"1s"``, ``"6m0s"``, ``"1h2m3s"`` (seconds rounded up)."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    total = math.ceil(seconds)
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{s}s"
    if m:
        return f"{m}m{s}s"
    return f"{s}s"


def retry_after_header(seconds: float) -> int:
    """``Retry-After`` value: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(seconds))


# KEYS: per limit i: ZSET log (2i-1), HASH tokens (2i). ARGV: now_ms, window_ms, request_id, tokens, n,
# then per limit: rpm, tpm (-1 = unlimited), then the caller's deadline (wall-clock ms; past it on Redis's clock
# the caller has given up: {-1}, nothing recorded: a trial's fail-closed 503 still took a slot when the script ran
# as Redis woke). Returns {allowed, failed_index, retry_ms, then per limit: count, used_tokens, reset_req_ms,
# reset_tok_ms}; retry_ms = -1 when the request can never fit.
_ACQUIRE_LUA = r"""
local now = tonumber(ARGV[1]); local window = tonumber(ARGV[2]); local rid = ARGV[3]
local tokens = tonumber(ARGV[4]); local n = tonumber(ARGV[5])
local clock = redis.call('TIME')
if tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000) > tonumber(ARGV[6 + 2*n]) then
  return {-1}
end
local out = {}
local allowed = 1; local failed = 0; local retry = 0
for i = 1, n do
  local z = KEYS[2*i-1]; local h = KEYS[2*i]
  local rpm = tonumber(ARGV[4+2*i]); local tpm = tonumber(ARGV[5+2*i])
  local old = redis.call('ZRANGEBYSCORE', z, '-inf', now - window)
  if #old > 0 then
    local freed = 0
    for j = 1, #old, 500 do
      local part = {}
      for k = j, math.min(j+499, #old) do part[#part+1] = old[k] end
      local vals = redis.call('HMGET', h, unpack(part))
      for _, v in ipairs(vals) do freed = freed + (tonumber(v) or 0) end
      redis.call('HDEL', h, unpack(part))
    end
    redis.call('ZREMRANGEBYSCORE', z, '-inf', now - window)
    redis.call('HINCRBY', h, '__sum', 0 - freed)   -- not -freed: -0 is no integer to Redis
  end
  local count = redis.call('ZCARD', z)
  local used = tonumber(redis.call('HGET', h, '__sum') or '0')
  local first = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
  local reset_req = 0
  if #first > 0 then reset_req = tonumber(first[2]) + window - now end
  local reset_tok = reset_req
  local r = 0
  if rpm >= 0 and count + 1 > rpm then
    if rpm == 0 then r = -1 else
      local e = redis.call('ZRANGE', z, count - rpm, count - rpm, 'WITHSCORES')
      r = tonumber(e[2]) + window - now
    end
  end
  if r >= 0 and tpm >= 0 and used + tokens > tpm then
    if tokens > tpm then r = -1 else
      local entries = redis.call('ZRANGE', z, 0, -1, 'WITHSCORES')
      local freed = 0; local t = 0
      for k = 1, #entries, 2 do
        freed = freed + (tonumber(redis.call('HGET', h, entries[k])) or 0)
        if used - freed + tokens <= tpm then t = tonumber(entries[k+1]) + window - now; break end
      end
      if t > r then r = t end
    end
  end
  if r ~= 0 and allowed == 1 then allowed = 0; failed = i; retry = r end
  out[#out+1] = count; out[#out+1] = used; out[#out+1] = reset_req; out[#out+1] = reset_tok
end
if allowed == 1 then
  for i = 1, n do
    local z = KEYS[2*i-1]; local h = KEYS[2*i]
    redis.call('ZADD', z, now, rid)
    redis.call('HSET', h, rid, tokens)
    redis.call('HINCRBY', h, '__sum', tokens)
    redis.call('PEXPIRE', z, window + 1000); redis.call('PEXPIRE', h, window + 1000)
  end
end
local res = {allowed, failed, retry}
for _, v in ipairs(out) do res[#res+1] = v end
return res
"""

# KEYS: per limit (ZSET, HASH). ARGV: request_id, admitted_ms, tokens, window_ms. Adds an admission made elsewhere.
_MERGE_LUA = r"""
for i = 1, #KEYS / 2 do
  local z = KEYS[2*i-1]; local h = KEYS[2*i]
  if not redis.call('ZSCORE', z, ARGV[1]) then
    redis.call('ZADD', z, ARGV[2], ARGV[1]); redis.call('HSET', h, ARGV[1], ARGV[3])
    redis.call('HINCRBY', h, '__sum', ARGV[3])
    redis.call('PEXPIRE', z, tonumber(ARGV[4]) + 1000); redis.call('PEXPIRE', h, tonumber(ARGV[4]) + 1000)
  end
end
return 1
"""

# KEYS: per limit (ZSET, HASH). ARGV: request_id, new_tokens (-1 = release: remove the entry).
_RECONCILE_LUA = r"""
local rid = ARGV[1]; local new = tonumber(ARGV[2])
for i = 1, #KEYS / 2 do
  local z = KEYS[2*i-1]; local h = KEYS[2*i]
  if redis.call('ZSCORE', z, rid) then
    local old = tonumber(redis.call('HGET', h, rid) or '0')
    if new < 0 then
      redis.call('ZREM', z, rid); redis.call('HDEL', h, rid); redis.call('HINCRBY', h, '__sum', 0 - old)
    else
      redis.call('HSET', h, rid, new); redis.call('HINCRBY', h, '__sum', new - old)
    end
  end
end
return 1
"""


@dataclass
class _Log:
    """In-process twin of one limit's ZSET + HASH: admissions in time order."""

    entries: "OrderedDict[str, tuple[int, int]]" = field(default_factory=OrderedDict)  # request_id -> (ms, tokens)
    used: int = 0

    def expire(self, now: int, window: int) -> None:
        while self.entries:
            rid, (ts, tok) = next(iter(self.entries.items()))
            if ts > now - window:
                break
            self.entries.popitem(last=False)
            self.used -= tok


class RateLimiter:
    """Sliding-window RPM/TPM limiter over ``SharedState`` (Redis or in-process).

    window_s: the window in seconds (60 for per-minute limits).
    """

    def __init__(self, state: SharedState, window_s: float = 60.0):
        self.state = state
        self.window_ms = int(window_s * 1000)
        self._local: dict[str, _Log] = {}  # in-process twin, keyed like Redis
        self._unsynced: list[tuple[list[str], str, int, int]] = []  # admitted during a Redis outage
        state.on_rejoin(self._push_unsynced)

    def _keys(self, limit: Limit) -> tuple[str, str]:
        base = self.state.key("rl", f"{limit.scope}:{limit.id}")
        return base + ":log", base + ":tok"

    async def acquire(self, limits: list[Limit], tokens: int, request_id: str,
                      now: int | None = None) -> RateLimitResult:
        """Admit ``request_id`` reserving ``tokens`` (estimated prompt + max_tokens) against every limit, or reject.

        Limits with neither rpm nor tpm are ignored. Atomic: either all limits record the admission or none.
        Fail-closed mode with Redis unreachable: a 503 result.
        """
        limits = [lim for lim in limits if lim.rpm is not None or lim.tpm is not None]
        if not limits:
            return RateLimitResult(allowed=True, reservation=RateReservation(request_id, [], tokens))
        now = now_ms() if now is None else now
        keys: list[str] = []
        args: list = [now, self.window_ms, request_id, int(tokens), len(limits)]
        for lim in limits:
            keys.extend(self._keys(lim))
            args.extend([-1 if lim.rpm is None else lim.rpm, -1 if lim.tpm is None else lim.tpm])
        args.append(int(time.time() * 1000 + self.state.config.socket_timeout_s * 1000))   # Redis's clock
        fail_closed = self.state.fail_closed_limits and self.state.redis is not None

        def fallback() -> list[int]:
            if fail_closed:
                return []
            return self._acquire_local(keys, args)

        raw = await self.state.run("rl_acquire", _ACQUIRE_LUA, keys, args, fallback)
        if raw and int(raw[0]) == -1:   # run past the deadline (a stall, or this host's clock behind Redis's)
            raw = fallback()
        if not raw:
            return RateLimitResult(allowed=False, status=503, retry_after_s=self.state.config.reconnect_max_s,
                                   message="rate limiter unavailable (shared state unreachable); retry later")
        return self._result([int(x) for x in raw], limits, request_id, tokens)

    def _result(self, raw: list[int], limits: list[Limit], request_id: str, tokens: int) -> RateLimitResult:
        allowed, failed, retry = raw[0] == 1, raw[1], raw[2]
        res = RateLimitResult(allowed=allowed, status=200 if allowed else 429)
        best_req = best_tok = None
        for i, lim in enumerate(limits):
            count, used, reset_req, reset_tok = raw[3 + 4 * i: 7 + 4 * i]
            if allowed:
                count, used = count + 1, used + tokens
                reset_req = reset_req or self.window_ms
                reset_tok = reset_tok or self.window_ms
            if lim.rpm is not None and (best_req is None or lim.rpm - count < best_req[0]):
                best_req = (lim.rpm - count, lim.rpm, reset_req)
            if lim.tpm is not None and (best_tok is None or lim.tpm - used < best_tok[0]):
                best_tok = (lim.tpm - used, lim.tpm, reset_tok)
        if best_req:
            res.remaining_requests, res.limit_requests, res.reset_requests_s = best_req[0], best_req[1], best_req[2] / 1000
        if best_tok:
            res.remaining_tokens, res.limit_tokens, res.reset_tokens_s = best_tok[0], best_tok[1], best_tok[2] / 1000
        if allowed:
            res.reservation = RateReservation(request_id, limits, int(tokens))
        else:
            lim = limits[failed - 1]
            res.limit = lim
            what = f"{lim.scope} {lim.id!r}"
            if retry < 0:
                res.message = (f"Request too large for the rate limit of {what}: {tokens} tokens requested, "
                               f"limit {lim.tpm} tokens per {self.window_ms // 1000}s.")
            else:
                res.retry_after_s = retry / 1000
                limit = " and ".join(f"{n} {unit}" for n, unit in ((lim.rpm, "requests"), (lim.tpm, "tokens"))
                                     if n is not None)     # only the limits set: never "None tokens"
                res.message = (f"Rate limit reached for {what} (limit: {limit} per {self.window_ms // 1000}s). "
                               f"Retry after {retry_after_header(retry / 1000)}s.")
        return res

    def _acquire_local(self, keys: list[str], args: list) -> list[int]:
        """Python twin of ``_ACQUIRE_LUA`` (same arguments, same result layout)."""
        now, window, rid, tokens, n = args[:5]
        out: list[int] = []
        allowed, failed, retry = 1, 0, 0
        logs = []
        for i in range(n):
            rpm, tpm = args[5 + 2 * i], args[6 + 2 * i]
            lg = self._local.setdefault(keys[2 * i], _Log())
            lg.expire(now, window)
            logs.append(lg)
            entries = list(lg.entries.values())
            count, used = len(entries), lg.used
            reset_req = entries[0][0] + window - now if entries else 0
            r = 0
            if rpm >= 0 and count + 1 > rpm:
                r = -1 if rpm == 0 else entries[count - rpm][0] + window - now
            if r >= 0 and tpm >= 0 and used + tokens > tpm:
                if tokens > tpm:
                    r = -1
                else:
                    freed, t = 0, 0
                    for ts, tok in entries:
                        freed += tok
                        if used - freed + tokens <= tpm:
                            t = ts + window - now
                            break
                    r = max(r, t)
            if r != 0 and allowed == 1:
                allowed, failed, retry = 0, i + 1, r
            out += [count, used, reset_req, reset_req]
        if allowed:
            for lg in logs:
                lg.entries[rid] = (now, tokens)
                lg.used += tokens
            if self.state.redis is not None and len(self._unsynced) < 100_000:
                self._unsynced.append((keys, rid, now, tokens))
        return [allowed, failed, retry] + out

    async def _push_unsynced(self) -> None:
        """On rejoin: admissions counted in process during the outage are added to Redis (nothing is lost)."""
        pending, self._unsynced = self._unsynced, []
        oldest = now_ms() - self.window_ms
        for keys, rid, ts, tokens in pending:
            if ts <= oldest:
                continue
            await self.state.run("rl_merge", _MERGE_LUA, keys, [rid, ts, tokens, self.window_ms], lambda: 1)

    async def reconcile(self, reservation: RateReservation | None, actual_tokens: int) -> None:
        """Replace the reserved token count with the real usage (prompt + completion tokens)."""
        await self._adjust(reservation, int(actual_tokens))

    async def release(self, reservation: RateReservation | None) -> None:
        """Undo an admission entirely (the request never reached an upstream, e.g. rejected by a later limit)."""
        await self._adjust(reservation, -1)

    async def _adjust(self, reservation: RateReservation | None, new: int) -> None:
        if reservation is None or not reservation.limits:
            return
        keys: list[str] = []
        for lim in reservation.limits:
            keys.extend(self._keys(lim))

        def fallback() -> int:
            for i in range(0, len(keys), 2):
                lg = self._local.get(keys[i])
                if lg is None or reservation.request_id not in lg.entries:
                    continue
                ts, old = lg.entries[reservation.request_id]
                if new < 0:
                    del lg.entries[reservation.request_id]
                    lg.used -= old
                else:
                    lg.entries[reservation.request_id] = (ts, new)
                    lg.used += new - old
            return 1

        await self.state.run("rl_reconcile", _RECONCILE_LUA, keys, [reservation.request_id, new], fallback)
