"""Config versions: the ordered history of applied configs (YAML text +
weights overrides), shared by all replicas through Redis when
``state.redis_url`` is set, else kept in process.

A replica that changes the config (reload, weights, rollback) pushes a new
state; every replica polls the version counter (one GET per
``state.sync_interval_s``) and applies a newer head. Push and rollback are
single Lua scripts, so concurrent writers never interleave, and each names the
version it was built on (``base``): when the head has moved past it the change
is refused (``VersionConflict``, the admin API's 409 with the current version)
instead of silently overwriting a change this replica has not seen yet.

Every state carries ``file_digest``, the sha256 of the config file text last
applied from a file (a reload, or the first start): a weights change keeps it,
a rollback keeps the head's. The file watcher and a restarting replica apply
the file only when its digest differs from it, so a touch or a restart never
undoes an operator's rollback or weights change; a change equal to the head (no new version) still records its
``file_digest`` and ``owners`` on the head, so the digest the watcher compares is the file's last applied text and
never an older one (an edit back to that older text was taken for a touch and never applied). A rollout controller's change carries a ``Guard``: it is
pushed only while the rollout is still at the revision it was built on (one script over the ledger's keys and the
rollout's revision key), so a tick that read a rollout just before an operator or a reload ended it never sets
its split over their change. Keys:
``<prefix>:config:history`` (list, newest first, ``keep_versions`` long),
``<prefix>:config:version`` (counter), ``<prefix>:config:digest`` (head's
digest); none expires (the history is ``keep_versions`` long: a soak trial found the 30-day TTL they had, refreshed
only by a write, would drop a stable config's history, the rollbacks, after a month without a change).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import redis.asyncio as aioredis
import yaml


class VersionConflict(Exception):
    """A change built on version ``base`` while the head is ``current`` (another replica changed the config)."""

    def __init__(self, base: int, current: int):
        super().__init__(f"the config changed meanwhile: this change was built on version {base}, the current "
                         f"version is {current}; re-read it and retry (or rebase explicitly)")
        self.base, self.current = base, current


class GuardFailed(Exception):
    """A guarded change's rollout is no longer at the revision the change was built on (nothing done)."""


@dataclass(frozen=True)
class Guard:
    """The condition of a rollout's change: ``key`` (Redis: the rollout's revision key) holds ``rev``; ``holds``
    answers the same for the in-process state (``MemoryLedger``)."""

    key: str
    rev: int
    holds: Callable[[], bool]


def text_digest(text: str) -> str:
    """sha256 (hex) of a config file's text: ``ConfigState.file_digest``."""
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=16)
def document_digest(text: str) -> str:
    """sha256 (hex) of the document a config text holds: its parsed YAML in the text's key order, so comments,
    quoting and layout are not part of it (a comment-only edit is the same config); the text itself where it
    does not parse. Kept for the last texts (a YAML parse, ~3 ms for config.example.yaml: ``/admin/config``,
    which the console reads every 2 s, compares the file with the running text twice)."""
    try:
        doc = json.dumps(yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)), default=str)
    except yaml.YAMLError:
        doc = text
    return hashlib.sha256(doc.encode()).hexdigest()


def same_document(a: str, b: str) -> bool:
    """Whether two config texts hold the same document (``document_digest``)."""
    return a == b or document_digest(a) == document_digest(b)


