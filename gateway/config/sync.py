"""The gateway's two config loops, the file watcher (which also closes retired backends once idle) and the
shared-version sync (``Gateway.start`` runs them)."""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.config.layers import RolloutConflict
from gateway.config.schema import ConfigError
from gateway.config.versions import ConfigState, VersionConflict, text_digest
from gateway.state import StateUnavailable

log = logging.getLogger("tandem.gateway")


def close_idle_retired(gw) -> None:
    """Close ``gw``'s backends no generation uses once idle and retired for longer than the drain timeout (a
    request may still fall back onto them)."""
    live = gw.snapshot.backends.values()
    grace = gw.snapshot.compiled.config.server.drain_timeout_s
    now = time.monotonic()
    keep = []
    for since, b in gw.retired:
        if any(b is x for x in live):
            continue
        if b.active == 0 and now - since > grace:
            asyncio.get_running_loop().create_task(b.aclose())
        else:
            keep.append((since, b))
    gw.retired = keep


async def watch_file(gw) -> None:
    """The file watcher: every ``reload.poll_interval_s``, apply the config file when its text is not the one last
    applied from a file (``Gateway.file_digest``; a touch changes nothing), and close retired backends."""
    while True:
        await asyncio.sleep(gw.snapshot.compiled.config.reload.poll_interval_s)
        close_idle_retired(gw)
        if not gw.snapshot.compiled.config.reload.watch:
            continue
        if gw.redis_degraded:
            _note_waiting(gw)
        elif gw.config_file.changed():
            text = gw.config_file.read()
            if text is None or text_digest(text) == gw.file_digest:
                continue   # touched, not changed: what operators did since stands
            try:
                await gw.reload("file")
            except (ConfigError, RolloutConflict):
                pass       # logged by reload(); the running config stays (the file status says why)
            except StateUnavailable:
                pass       # reload() unmarked the file: applied once Redis answers (skipped while degraded)
            except VersionConflict as e:
                gw.config_file.unmark()   # apply the shared head first (sync loop), then this file
                log.warning("file change not applied yet: %s", e)
            except Exception:  # noqa: BLE001
                log.exception("reload on file change failed")


def _note_waiting(gw) -> None:
    """While Redis is unreachable a file edit waits (it is applied once Redis answers: the file stays unmarked):
    ``tandem ctl status`` says so, and the log once per edit (an ops trial read "runtime override active, file
    differs", and nothing in the log)."""
    if not gw.config_file.moved():
        return
    text = gw.config_file.read()
    if text is None or text_digest(text) == gw.file_digest:
        return
    why = "Redis is unreachable; the edit is applied once it answers"
    if gw.config_file.refused(text, why):
        log.warning("config file changed while Redis is unreachable: not applied yet, the running version %d is "
                    "kept (applied once Redis answers)", gw.snapshot.version)


async def sync_versions(gw) -> None:
    """Every ``state.sync_interval_s``: apply a newer shared head, join once Redis answers after a start during
    an outage, and re-seed Redis from this replica when it lost its data."""
    while True:
        await asyncio.sleep(gw.snapshot.compiled.config.state.sync_interval_s)
        try:
            v = await gw.ledger.version()
            if gw.redis_degraded:
                log.info("redis reachable again; config sync resumed")
                gw.redis_degraded = False
            if gw._unjoined:   # started during an outage: join as a start would (its file's digest)
                async with gw._lock:
                    state, since = await gw._initial_state()
                    try:
                        if not gw._unjoined:
                            gw._apply(state, since=since)
                    except ConfigError as e:
                        log.error("shared config version %d is invalid here, keeping the file: %s",
                                  state.version, e)
            elif v < gw.snapshot.version:
                # Redis lost its data (restarted without persistence): share ours.
                async with gw._lock:
                    cur = gw.snapshot
                    state = ConfigState(cur.compiled.text, cur.compiled.overrides, "reseed",
                                        file_digest=gw.file_digest, owners=cur.owners)
                    state.version = await gw.ledger.push(state, v)
                    cur.version = state.version
                    log.warning("shared config re-seeded from this replica as version %d", state.version)
            elif v > gw.snapshot.version:
                async with gw._lock:
                    head = await gw.ledger.head()
                    if head is not None and head.version > gw.snapshot.version:
                        try:
                            gw._apply(head)
                        except ConfigError as e:
                            log.error("shared config version %d is invalid here, keeping %d: %s",
                                      head.version, gw.snapshot.version, e)
        except Exception as e:  # noqa: BLE001
            gw._redis_failed(e)
