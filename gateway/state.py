"""Shared gateway state: Redis when configured, in-process otherwise, and in-process while Redis is down.

Choice (documented in docs/operators/gateway.md): without ``state.redis_url`` the gateway keeps its limits, breakers and
health in process. That is exact for one replica and needs no extra process; run several replicas only with
a shared Redis. We do not start an embedded Redis: a private Redis per replica would share nothing anyway.

With ``redis_url`` every update is one Lua script (atomic on the server), keys are namespaced
``<prefix>:<kind>:<id>`` (prefix ``tandem``) and carry TTLs, so nothing needs cleaning up. The state of a backend
each replica runs for itself (its co-located engine, ``replica_scoped``) is keyed
``<prefix>:<kind>:<replica id>@<id>``: one replica's engine crash, or a replica without an engine, never opens
another's breaker or fails its readiness. Times are passed in
by the caller (wall-clock milliseconds, ``time.time()``), so the Redis and in-process paths run the same
arithmetic and tests can drive the clock; replicas on different hosts need NTP-synchronised clocks.

Outage: the client uses short socket timeouts, no client-side retries, and every call is additionally bounded
by ``asyncio.timeout(timeout_s)``. The first failing call marks the store ``degraded`` and answers from the
in-process fallback; from then on calls go straight to the fallback (no request waits on a dead Redis) while a
background task PINGs Redis with exponential backoff (``reconnect_min_s`` doubling to ``reconnect_max_s``). When
PING answers, ``degraded`` clears, the registered rejoin hooks run (e.g. breakers push the cooldowns they
opened during the outage) and calls use Redis again. Lua scripts are sent with EVALSHA and re-sent with EVAL
after a Redis restart (redis-py's ``Script`` does this).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Awaitable, Callable, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, ResponseError

from gateway.config.schema import StateSettings
from gateway.tasks import cancel_task

log = logging.getLogger("tandem.state")

T = TypeVar("T")


# The kinds of key that hold a backend's state (breakers, probes, health counters): a replica-scoped backend's are
# this replica's own; every other kind (budgets, limits, usage, the cache) is shared whatever its id spells
BACKEND_KINDS = frozenset({"cb", "probe", "health"})


class StateUnavailable(Exception):
    """Redis is configured but unreachable, and the state asked for has no in-process stand-in (``local_only``)."""


class SharedState:
    """Runs atomic state operations on Redis, or on the in-process fallback when there is no (reachable) Redis.

    Each operation is written twice: a Lua script for Redis and a plain Python function over ``self.memory``
    (a dict owned by this object) with the same semantics. ``run`` picks one.
    """

    def __init__(self, config: StateSettings | None = None):
        self.config = config or StateSettings()
        self.memory: dict[str, Any] = {}
        self.degraded = False
        self.redis = None
        self._scripts: dict[str, Any] = {}
        self._rejoin_hooks: list[Callable[[], Awaitable[None]]] = []
        self._reconnect_task: asyncio.Task | None = None
        # this process among the replicas (budgets' peer sets, replica-scoped keys)
        self.replica_id = uuid.uuid4().hex[:16]
        # backends each replica runs for itself (its co-located engine): their breakers, probes and health
        # counters are this replica's own (``key``); set by the config's owner on every apply
        self.replica_scoped: frozenset[str] = frozenset()
        # Redis unreachable: refuse limited and budgeted requests (the config's state.fail_closed_limits, the one
        # state key a reload changes: set by the config's owner on every apply; the others shape the connection)
        self.fail_closed_limits = self.config.fail_closed_limits
        self.outages = 0   # times Redis became unreachable
        self.rejoins = 0   # times it came back (counted once the rejoin hooks have run)
        if self.config.redis_url:
            t = self.config.socket_timeout_s
            # A blocking pool: when all connections are busy a call waits (at most timeout_s) for one instead of
            # failing at once; no client-side retries (a retry would double the wait bound).
            pool = aioredis.BlockingConnectionPool.from_url(
                self.config.redis_url, max_connections=self.config.max_connections, timeout=t, socket_timeout=t,
                socket_connect_timeout=t, retry=Retry(NoBackoff(), 0), decode_responses=True)
            self.redis = aioredis.Redis(connection_pool=pool)

    @property
    def mode(self) -> str:
        """``"redis"``, ``"degraded"`` (Redis configured but unreachable) or ``"memory"`` (no Redis configured)."""
        if self.redis is None:
            return "memory"
        return "degraded" if self.degraded else "redis"

    def key(self, kind: str, ident: str) -> str:
        """Namespaced key ``<prefix>:<kind>:<id>``; ``<prefix>:<kind>:<replica id>@<id>`` for a backend's state
        (``BACKEND_KINDS``) when ``ident`` names a replica-scoped backend (``replica_scoped``): the backend
        itself, one of its targets (``backend/model``) or a per-target bucket (``backend/model:minute``)."""
        if kind in BACKEND_KINDS and any(ident == b or ident.startswith((b + "/", b + ":"))
                                         for b in self.replica_scoped):
            ident = f"{self.replica_id}@{ident}"
        return f"{self.config.key_prefix}:{kind}:{ident}"

    def on_rejoin(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Register a coroutine function run once each time Redis answers again after an outage."""
        self._rejoin_hooks.append(hook)

    def script(self, name: str, lua: str):
        """The registered redis-py ``AsyncScript`` for ``lua`` (cached by name)."""
        s = self._scripts.get(name)
        if s is None:
            s = self._scripts[name] = self.redis.register_script(lua)
        return s

    async def run(self, name: str, lua: str, keys: list[str], args: list[Any], fallback: Callable[[], T],
                  decode: Callable[[Any], T] = lambda r: r) -> T:
        """Run script ``lua`` on Redis and return ``decode(result)``; else return ``fallback()`` (in-process).

        Never waits longer than ``config.socket_timeout_s`` on Redis; a failure marks the store degraded.
        """
        if self.redis is None or self.degraded:
            return fallback()
        try:
            async with asyncio.timeout(self.config.socket_timeout_s):
                result = await self.script(name, lua)(keys=keys, args=args)
        except Exception as exc:  # redis.RedisError, OSError, TimeoutError: all mean "Redis unusable now"
            if _is_script_bug(exc):
                raise
            self._mark_degraded(exc)
            return fallback()
        return decode(result)

    async def redis_script(self, name: str, lua: str, keys: list[str], args: list[Any]) -> Any:
        """Run script ``lua`` on Redis or raise (no fallback, the state's mode unchanged): for a replay that
        must reach Redis or wait. Bounded by ``config.socket_timeout_s``."""
        async with asyncio.timeout(self.config.socket_timeout_s):
            return await self.script(name, lua)(keys=keys, args=args)

    async def call(self, fn: Callable[[Any], Awaitable[T]], fallback: Callable[[], T]) -> T:
        """Run ``fn(redis_client)`` (plain commands) with the same timeout and fallback rules as ``run``."""
        if self.redis is None or self.degraded:
            return fallback()
        try:
            async with asyncio.timeout(self.config.socket_timeout_s):
                return await fn(self.redis)
        except Exception as exc:
            if _is_script_bug(exc):
                raise
            self._mark_degraded(exc)
            return fallback()

    def local_only(self, fallback: Callable[[], T], what: str) -> Callable[[], T]:
        """``fallback`` as the in-process twin of ``run`` or ``call`` when no Redis is configured; with Redis
        configured, a fallback that raises StateUnavailable naming ``what``: for state that is one for all
        replicas or none (a rollout and its controller lease), whose in-process copy would be empty or stale and
        acting on it would undo the shared one."""
        if self.redis is None:
            return fallback

        def unavailable() -> T:
            raise StateUnavailable(f"Redis is unreachable: {what} wait for it (their state is shared only)")

        return unavailable

    def _mark_degraded(self, exc: BaseException) -> None:
        if not self.degraded:
            self.degraded = True
            self.outages += 1
            log.warning("redis unreachable (%s: %s): serving on in-process state", type(exc).__name__, exc)
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        delay = self.config.reconnect_min_s
        while self.degraded:
            await asyncio.sleep(delay)
            try:
                await asyncio.wait_for(self.redis.ping(), self.config.socket_timeout_s)
            except Exception:
                delay = min(delay * 2, self.config.reconnect_max_s)
                continue
            log.warning("redis answers again: rejoining shared state")
            try:  # drop pooled connections that died with the old server
                await self.redis.connection_pool.disconnect(inuse_connections=False)
            except Exception:
                pass
            self.degraded = False
            for hook in self._rejoin_hooks:
                try:
                    await hook()
                except Exception:  # a hook failing must not stop the others
                    log.exception("state rejoin hook failed")
            self.rejoins += 1

    async def ping(self) -> bool:
        """True when Redis answers now (always True in memory mode)."""
        if self.redis is None:
            return True
        try:
            return bool(await asyncio.wait_for(self.redis.ping(), self.config.socket_timeout_s))
        except Exception:
            return False

    async def close(self) -> None:
        """Stop the reconnect task and close the connection pool."""
        self._reconnect_task = await cancel_task(self._reconnect_task)
        if self.redis is not None:
            try:
                await self.redis.aclose()
                await self.redis.connection_pool.disconnect()
            except Exception:
                pass


def _is_script_bug(exc: BaseException) -> bool:
    """A Lua error is our bug, not an outage: let it surface instead of silently degrading."""
    return (isinstance(exc, ResponseError) and not isinstance(exc, NoScriptError)
            and "script" in str(exc).lower())


def now_ms() -> int:
    """Wall-clock time in integer milliseconds (the clock shared state uses)."""
    return int(time.time() * 1000)