@dataclass
class ConfigState:
    """One config version.

    Attributes:
        text: the YAML document.
        overrides: route -> {target id: weight} applied on top of it.
        source: what made it ("file", "reload", "weights" (an operator's), "rollout <name>" (its step),
            "rollback", ...).
        version: the ledger's counter when pushed (0 = not pushed yet).
        created: unix time, seconds.
        file_digest: ``text_digest`` of the file text last applied from a file ("" = unknown).
        owners: route -> the rollout whose split its override is (set by the controller; an operator's change of
            the route clears it): a rollout that ended is named as the layer of the override it left, and a
            rollback does not bring its split back (``gateway.config.layers``).
    """

    text: str
    overrides: dict[str, dict[str, float]] = field(default_factory=dict)
    source: str = "file"
    version: int = 0
    created: float = field(default_factory=time.time)
    file_digest: str = ""
    owners: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Weights as floats, so the digest is the same after a JSON round trip.
        self.overrides = {r: {t: float(w) for t, w in ws.items()} for r, ws in (self.overrides or {}).items()}

    @property
    def digest(self) -> str:
        """sha256 of the text's document (``document_digest``) + overrides: equal digests = the same config
        (computed once: a state's text and overrides are not changed once it is made)."""
        if "_digest" not in self.__dict__:
            h = hashlib.sha256(document_digest(self.text).encode())
            h.update(json.dumps(self.overrides, sort_keys=True).encode())
            self.__dict__["_digest"] = h.hexdigest()
        return self.__dict__["_digest"]

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("version")
        d["digest"] = self.digest
        return json.dumps(d)

    @classmethod
    def from_entry(cls, entry: str | bytes) -> "ConfigState":
        """Parse a ``"<version>\\n<json>"`` ledger entry."""
        if isinstance(entry, bytes):
            entry = entry.decode()
        v, _, body = entry.partition("\n")
        d = json.loads(body)
        return cls(d["text"], d.get("overrides") or {}, d.get("source", ""), int(v), d.get("created", 0.0),
                   d.get("file_digest") or "", d.get("owners") or {})

    def summary(self) -> dict:
        return {"version": self.version, "source": self.source, "created": self.created, "digest": self.digest[:12],
                "overrides": self.overrides}


class MemoryLedger:
    """In-process history (one replica)."""

    shared = False

    def __init__(self, keep: int = 10):
        self.states: deque[ConfigState] = deque(maxlen=keep)
        self.counter = 0

    async def head(self) -> ConfigState | None:
        return self.states[-1] if self.states else None

    async def version(self) -> int:
        return self.counter

    async def push(self, state: ConfigState, base: int | None = None, guard: Guard | None = None) -> int:
        """Append ``state`` unless it equals the head; returns its version.

        Raises:
            GuardFailed: ``guard`` does not hold.
            VersionConflict: ``base`` (the version ``state`` was built on; None = any) is not the head's."""
        if guard is not None and not guard.holds():
            raise GuardFailed(guard.key)
        if self.states and self.states[-1].digest == state.digest:
            head = self.states[-1]
            if state.file_digest:
                head.file_digest, head.owners = state.file_digest, dict(state.owners)
            return head.version
        if base is not None and base != self.counter:
            raise VersionConflict(base, self.counter)
        self.counter += 1
        state.version = self.counter
        self.states.append(state)
        return state.version

    async def rollback(self, base: int | None = None, replace: ConfigState | None = None) -> ConfigState:
        """Drop the head; the previous state becomes the head under a new version (keeping the head's
        ``file_digest``: the file is still the one last applied), or ``replace`` instead of it (the previous state
        as the caller corrected it, read while ``base`` was the head: its ``file_digest`` already the head's).

        Raises:
            VersionConflict: ``base`` is not the head's version.
            LookupError: fewer than two versions kept."""
        if base is not None and base != self.counter:
            raise VersionConflict(base, self.counter)
        if len(self.states) < 2:
            raise LookupError("no previous config version to roll back to")
        top = self.states.pop()
        prev = self.states.pop()
        self.counter += 1
        if replace is not None:
            state = ConfigState(replace.text, replace.overrides, "rollback", self.counter, replace.created,
                                replace.file_digest, dict(replace.owners))
        else:
            state = ConfigState(prev.text, prev.overrides, "rollback", self.counter, prev.created, top.file_digest,
                                dict(prev.owners))
        self.states.append(state)
        return state

    async def history(self) -> list[ConfigState]:
        return list(reversed(self.states))

    async def aclose(self) -> None:
        pass


# ARGV: state json, digest, keep, base version ('' = any), guard revision ('' = none; KEYS[4] its key), its
# file_digest and owners (json; recorded on a head of equal content when the file_digest is not ''). Returns the
# version, -(head version + 1) when the head is not ``base`` (a conflict), 0 when the guard does not hold (nothing
# done either way).
_PUSH = """
if ARGV[5] ~= '' and tonumber(redis.call('GET', KEYS[4]) or '0') ~= tonumber(ARGV[5]) then return 0 end
local cur = tonumber(redis.call('GET', KEYS[2]) or '0')
if redis.call('GET', KEYS[3]) == ARGV[2] then
  local head = redis.call('LINDEX', KEYS[1], 0)
  if ARGV[6] ~= '' and head then
    local nl = string.find(head, "\\n", 1, true)
    local d = cjson.decode(string.sub(head, nl + 1))
    d['file_digest'] = ARGV[6]
    d['owners'] = cjson.decode(ARGV[7])
    redis.call('LSET', KEYS[1], 0, string.sub(head, 1, nl) .. cjson.encode(d))
  end
  return cur
end
if ARGV[4] ~= '' and tonumber(ARGV[4]) ~= cur then return -cur - 1 end
local v = redis.call('INCR', KEYS[2])
redis.call('LPUSH', KEYS[1], v .. "\\n" .. ARGV[1])
redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[3]) - 1)
redis.call('SET', KEYS[3], ARGV[2])
for i = 1, 3 do redis.call('PERSIST', KEYS[i]) end
return v
"""

