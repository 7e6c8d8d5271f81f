"""Rollout state and parity records in shared state (``gateway.state.SharedState``: Redis when configured, in
process otherwise), so every replica reads the same rollout and report and a restarted gateway resumes where it
was.

Keys (prefix ``tandem``): a rollout that holds its route (running, paused, promoted) never expires, nor do the
name sets (a name whose key is gone is dropped by the read that finds it so); an ended one, its record and the
parity records expire ``KEY_TTL_S`` after their last write. (A soak trial: every key expired a week after its last
write, and a promoted rollout, which nothing writes, would then have stopped holding its route: the next reload
would set the file's split over the promotion.)

- ``<prefix>:rollout:<name>`` (JSON of the rollout, with its ``rev``) and ``<prefix>:rollout-rev:<name>``: a
  change names the revision it was built on and is refused when another replica wrote meanwhile (``save``'s
  compare-and-set, one Lua script);
- ``<prefix>:rollout-route:<route>``: the rollout that holds the route (running, paused or promoted), set and
  cleared by the same script, which refuses a save that would make a second holder (``RouteHeld``): two
  operators starting rollouts on one route at once get one rollout and one refusal, not two;
- ``<prefix>:rollouts`` (set): the rollout names; ``<prefix>:rollouts-live`` (set): those running or paused,
  the only ones the controller loads each tick (a finished rollout stays readable until its key expires, and
  its name is dropped from the set by the first read that finds the key gone);
- ``<prefix>:rollout-lease``: the replica whose controller acts now (``SET NX PX``, renewed by its holder);
  these rollout and lease operations have an in-process twin for a gateway without Redis only (with Redis
  configured and unreachable they raise ``StateUnavailable``: ``SharedState.local_only``);
- ``<prefix>:parity:<name>`` (list, newest first, ``MAX_RECORDS`` long): comparison records
  (``gateway/rollouts/parity.py``), ``<prefix>:parity-names`` (set) their names; ``<prefix>:parity-dropped:<name>``: shadow pairs dropped over concurrency.
"""

from __future__ import annotations

import json

from gateway.config.layers import HOLDING_STATES
from gateway.config.versions import Guard

KEY_TTL_S = 7 * 24 * 3600
MAX_RECORDS = 2000

LIVE = ("running", "paused")       # the states the controller acts on (and whose pairs are compared)

# KEYS: state, rev, names set, live set, route claim. ARGV: json (holding the new rev: expected + 1), expected rev,
# name, ttl, live (1/0), holds the route (1/0). Returns {new rev, ''}, {-(rev + 1), ''} on a revision conflict, or
# {0, holder} when another rollout holds the route. The JSON is stored as Python wrote it (cjson would re-encode
# its floats to 14 significant digits).
_SAVE = """
local rev = tonumber(redis.call('GET', KEYS[2]) or '0')
if rev ~= tonumber(ARGV[2]) then return {-rev - 1, ''} end
local owner = redis.call('GET', KEYS[5])
if ARGV[6] == '1' and owner and owner ~= ARGV[3] then return {0, owner} end
rev = rev + 1
if ARGV[6] == '1' then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('SET', KEYS[2], rev)
else
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[4])
  redis.call('SET', KEYS[2], rev, 'EX', ARGV[4])
end
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('PERSIST', KEYS[3])
if ARGV[5] == '1' then
  redis.call('SADD', KEYS[4], ARGV[3])
  redis.call('PERSIST', KEYS[4])
else
  redis.call('SREM', KEYS[4], ARGV[3])
end
if ARGV[6] == '1' then
  redis.call('SET', KEYS[5], ARGV[3])
elseif owner == ARGV[3] then
  redis.call('DEL', KEYS[5])
end
return {rev, ''}
"""

# KEYS: lease. ARGV: holder, ttl ms. Returns 1 when the caller holds it now.
_LEASE = """
local cur = redis.call('GET', KEYS[1])
if cur == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: lease. ARGV: holder. Deletes the lease when the caller holds it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: list, names set. ARGV: record json, max, ttl, name.
_PUSH = """
redis.call('SADD', KEYS[2], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2]) - 1)
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""


class Conflict(Exception):
    """Another replica changed the rollout since it was read (its revision is ``rev``)."""

    def __init__(self, name: str, rev: int):
        super().__init__(f"rollout {name!r} changed meanwhile (revision {rev}); re-read it")
        self.rev = rev


class RouteHeld(Exception):
    """Another rollout (``holder``) holds the route a save would make this one hold."""

    def __init__(self, route: str, holder: str):
        super().__init__(f"route {route!r} is held by rollout {holder!r}")
        self.route, self.holder = route, holder


