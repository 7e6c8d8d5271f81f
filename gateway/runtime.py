"""The running gateway: the current config snapshot, its backends, config versions (reload, weights, rollback,
Redis propagation; the loops in ``gateway/config/sync.py``) and drain. The request path reads ``gateway.snapshot``
once per request, so a swap never affects requests already running.

With ``state.redis_url`` set, the config versions and the rollouts live in Redis. While it is unreachable a
replica keeps serving its running version, and every change of the desired state (reload, weights, rollback,
rollout actions) is refused with ``StateUnavailable`` (503 ``redis_unavailable``) naming why: made here alone, it
could not see the rollouts that hold routes, nor reach the other replicas, and would be lost or undo another's
change when Redis returns (as Kubernetes' API server refuses writes while etcd is down). A replica started
during an outage serves its file alone (logged) and joins as a start would once Redis answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from prometheus_client import Counter

from gateway.config.changes import describe_changes
from gateway.config.compile import Compiled, load_config_text
from gateway.config.config_file import ConfigFile
from gateway.config.layers import RolloutConflict, holder, layer_view, over_file, route_weights, same_as_file
from gateway.config.rollback import check_keys, returns_to
from gateway.config.schema import ConfigError
from gateway.config.sync import sync_versions, watch_file
from gateway.backends.build import build_backends
from gateway.backends.local import LocalBackend
from gateway.backends.latency import UpstreamLatency
from gateway.backends.replicas import ReplicaLoads
from gateway.cache.response_cache import ResponseCache
from gateway.cache.store import CacheStore
from gateway.resilience.layer import Resilience
from gateway.billing.journal import Journal
from gateway.billing.local_cost import running_cost
from gateway.resilience.streaming import GATEWAY_SHUTDOWN
from gateway.billing.usage import UsageLedger
from gateway.observability.metrics import LiveGauges
from gateway.observability.telemetry import Observability
from gateway.config.versions import ConfigState, Guard, GuardFailed, MemoryLedger, RedisLedger, VersionConflict, \
    text_digest
from gateway.config.weights import newly_keyless
from gateway.config.status import down_warnings, routes_now
from gateway.rollouts.controller import RolloutController
from gateway.rollouts.metrics import ParityCollector
from gateway.rollouts.shadow import ShadowRunner
from gateway.rollouts.store import RolloutStore
from gateway.request.auth import NO_KEYS, exposed_without_keys, serves_this_machine_only
from gateway.snapshot import Snapshot
from gateway.state import StateUnavailable
from gateway.tasks import cancel_task

log = logging.getLogger("tandem.gateway")
# how long before a drain's deadline the streams still open are interrupted (at most a quarter of the drain)
_INTERRUPT_LEAD_S = 1.0


class Gateway:
    """Owns config generations and backends.

    Args:
        config_path: the YAML file (reloads read it again); None = text only.
        initial: the validated config to start with.
        start_engine: start the local engine (tests without one pass False).
    """

    def __init__(self, config_path: str | None, initial: Compiled, start_engine: bool = True):
        self.config_path = config_path
        self.start_engine = start_engine
        self.snapshot: Snapshot | None = None
        self.in_flight = 0
        self.streams_cut = 0               # streams a shutdown ended with stream_interrupted (interrupt_streams)
        self.draining = False
        self.on_drained = None           # callback set by the server: exit the process
        self.retired: list = []          # (time retired, backend) of older generations, closed when idle
        self.redis_degraded = False
        self._unjoined = False           # started while Redis was unreachable: joins when it answers
        self._initial = initial
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self.engine_start: asyncio.Task | None = None   # the co-located engine's load, once started
        self.listen: tuple[str, bool] | None = None   # (host, --insecure) of the server this gateway answers on
        self.config_file = ConfigFile(config_path)   # the file on disk: reloads and the watcher read it
        self.file_digest = ""            # the applied state's: digest of the file text last applied from a file
        cfg = initial.config
        self.resilience = Resilience(cfg)   # limits, breakers, health: shared state lives as long as the process
        self.usage = UsageLedger(self.resilience.state, cfg.budgets.reservation_ttl_s,   # usage and budgets
                                 cfg.budgets.record_ttl_s, Journal(cfg.budgets.journal_path))
        self.obs = Observability(cfg, self.usage, self.live_gauges)   # metrics, traces, request logs
        self.replicas = ReplicaLoads(self.obs.registry)   # load of prefix_affinity routes' engine replicas
        self.cache = ResponseCache(CacheStore(self.resilience.state), self.obs.metrics)   # routes' cache: entries
        self.latency = UpstreamLatency()   # upstreams' rolling TTFT, for slo routes
        self.local_cost = None             # gateway.billing.local_cost.LocalCost when local.cost is set
        self.obs.local_price = self.local_billing_price   # the ledger bills the local engine at it
        store = RolloutStore(self.resilience.state)   # rollouts and parity records, shared by replicas
        self.rollouts = RolloutController(self, store)
        self.shadows = ShadowRunner(store, self.usage, Counter(
            "tandem_shadow_requests", "Shadow and parity pairs, sent or dropped over max_concurrency.",
            ["rollout", "outcome"], registry=self.obs.registry), local_price=self.local_billing_price,
            spent=self.obs.metrics.spent)
        self.parity_metrics = ParityCollector()
        self.obs.registry.register(self.parity_metrics)
        if cfg.state.redis_url:
            self.ledger = RedisLedger(cfg.state.redis_url, cfg.state.key_prefix, cfg.reload.keep_versions,
                                      cfg.state.socket_timeout_s)
        else:
            self.ledger = MemoryLedger(cfg.reload.keep_versions)

    # ----- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Apply the initial config (or the shared head: ``_join``), start the engine, the watcher and the sync loop."""
        state, since = await self._initial_state()
        self._apply(state, compiled=self._initial if state.text == self._initial.text and not state.overrides else None,
                    since=since)
        if self.snapshot.local is not None and self.start_engine:
            self.engine_start = asyncio.create_task(self.snapshot.local.start())
            self._tasks.append(self.engine_start)
        elif self.snapshot.local is not None:
            self.snapshot.local.unavailable_reason, self.snapshot.local.loading = "engine not started", False
        self.resilience.start(lambda: self.snapshot.backends)
        if len(self.usage.journal):      # settles a previous run journaled during an outage
            try:
                await self.usage.replay()
            except Exception as e:  # noqa: BLE001 -- Redis down: the next rejoin replays them
                log.warning("usage journal replay at start failed: %s", e)
        self._tasks.append(asyncio.create_task(   # this replica's view of the budgets, for an outage
            self.usage.watch_budgets(lambda: self.snapshot.compiled.config.budgets.tenants)))
        self.replicas.start()
        self.rollouts.start()
        self._tasks.append(asyncio.create_task(watch_file(self)))
        if self.ledger.shared:
            self._tasks.append(asyncio.create_task(sync_versions(self)))

    async def _initial_state(self) -> tuple[ConfigState, Compiled | str | None]:
        """The state this replica starts on and what it follows (``_join``'s). With Redis unreachable: this file
        alone, and ``_unjoined`` set (the sync loop joins once Redis answers)."""
        state = ConfigState(self._initial.text, {}, "file", file_digest=text_digest(self._initial.text))
        for _ in range(3):               # another replica may push between our read and our push
            try:
                joined = await self._join(state)
            except VersionConflict:
                continue
            except Exception as e:  # noqa: BLE001 -- Redis down: serve on the file
                self._redis_failed(e)
                break
            self._unjoined = False
            return joined
        if not self._unjoined:
            log.warning("the shared config is unreachable: serving on the config file alone (operators' overrides "
                        "and rollouts not applied) until Redis answers")
        self._unjoined = True
        return state, None

    async def _join(self, state: ConfigState) -> tuple[ConfigState, Compiled | str | None]:
        """The shared head when this file (``state``) is the one last applied from a file (whatever operators did
        since, weights or a rollback, stands: a restart never undoes it); else this file, pushed as a new version
        under the layers above the head's file (as a reload; one that would orphan a rollout is not applied: the
        head, logged, and ``config_file`` says why). With it, for the log line: the head this file was pushed over
        (its changes are said), why the file was not applied, or None. Raises VersionConflict and Redis' errors."""
        head = await self.ledger.head()
        if head is not None and (head.file_digest == state.file_digest
                                 or (not head.file_digest and head.text == state.text)):
            log.info("adopting shared config version %d (%s)", head.version, head.source)
            return head, None
        takes, since = [], None
        if head is not None:
            try:
                layered = over_file(head.text, self._initial, head.overrides, await self.rollouts.every(),
                                    owners=head.owners)
            except RolloutConflict as e:
                log.error("config file not applied at start, adopting shared version %d: %s", head.version, e)
                self.config_file.refused(self._initial.text, str(e))
                return head, f"the shared version, not the file {os.path.realpath(self.config_path or '')} (see above)"
            state.overrides, state.owners, takes = layered.overrides, layered.owners, layered.takes
            with contextlib.suppress(ConfigError):   # a head this version cannot read: "the first version"
                since = load_config_text(head.text, head.overrides)
        await self.rollouts.take_back(takes)      # before the push: see ``_commit``
        state.version = await self.ledger.push(state, None if head is None else head.version)
        return state, since

    async def stop(self) -> None:
        await self.rollouts.stop()
        await self.shadows.stop()
        for t in self._tasks:
            await cancel_task(t)
        self._tasks.clear()
        await self.resilience.stop()
        await self.replicas.stop()
        backends = list(self.snapshot.backends.values()) if self.snapshot else []
        for b in backends + [b for _, b in self.retired]:
            try:
                await b.aclose()
            except Exception as e:  # noqa: BLE001
                log.warning("closing backend %s: %s", b.name, e)
        await self.ledger.aclose()

    def local_billing_price(self, backend: str):
        """The ``Price`` the ledger bills ``backend``'s answers at: ``LocalCost.billed`` (``running_cost``), or None."""
        running = running_cost(self, self.snapshot)
        if running is None or running[1].name != backend or running[1].engine is None:
            return None
        return running[0].billed(running[1].engine.get_stats(), time.monotonic())

    def live_gauges(self) -> LiveGauges:
        """What ``GET /metrics`` reads at scrape time."""
        s = self.snapshot
        return LiveGauges(self.in_flight, self.redis_degraded or self.resilience.degraded,
                          s.version if s is not None else None, s.source if s is not None else "",
                          len(self.usage.journal), s.local.restarts if s is not None and s.local is not None else None)

    @property
    def ready(self) -> bool:
        """Config valid, not draining, and the local engine (if any) done loading: loaded, or failed for good (the
        readiness then says ``degraded`` where no route serves without it; a load trial's engine refused its
        too-small KV cache and the gateway said ``not_ready``, "loading", for ever)."""
        s = self.snapshot
        if s is None or self.draining:
            return False
        return s.local is None or not s.local.loading or not self.start_engine   # loaded means not loading

    # ----- config generations ----------------------------------------------------------------------------------
    def _build_backends(self, compiled: Compiled) -> tuple[dict, LocalBackend | None]:
        old = self.snapshot.backends if self.snapshot else {}
        backends, local = build_backends(compiled.config.backends, old, compiled.warnings)
        if local is not None:   # a restarted engine is new: its targets' breakers close (Resilience.backend_renewed)
            local.on_restarted = lambda: self.resilience.backend_renewed(
                self.snapshot.compiled.policy.routes, local.name, "the local engine restarted")
        now = time.monotonic()
        for name, b in old.items():
            if backends.get(name) is not b:
                self.retired.append((now, b))
        return backends, local

    def _apply(self, state: ConfigState, compiled: Compiled | None = None,
               since: Compiled | str | None = None) -> Snapshot:
        """Validate ``state`` and swap it in; ``since``: ``_join``'s. Raises ConfigError (nothing changes)."""
        if compiled is None:
            compiled = load_config_text(state.text, state.overrides)
        backends, local = self._build_backends(compiled)
        policy_fields = compiled.policy.fields()
        snap = Snapshot(compiled, backends, state.version, state.source, "prompt_tokens" in policy_fields,
                        compiled.config.server.max_body_size, local, list(compiled.warnings),
                        any(f.startswith("local.") for f in policy_fields), dict(state.owners))
        if self.listen is not None and exposed_without_keys(compiled, *self.listen):
            snap.closed = True           # fail closed: the warning tells the operator (the log, `tandem ctl`)
            snap.warnings.append(NO_KEYS)
        snap.this_machine_only = self.listen is not None and serves_this_machine_only(compiled, *self.listen)
        self.resilience.configure(compiled.config)
        self.replicas.configure(compiled, backends)
        self.file_digest = state.file_digest or self.file_digest
        old, self.snapshot = self.snapshot, snap     # the atomic swap: one reference assignment
        self.obs.configure(snap)
        ours = state.source == "file" and self.config_path and not isinstance(since, str)   # this replica's file
        log.info("config version %d applied (%s%s): %s", state.version, state.source,
                 f" {os.path.realpath(self.config_path)}" if ours else "",
                 since if isinstance(since, str) else describe_changes(old.compiled if old else since, compiled))
        for w in snap.warnings:
            log.warning("%s", w)
        return snap

    async def _commit(self, state: ConfigState, base: int, guard: Guard | None = None, takes=()) -> dict:
        """Validate, push to the ledger as built on version ``base``, apply.

        ``takes``: the rollouts a reload takes its routes back from, ended after the validation and before the
        push (ended after it, a tick that read one just before could set its split again over the reload: its
        change is guarded by the rollout's revision, ``guard``, which the ending moves on).

        Raises:
            ConfigError: invalid (naming the config file).
            VersionConflict: the shared head is no longer ``base`` (nothing changes here).
            GuardFailed: ``guard`` does not hold (nothing changes).
            StateUnavailable: Redis is configured and unreachable (nothing changes)."""
        async with self._lock:
            compiled = load_config_text(state.text, state.overrides, source=self.config_path)   # validate first
            await self.rollouts.take_back(takes)
            try:
                # A state equal to the ledger's head keeps the head's version.
                state.version = await self.ledger.push(state, base, guard)
            except Exception as e:  # noqa: BLE001 -- a conflict, or Redis unreachable: nothing changes
                if takes:
                    log.error("rollouts %s ended by a change that was then not applied (%s): their routes keep their "
                              "split, as an operator's", ", ".join(t.name for t in takes), e)
                if isinstance(e, (VersionConflict, GuardFailed)):
                    raise
                raise self._unreachable(f"config change ({state.source})", e) from None
            same = state.version == self.snapshot.version
            if same:   # the running version's content: nothing to apply, and its source stays (the ledger
                snap = self.snapshot   # recorded the file digest)
                self.file_digest, snap.owners = state.file_digest or self.file_digest, dict(state.owners)
                log.info("config version %d (%s) stays: the %s change is the same config", snap.version,
                         snap.source, state.source)
            else:
                snap = self._apply(state, compiled)
            # the backends' health, read once: the warnings and the routes' shares
            health = await self.resilience.status_or_none(snap.compiled.policy.routes, snap.backends)
            if not same:
                snap.warnings += down_warnings(snap, health)
            return {"version": snap.version, "source": snap.source, "warnings": snap.warnings, "unchanged": same,
                    "propagated": True if self.ledger.shared else None, "routes": routes_now(snap, health)}

    def _unreachable(self, what: str, e: Exception) -> StateUnavailable:
        """The refusal of a change to the shared desired state while Redis is unreachable (see the module
        docstring; the admin API's 503 ``redis_unavailable``)."""
        self._redis_failed(e)
        why = "" if isinstance(e, StateUnavailable) else f" ({type(e).__name__}: {e})"
        return StateUnavailable(f"{what} not applied, version {self.snapshot.version} stays: Redis is unreachable{why}; "
                                "changes to the shared config and rollouts wait for it (made on this replica alone, one "
                                "could undo a rollout it cannot read or be lost when Redis returns)")

    async def _every_rollout(self, what: str) -> list[dict]:
        """Every rollout (``RolloutController.every``). Raises StateUnavailable (``_unreachable``)."""
        try:
            return await self.rollouts.every()
        except StateUnavailable as e:
            raise self._unreachable(what, e) from None

    async def reload(self, source: str = "reload", abort_rollouts: bool = False) -> dict:
        """Re-read the config file and apply it under the layers above it (``gateway/config/layers.py``): operator
        overrides of routes the file did not change and the rollouts that hold a route stay; the answer's
        ``layers`` says per route which layer decides.

        Raises:
            ConfigError: the file is invalid (the running config stays).
            RolloutConflict: the file would orphan a rollout (see ``layers.reapply``; nothing changes).
            StateUnavailable: Redis is configured and unreachable (nothing changes)."""
        if not self.config_path:
            raise ConfigError([("", "no config file to reload")])
        try:
            with open(self.config_path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError([("", f"cannot read it: {e.strerror}")], self.config_path) from None
        self.config_file.mark()
        new = None
        try:   # built on the version this replica runs: a newer one it has not seen yet is refused, not undone
            new = load_config_text(text, {}, source=self.config_path)
            if keyless := newly_keyless(self.snapshot.compiled.config, new.config, os.environ):
                raise ConfigError(keyless, self.config_path)
            layered = over_file(self.snapshot.compiled.text, new,
                                self.snapshot.compiled.overrides, await self._every_rollout(f"config reload ({source})"),
                                abort_rollouts, self.snapshot.owners)
            out = await self._commit(ConfigState(text, layered.overrides, source, file_digest=text_digest(text),
                                                 owners=layered.owners), self.snapshot.version, takes=layered.takes)
        except (ConfigError, RolloutConflict, StateUnavailable) as e:
            log.error("config reload (%s) refused, keeping version %d: %s", source, self.snapshot.version, e)
            if new is not None:     # it loads (an unset key, a rollout, Redis): the file status says why it waits
                self.config_file.refused(text, str(e))
            if isinstance(e, StateUnavailable):    # a watched file is applied once Redis answers (the poll retries)
                self.config_file.unmark()
            raise
        out["layers"] = layer_view(layered.file, layered)
        for route, v in out["layers"].items():
            if v["note"]:
                log.info("reload: route %s decided by %s (%s)", route, v["decided_by"], v["note"])
        return out

    async def set_weights(self, route: str, weights: dict[str, float], base: int | None = None,
                          rebase: bool = False, rollout: str = "", guard: Guard | None = None,
                          ended: bool = False) -> dict:
        """Override ``route``'s target weights (target id or backend -> weight), on top of the version this
        replica runs (``base``, when given, must be it), or with ``rebase`` on top of the shared head.
        ``rollout``: the rollout controller setting its own rollout's split (the rollout layer, named in the
        version's ``owners``), as long as ``guard`` holds (the rollout's revision it read); ``ended``: the split a
        rollout leaves as it ends (aborted, rolled back), no override at all when it is the file's.

        Raises:
            ConfigError: unknown route/target or negative weight.
            VersionConflict: ``base`` is not the version built on, or the head moved past it.
            RolloutConflict: a running or promoted rollout holds the route (its layer is above an operator's:
                the change would be undone by its next step or the next reload).
            StateUnavailable: Redis is configured and unreachable (nothing changes)."""
        what = f"weights change of route {route!r}"
        held = None if rollout else holder(await self._every_rollout(what), route, ("running", "promoted"))
        if held is not None:
            raise RolloutConflict([f"rollout {held['name']} ({held['state']}) holds route {route!r}"],
                                  ": pause it (tandem ctl rollout pause) or release it (promoted) before setting "
                                  "the route's weights by hand")
        cur = self.snapshot
        text, overrides, version, digest = cur.compiled.text, cur.compiled.overrides, cur.version, self.file_digest
        owners = cur.owners
        if rebase:
            try:
                head = await self.ledger.head()
            except Exception as e:  # noqa: BLE001 -- Redis unreachable: nothing changes
                raise self._unreachable(what, e) from None
            if head is not None:
                text, overrides, version, digest = head.text, head.overrides, head.version, head.file_digest
                owners = head.owners
        if base is not None and base != version:
            raise VersionConflict(base, max(version, cur.version))
        new = {r: dict(w) for r, w in overrides.items()}
        new.setdefault(route, {}).update({k: float(v) for k, v in weights.items()})
        # the route's file weights: read only where a rule below asks for them (not on a rollout's own steps)
        file_weights = route_weights(load_config_text(text, {}).policy).get(route) if not rollout or ended else None
        if not rollout and same_as_file(file_weights, new[route], over=overrides.get(route)):
            new = overrides              # the split the route has now: the version and its source stay
        else:
            owners = {**owners, route: rollout}
            if not rollout or (ended and same_as_file(file_weights, new[route])):
                owners.pop(route)
                if rollout or same_as_file(file_weights, new[route]):   # where the file stands (a rollout ended
                    new.pop(route)       # there, an operator set the file's split): the file decides again
        source = f"rollout {rollout}" if rollout else "weights"   # the log, the history and config_info say who
        return await self._commit(ConfigState(text, new, source, file_digest=digest, owners=owners), version, guard)

    async def rollback(self, base: int | None = None, restore_keys: bool = False) -> dict:
        """Return to the previous version (all replicas follow), as built on ``base`` (default: the version
        this replica runs). The file watcher leaves it in place until the file itself changes.

        A rollback undoes a config change, not a rollout (``gateway/config/rollback.py``): a promoted rollout's
        split is set again on top (``RolloutController.reassert``; a running one's by the next tick), an ended one's
        is not brought back (the answer's warnings say so), and one that would be orphaned refuses it. Virtual keys
        the undone change removed come back only with ``restore_keys``.

        Raises:
            KeysRestored: the previous version has keys the head removed, and not ``restore_keys``.
            LookupError: no previous version.
            VersionConflict: the head is not ``base``.
            RolloutConflict: the previous version would orphan a rollout (nothing changes).
            StateUnavailable: Redis is configured and unreachable (nothing changes)."""
        async with self._lock:
            base = self.snapshot.version if base is None else base
            try:
                history = await self.ledger.history()
            except Exception as e:  # noqa: BLE001 -- Redis unreachable: nothing changes
                raise self._unreachable("config rollback", e) from None
            replace, kept, returned_to = None, [], None
            if len(history) >= 2 and history[0].version == base:
                check_keys(history[0], history[1], restore_keys)
                replace, kept = returns_to(history[0], history[1], await self._every_rollout("config rollback"))
                returned_to = history[1].version
            try:
                state = await self.ledger.rollback(base, replace)
            except (VersionConflict, LookupError):
                raise
            except Exception as e:  # noqa: BLE001 -- Redis unreachable: nothing changes
                raise self._unreachable("config rollback", e) from None
            if returned_to is not None:   # which version the operator returned to
                log.info("config rollback: version %d returns to version %d", state.version, returned_to)
            before = self.snapshot.compiled
            snap = self._apply(state)
            health = await self.resilience.status_or_none(snap.compiled.policy.routes, snap.backends)
            snap.warnings += down_warnings(snap, health)   # as any change does: weight landing on a down backend
            for w in kept:
                log.warning("config version %d (rollback): %s", state.version, w)
        await self.rollouts.reassert()
        if self.snapshot is not snap:   # a rollout reasserted its split: its routes' health is read again
            snap = self.snapshot
            health = await self.resilience.status_or_none(snap.compiled.policy.routes, snap.backends)
        return {"version": snap.version, "source": snap.source, "warnings": snap.warnings + kept,
                "propagated": True if self.ledger.shared else None, "routes": routes_now(snap, health),
                "returned_to": returned_to, "changes": describe_changes(before, snap.compiled)}

    # ----- background loops ------------------------------------------------------------------------------------
    def _redis_failed(self, e: Exception) -> None:
        if not self.redis_degraded:
            log.warning("redis unavailable (%s: %s); serving on local config state", type(e).__name__, e)
        self.redis_degraded = True

    # ----- drain -----------------------------------------------------------------------------------------------
    async def drain(self, timeout: float | None = None) -> int:
        """Stop accepting (new requests get 503, /health/ready says not
        ready), wait until in-flight requests and streams finish or the
        deadline passes (streams still open shortly before it end with the
        ``stream_interrupted`` event), then call ``on_drained``. Returns requests still in
        flight at the end (0 = clean). A drain already under way (a second
        SIGTERM, such as make's after the process group's, or ``ctl drain``
        twice) starts no second one: it returns the requests in flight now."""
        if self.draining:
            return self.in_flight
        self.draining = True
        deadline = timeout if timeout is not None else self.snapshot.compiled.config.server.drain_timeout_s
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline
        # streams still open this long before the deadline end with the stream_interrupted event, so that they
        # have written it by the deadline
        interrupt_at = end - min(_INTERRUPT_LEAD_S, deadline / 4)
        while self.in_flight > 0 and loop.time() < interrupt_at:
            await asyncio.sleep(0.05)
        left = await self.interrupt_streams(end - loop.time()) if self.in_flight else 0
        log.info("drained: %d stream(s) cut with stream_interrupted, %d request(s) still in flight", self.streams_cut,
                 left)
        if self.on_drained is not None:
            self.on_drained()
        return left

    async def interrupt_streams(self, grace_s: float) -> int:
        """End every stream still open with the ``stream_interrupted`` event (the gateway is shutting down) and
        wait up to ``grace_s`` for the requests in flight to finish writing; returns those still in flight. A
        drain's deadline calls it, and so does a second signal that exits at once: either way a client reads why
        its stream ended instead of a cut connection."""
        self.streams_cut += self.resilience.interrupt_streams(GATEWAY_SHUTDOWN)
        loop = asyncio.get_running_loop()
        end = loop.time() + grace_s
        while self.in_flight > 0 and loop.time() < end:
            await asyncio.sleep(0.02)
        return self.in_flight