# ARGV: base version ('' = any), the replacing state's json and digest ('' = none: the previous state as
# stored). Returns the new head's entry, false (nothing to roll back to), or -(head version + 1) when the head is
# not ``base``.
_ROLLBACK = """
local cur = tonumber(redis.call('GET', KEYS[2]) or '0')
if ARGV[1] ~= '' and tonumber(ARGV[1]) ~= cur then return -cur - 1 end
if redis.call('LLEN', KEYS[1]) < 2 then return false end
local top = redis.call('LPOP', KEYS[1])
local top_d = cjson.decode(string.sub(top, string.find(top, "\\n", 1, true) + 1))
local prev = redis.call('LINDEX', KEYS[1], 0)
local nl = string.find(prev, "\\n", 1, true)
local body = string.sub(prev, nl + 1)
if ARGV[2] ~= '' then body = ARGV[2] end
local d = cjson.decode(body)
d['source'] = 'rollback'
if ARGV[2] == '' then d['file_digest'] = top_d['file_digest'] or '' end
if ARGV[3] ~= '' then d['digest'] = ARGV[3] end
body = cjson.encode(d)
local v = redis.call('INCR', KEYS[2])
redis.call('LSET', KEYS[1], 0, v .. "\\n" .. body)
redis.call('SET', KEYS[3], d['digest'])
for i = 1, 3 do redis.call('PERSIST', KEYS[i]) end
return v .. "\\n" .. body
"""


class RedisLedger:
    """History in Redis, shared by every replica (redis-py asyncio).

    Every method may raise ``redis.RedisError`` (the caller keeps serving on
    its current config)."""

    shared = True

    def __init__(self, url: str, prefix: str = "tandem", keep: int = 10, socket_timeout: float = 0.5):
        self.redis = aioredis.Redis.from_url(url, socket_timeout=socket_timeout,
                                             socket_connect_timeout=socket_timeout, decode_responses=False)
        self.keys = [f"{prefix}:config:history", f"{prefix}:config:version", f"{prefix}:config:digest"]
        self.keep = keep
        self._push = self.redis.register_script(_PUSH)
        self._rollback = self.redis.register_script(_ROLLBACK)

    async def version(self) -> int:
        v = await self.redis.get(self.keys[1])
        return int(v) if v else 0

    async def head(self) -> ConfigState | None:
        entry = await self.redis.lindex(self.keys[0], 0)
        return ConfigState.from_entry(entry) if entry else None

    async def push(self, state: ConfigState, base: int | None = None, guard: Guard | None = None) -> int:
        """As ``MemoryLedger.push``, atomically on Redis."""
        keys = self.keys + ([guard.key] if guard is not None else [])
        v = int(await self._push(keys=keys, args=[state.to_json(), state.digest, self.keep,
                                                  "" if base is None else base, "" if guard is None else guard.rev,
                                                  state.file_digest, json.dumps(state.owners)]))
        if v == 0:
            raise GuardFailed(guard.key)
        if v < 0:
            raise VersionConflict(base, -v - 1)
        state.version = v
        return v

    async def rollback(self, base: int | None = None, replace: ConfigState | None = None) -> ConfigState:
        """As ``MemoryLedger.rollback``, atomically on Redis."""
        args = ["" if base is None else base, "", ""]
        if replace is not None:
            args[1:] = [replace.to_json(), replace.digest]
        entry = await self._rollback(keys=self.keys, args=args)
        if isinstance(entry, int) and entry < 0:
            raise VersionConflict(base, -entry - 1)
        if not entry:
            raise LookupError("no previous config version to roll back to")
        return ConfigState.from_entry(entry)

    async def history(self) -> list[ConfigState]:
        return [ConfigState.from_entry(e) for e in await self.redis.lrange(self.keys[0], 0, -1)]

    async def aclose(self) -> None:
        await self.redis.aclose()