class RolloutStore:
    """Reads and compare-and-set writes of rollouts and parity records on a ``SharedState``."""

    def __init__(self, state):
        self.state = state
        self.mem = state.memory.setdefault("rollouts", {"states": {}, "lease": None, "parity": {}, "dropped": {},
                                                        "routes": {}})

    def _local(self, fallback):
        """The in-process twin of a rollout or lease operation: used without Redis; with Redis configured and
        unreachable, StateUnavailable instead (``SharedState.local_only``: the replica's copy is not the rollout)."""
        return self.state.local_only(fallback, "rollouts")

    def _k(self, kind: str, name: str = "") -> str:
        return self.state.key(kind, name) if name else f"{self.state.config.key_prefix}:{kind}"

    async def names(self) -> list[str]:
        out = await self.state.call(lambda r: r.smembers(self._k("rollouts")),
                                    self._local(lambda: set(self.mem["states"])))
        return sorted(out)

    async def live_names(self) -> list[str]:
        """Names of the running and paused rollouts."""
        def local() -> set[str]:
            return {n for n, raw in self.mem["states"].items() if json.loads(raw)["state"] in LIVE}

        return sorted(await self.state.call(lambda r: r.smembers(self._k("rollouts-live")), self._local(local)))

    async def index_live(self) -> None:
        """Put every running or paused rollout in the live set (once per controller start: rollouts saved
        before the set existed, or whose set expired, are found again)."""
        for name in await self.names():
            r = await self.load(name)
            if r is not None and r["state"] in LIVE:
                await self.state.call(lambda c, n=name: c.sadd(self._k("rollouts-live"), n), self._local(lambda: 0))

    async def load(self, name: str) -> dict | None:
        """The rollout's state dict (with ``rev``), or None (never created, or expired: then its name is
        dropped from the sets)."""
        raw = await self.state.call(lambda r: r.get(self._k("rollout", name)),
                                    self._local(lambda: self.mem["states"].get(name)))
        if raw:
            return json.loads(raw)
        await self.state.call(lambda r: r.srem(self._k("rollouts"), name), self._local(lambda: 0))
        await self.state.call(lambda r: r.srem(self._k("rollouts-live"), name), self._local(lambda: 0))
        return None

    async def save(self, name: str, data: dict, rev: int) -> int:
        """Write ``data`` as built on revision ``rev`` (0: a new rollout); returns the new revision. A rollout in a
        holding state (running, paused, promoted) claims its route in the same step; one that leaves them frees it.

        Raises:
            Conflict: the stored revision is not ``rev``.
            RouteHeld: ``data`` holds its route and another rollout holds it already."""
        raw = json.dumps({**data, "rev": rev + 1})
        route, holds = data["route"], data["state"] in HOLDING_STATES

        def local() -> list:
            cur = self.mem["states"].get(name)
            have = json.loads(cur)["rev"] if cur else 0
            if have != rev:
                return [-have - 1, ""]
            owner = self.mem["routes"].get(route)
            if holds and owner not in (None, name):
                return [0, owner]
            self.mem["states"][name] = raw
            if holds:
                self.mem["routes"][route] = name
            elif owner == name:
                del self.mem["routes"][route]
            return [rev + 1, ""]

        keys = [self._k("rollout", name), self._k("rollout-rev", name), self._k("rollouts"), self._k("rollouts-live"),
                self._k("rollout-route", route)]
        live = "1" if data["state"] in LIVE else "0"
        new, owner = await self.state.run("rollout_save", _SAVE, keys,
                                          [raw, rev, name, KEY_TTL_S, live, "1" if holds else "0"],
                                          self._local(local))
        new = int(new)
        if new < 0:
            raise Conflict(name, -new - 1)
        if new == 0:
            raise RouteHeld(route, owner)
        data["rev"] = new
        return new

    def guard(self, name: str, rev: int) -> Guard:
        """The condition "rollout ``name`` is still at revision ``rev``", for a config change it makes
        (``gateway.config.versions.Guard``: checked in the ledger's push script, or in process)."""
        def holds() -> bool:
            raw = self.mem["states"].get(name)
            return (json.loads(raw)["rev"] if raw else 0) == rev

        return Guard(self._k("rollout-rev", name), rev, holds)

    async def lease(self, holder: str, ttl_s: float) -> bool:
        """True when ``holder`` holds (took or renewed) the controller lease for ``ttl_s`` more seconds."""
        return bool(int(await self.state.run("rollout_lease", _LEASE, [self._k("rollout-lease")],
                                             [holder, int(ttl_s * 1000)], self._local(lambda: 1))))

    async def release(self, holder: str) -> None:
        """Give the controller lease back if ``holder`` holds it."""
        await self.state.run("rollout_release", _RELEASE, [self._k("rollout-lease")], [holder],
                             self._local(lambda: 0))

    async def push_record(self, name: str, record: dict) -> None:
        """Add one comparison record to ``name``'s report."""
        raw = json.dumps(record)

        def local() -> int:
            lst = self.mem["parity"].setdefault(name, [])
            lst.insert(0, raw)
            del lst[MAX_RECORDS:]
            return 1

        await self.state.run("parity_push", _PUSH, [self._k("parity", name), self._k("parity-names")],
                             [raw, MAX_RECORDS, KEY_TTL_S, name], local)

    async def records(self, name: str) -> list[dict]:
        """``name``'s comparison records, oldest first."""
        raw = await self.state.call(lambda r: r.lrange(self._k("parity", name), 0, -1),
                                    lambda: list(self.mem["parity"].get(name, [])))
        return [json.loads(x) for x in reversed(raw)]

    async def record_names(self) -> list[str]:
        """Names with parity records (shadows and rollouts)."""
        out = await self.state.call(lambda r: r.smembers(self._k("parity-names")), lambda: set(self.mem["parity"]))
        return sorted(out)

    async def count_dropped(self, name: str) -> None:
        def local() -> int:
            self.mem["dropped"][name] = self.mem["dropped"].get(name, 0) + 1
            return 1

        await self.state.call(lambda r: r.incr(self._k("parity-dropped", name)), local)

    async def dropped(self, name: str) -> int:
        v = await self.state.call(lambda r: r.get(self._k("parity-dropped", name)),
                                  lambda: self.mem["dropped"].get(name, 0))
        return int(v or 0)
