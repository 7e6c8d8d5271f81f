"""Where cached answers live: one Lua script per operation on Redis (shared by every gateway replica) and its
in-process twin over ``SharedState.memory`` (no Redis, or Redis unreachable), with the same semantics, pinned
together by ``tests/gateway/cache/test_store.py``.

A key space (a route and the engine's ``system_fingerprint``) is a least-recently-used set of entries bounded by
``max_entries`` and ``max_bytes`` (a value's UTF-8 length). An entry expires ``ttl_s`` after it was stored, by the
caller's clock (times are passed in, as everywhere in ``gateway/state.py``); an expired entry is a miss and is
dropped when read, and otherwise counts until it is evicted. A key space can be switched off (a spot-check found
an answer that differs from its recomputation): its lookups answer ``off``.

Redis keys (``<prefix>`` = ``tandem``): ``<prefix>:cache:<space>:<key>`` (the entry: ``<expires_ms>|<value>``,
with a Redis TTL), ``<prefix>:cache-lru:<space>`` (zset, member = key, score = last use), ``-size`` (hash of
sizes), ``-bytes`` and ``-seq`` (counters), ``<prefix>:cache-off:<space>``; all carry TTLs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from gateway.state import SharedState

# A switched-off key space stays off this long (a new engine build or model gives a new space at once).
OFF_TTL_MS = 7 * 86400 * 1000

# KEYS: entry, lru, sizes, bytes, seq, off; ARGV: key, now_ms. Returns {status, value or nil}.
_GET = """
if redis.call('EXISTS', KEYS[6]) == 1 then return {'off', false} end
local v = redis.call('GET', KEYS[1])
if not v then
  if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
    redis.call('DECRBY', KEYS[4], redis.call('HGET', KEYS[3], ARGV[1]) or 0)
    redis.call('HDEL', KEYS[3], ARGV[1])
  end
  return {'miss', false}
end
local bar = string.find(v, '|', 1, true)
if tonumber(string.sub(v, 1, bar - 1)) <= tonumber(ARGV[2]) then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('DECRBY', KEYS[4], redis.call('HGET', KEYS[3], ARGV[1]) or 0)
  redis.call('HDEL', KEYS[3], ARGV[1])
  return {'miss', false}
end
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[5]), ARGV[1])
return {'hit', string.sub(v, bar + 1)}
"""

# KEYS: entry, lru, sizes, bytes, seq; ARGV: key, value, now_ms, ttl_ms, max_entries (0: none),
# max_bytes (0: none), entry key prefix. Returns the number of entries evicted.
_PUT = """
local key, value, ttl = ARGV[1], ARGV[2], tonumber(ARGV[4])
local old = redis.call('HGET', KEYS[3], key)
if old then redis.call('DECRBY', KEYS[4], old) end
redis.call('SET', KEYS[1], tostring(tonumber(ARGV[3]) + ttl) .. '|' .. value, 'PX', ttl)
redis.call('HSET', KEYS[3], key, #value)
redis.call('INCRBY', KEYS[4], #value)
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[5]), key)
local max_n, max_b, evicted = tonumber(ARGV[5]), tonumber(ARGV[6]), 0
while (max_n > 0 and redis.call('ZCARD', KEYS[2]) > max_n)
      or (max_b > 0 and tonumber(redis.call('GET', KEYS[4]) or 0) > max_b) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not oldest then break end
  redis.call('ZREM', KEYS[2], oldest)
  redis.call('DEL', ARGV[7] .. oldest)
  redis.call('DECRBY', KEYS[4], redis.call('HGET', KEYS[3], oldest) or 0)
  redis.call('HDEL', KEYS[3], oldest)
  evicted = evicted + 1
end
for i = 2, 5 do redis.call('PEXPIRE', KEYS[i], ttl * 2) end
return evicted
"""


@dataclass
class _Space:
    """One key space in process: key -> (expires_ms, value), least recently used first."""

    entries: OrderedDict = field(default_factory=OrderedDict)
    bytes: int = 0


@dataclass(frozen=True)
class Bounds:
    """A key space's limits: ``ttl_ms``, ``max_entries`` and ``max_bytes`` (None: unbounded)."""

    ttl_ms: int
    max_entries: int | None = None
    max_bytes: int | None = None


class CacheStore:
    """Cached answers (strings) by key space and key, on ``state`` (Redis or in process)."""

    def __init__(self, state: SharedState):
        self.state = state

    def _keys(self, space: str, key: str) -> list[str]:
        k = self.state.key
        return [k("cache", f"{space}:{key}"), k("cache-lru", space), k("cache-lru", space + "-size"),
                k("cache-lru", space + "-bytes"), k("cache-lru", space + "-seq")]

    def _space(self, space: str) -> _Space:
        return self.state.memory.setdefault(f"cache:{space}", _Space())

    async def get(self, space: str, key: str, now_ms: int) -> tuple[str, str | None]:
        """``("hit", value)``, ``("miss", None)`` or ``("off", None)`` (the space is switched off)."""
        keys = self._keys(space, key)

        def local() -> tuple[str, str | None]:
            if f"cache-off:{space}" in self.state.memory:
                return "off", None
            sp = self._space(space)
            entry = sp.entries.get(key)
            if entry is None:
                return "miss", None
            if entry[0] <= now_ms:
                del sp.entries[key]
                sp.bytes -= _size(entry[1])
                return "miss", None
            sp.entries.move_to_end(key)
            return "hit", entry[1]

        return await self.state.run("cache_get", _GET, [*keys, self.state.key("cache-off", space)], [key, now_ms],
                                    local, decode=lambda r: (str(r[0]), r[1] if r[0] == "hit" else None))

    async def put(self, space: str, key: str, value: str, now_ms: int, bounds: Bounds) -> int:
        """Store ``value`` (replacing any entry of ``key``), then evict the least recently used entries until the
        space is within ``bounds`` (a value larger than ``max_bytes`` evicts itself). Returns how many were
        evicted."""
        keys = self._keys(space, key)
        max_n, max_b = bounds.max_entries or 0, bounds.max_bytes or 0

        def local() -> int:
            sp = self._space(space)
            old = sp.entries.pop(key, None)
            if old is not None:
                sp.bytes -= _size(old[1])
            sp.entries[key] = (now_ms + bounds.ttl_ms, value)
            sp.bytes += _size(value)
            evicted = 0
            while sp.entries and ((max_n and len(sp.entries) > max_n) or (max_b and sp.bytes > max_b)):
                _, (_, v) = sp.entries.popitem(last=False)
                sp.bytes -= _size(v)
                evicted += 1
            return evicted

        prefix = self.state.key("cache", f"{space}:")
        return await self.state.run("cache_put", _PUT, keys, [key, value, now_ms, bounds.ttl_ms, max_n, max_b,
                                                              prefix], local, decode=int)

    async def switch_off(self, space: str) -> None:
        """Switch ``space`` off on every replica (and in this process, for an outage)."""
        self.state.memory[f"cache-off:{space}"] = True
        key = self.state.key("cache-off", space)
        await self.state.call(lambda r: r.set(key, "1", px=OFF_TTL_MS), lambda: None)


def _size(value: str) -> int:
    return len(value.encode())
