"""The ledger's Lua scripts on Redis (``gateway/billing/usage.py`` holds their in-process Python twins, pinned
together by ``tests/gateway/resilience/test_lua_twins.py``)."""

# KEYS: budget hash, reservations zset, peers zset (replica id -> its last reserve, ms).
# ARGV: now_ms, request id, estimate nusd, budget nusd, key ttl s, hold ms, deadline ms (the caller's wall clock;
# past it on Redis's clock the caller has given up: -1, nothing done), replica id, peer window ms.
# Returns {admitted 1/0, spent, reserved (before this reservation), peers}, or {-1, 0, 0, 0} when late; peers is
# how many replicas reserved on this budget within the window (this one included): in an outage each of them
# spends at most its share of what is left (gateway/billing/usage.py).
RESERVE_LUA = """
local t = redis.call('TIME')
if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > tonumber(ARGV[7]) then
  return {-1, 0, 0, 0}
end
local now = tonumber(ARGV[1])
redis.call('ZADD', KEYS[3], now, ARGV[8])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[9]))
redis.call('EXPIRE', KEYS[3], ARGV[5])
local peers = redis.call('ZCARD', KEYS[3])
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
  return {0, spent, reserved, peers}
end
redis.call('HINCRBY', KEYS[1], 'reserved', ARGV[3])
redis.call('HSET', KEYS[1], 'r:' .. ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return {1, spent, reserved, peers}
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


# KEYS: usage day hash, tenants set, budget hash ('' slot unused when no budget), reservations zset, ledger hash,
#       the tenant's day and month budget hashes (their ``spent`` counts every settle of the period, with a budget
#       or none, so a budget set mid-period starts from what the tenant spent; absent in a journal written before
#       them: the spend then goes to the budget hash only).
# ARGV: backend, requests, in, out, cached, nusd, usage ttl s, tenant, request id ('' = no reservation),
#       budget key ttl s ('0' = no budget), request id (the record's key), record, record ttl s, failed (1: no
#       backend answered; absent in a journal written before it: 0), the day and month hashes' ttl s.
# Returns 1, or 0 when the request's record exists already (settled before: nothing done).
SETTLE_LUA = """
if redis.call('HSETNX', KEYS[5], ARGV[11], ARGV[12]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[5], ARGV[13])
local b = ARGV[1]
redis.call('HINCRBY', KEYS[1], b .. '|req', ARGV[2])
redis.call('HINCRBY', KEYS[1], b .. '|in', ARGV[3])
redis.call('HINCRBY', KEYS[1], b .. '|out', ARGV[4])
redis.call('HINCRBY', KEYS[1], b .. '|cached', ARGV[5])
redis.call('HINCRBY', KEYS[1], b .. '|nusd', ARGV[6])
if ARGV[14] and ARGV[14] ~= '0' then redis.call('HINCRBY', KEYS[1], b .. '|fail', ARGV[14]) end
redis.call('EXPIRE', KEYS[1], ARGV[7])
redis.call('SADD', KEYS[2], ARGV[8])
redis.call('EXPIRE', KEYS[2], ARGV[7])
if ARGV[10] ~= '0' then
  if ARGV[9] ~= '' then
""" + _drop_reservation_lua("KEYS[3]", "KEYS[4]", "ARGV[9]") + """
  end
  if #KEYS < 7 then
    redis.call('HINCRBY', KEYS[3], 'spent', ARGV[6])
    redis.call('EXPIRE', KEYS[3], ARGV[10])
  end
  redis.call('EXPIRE', KEYS[4], ARGV[10])
end
if #KEYS >= 7 then
  for i = 6, 7 do
    redis.call('HINCRBY', KEYS[i], 'spent', ARGV[6])
    redis.call('EXPIRE', KEYS[i], ARGV[9 + i])
  end
end
return 1
"""

# KEYS: budget hash, reservations zset. ARGV: request id.  Drops a reservation (request refused before any call).
RELEASE_LUA = _drop_reservation_lua("KEYS[1]", "KEYS[2]", "ARGV[1]") + "return 1\n"
