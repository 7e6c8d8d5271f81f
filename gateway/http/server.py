"""``tandem serve``: the gateway (and its in-process engine) under uvicorn
(uvloop event loop, httptools parser with the door's limits, ``door.py``), with signals:
SIGHUP = reload the config file; SIGTERM = drain (stop accepting, report
not-ready, let in-flight requests and streams finish within
``server.drain_timeout_s``; streams still open then end with the
``stream_interrupted`` event), then exit; SIGINT (Ctrl-C) = the same drain.
A second SIGTERM or SIGINT during a drain exits at once, after ending the
streams still open with the ``stream_interrupted`` event (best effort: up to
``_AFTER_DRAIN_S``); one within ``SIGNAL_ECHO_S`` of the first is the same stop,
e.g. make forwarding it. uvicorn's own SIGINT handling is not used: it closes
the listening socket at once (refused connections instead of 503 ``draining``)
and cancels the open streams mid-write at its deadline.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
from pathlib import Path

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from engine.protocol.signals import SIGNAL_ECHO_S, stop_exit_status
from engine.protocol.heap import freeze_heap
from gateway.http.app import create_app
from gateway.http.door import DoorLimits, door_protocol
from gateway.request.auth import exposed_without_keys
from gateway.config.compile import load_config_or_report
from gateway.config.layers import RolloutConflict
from gateway.config.schema import ConfigError
from gateway.embedded_redis import Supervisor, release, start_or_join, with_redis_url
from gateway.runtime import Gateway
from gateway.state import StateUnavailable

log = logging.getLogger("tandem.gateway")
# after a drain, what uvicorn still waits for connections: the drain already waited drain_timeout_s
_AFTER_DRAIN_S = 0.5


class GatewayServer(uvicorn.Server):
    """uvicorn's server with drain on SIGTERM or SIGINT and reload on SIGHUP; ``stop_signal``: the signal that
    started the drain (None: none yet)."""

    stop_signal: int | None = None

    def __init__(self, config: uvicorn.Config, gw: Gateway, picker=None):
        super().__init__(config)
        self.gw = gw
        self.picker = picker                     # gateway/picker/ext_proc.PickerServer, or None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_started: float | None = None
        self.exiting = False                     # a second signal is ending the streams before the exit
        gw.on_drained = self._exit

    def _exit(self) -> None:
        self.config.timeout_graceful_shutdown = _AFTER_DRAIN_S
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        for server in self.servers:   # uvicorn says where only for a socket it bound itself
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                log.info("listening on http://%s:%d (Ctrl-C to stop)", f"[{host}]" if ":" in host else host, port)
        if self.picker is not None and not self.should_exit:
            await self.picker.start()
        freeze_heap()       # the loaded gateway; its co-located engine's objects once it has loaded
        if self.gw.engine_start is not None:
            self.gw.engine_start.add_done_callback(lambda _: freeze_heap())
        try:
            self.loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / platform
            pass

    def _on_sighup(self) -> None:
        async def reload() -> None:
            try:
                await self.gw.reload("sighup")
            except (ConfigError, RolloutConflict, StateUnavailable):
                pass   # logged by reload (an ops trial's SIGHUP while Redis was away also logged a traceback)
        self.loop.create_task(reload())

    def handle_exit(self, sig: int, frame) -> None:
        if sig not in (signal.SIGTERM, signal.SIGINT) or self.loop is None:
            super().handle_exit(sig, frame)     # before startup there is nothing to drain
            return
        if self.drain_started is None and not self.gw.draining and not self.should_exit:
            log.info("%s: draining", signal.Signals(sig).name)
            self.drain_started = time.monotonic()
            self.stop_signal = sig
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain()))
            return
        if self.drain_started is not None and time.monotonic() - self.drain_started < SIGNAL_ECHO_S:
            return                               # the process group's signal, forwarded again by make
        if self.exiting:
            self.force_exit = self.should_exit = True   # a third signal: no more waiting for the streams
            return
        log.warning("second signal during the drain: exiting now")
        self.exiting = True
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._exit_now()))

    async def _drain(self) -> None:
        if self.picker is not None:
            await self.picker.set_serving(False)   # the data plane's health checks stop sending here
        await self.gw.drain()

    async def shutdown(self, sockets=None) -> None:
        if self.picker is not None:
            await self.picker.stop(_AFTER_DRAIN_S)
        await super().shutdown(sockets)

    async def _exit_now(self) -> None:
        """Exit without waiting for the drain, after the open streams got their ``stream_interrupted`` event:
        streams that ended themselves leave no task for uvicorn to cancel (a traceback each). Not uvicorn's
        ``force_exit``: that skips the app's shutdown, leaving the backends open and the lifespan task to be
        cancelled with a traceback; the shutdown costs only the backends' close."""
        await self.gw.interrupt_streams(_AFTER_DRAIN_S)
        self._exit()


def bind_refusal(compiled, host: str, insecure: bool = False) -> str | None:
    """Why ``tandem serve`` refuses to bind ``host`` with ``compiled`` (a ``CompiledConfig``), or None: a
    non-loopback address with no virtual key loaded (``auth.keys``; a key from an unset environment variable is
    not loaded) is open to anyone unless ``--insecure`` or ``server.insecure`` says that is meant."""
    if not exposed_without_keys(compiled, host, insecure):
        return None
    unset = [k.env for k in compiled.config.auth.keys if k.env]
    why = (f"no virtual API key is loaded (auth.keys: environment variable{'s' if len(unset) > 1 else ''} "
           f"{', '.join(unset)} unset)" if unset else "no virtual API keys are configured (auth.keys)")
    return (f"refusing to bind {host}: {why}, so the gateway would be open to anyone. Bind 127.0.0.1, configure "
            "keys, or pass --insecure.")


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (IPv6 where ``host`` has a colon; ``SO_REUSEADDR`` as uvicorn sets
    it), not inherited by the processes the gateway starts (its engine core, an embedded redis-server).
    ``tandem serve`` binds it before anything else runs: the app's startup publishes the config file to the
    replicas' shared state, which a process that then finds its port taken had already done (an SRE's trial: a
    second ``tandem serve`` on a busy port changed the running replicas' config, then exited 3).

    Raises:
        OSError: the address is taken, or not this host's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def serve(config_path: str, host: str | None = None, port: int | None = None, insecure: bool = False,
          start_engine: bool = True, picker_port: int | None = None, picker_health_port: int | None = None,
          picker_fallbacks: int = 0) -> int:
    """Run the gateway until stopped; with ``picker_port``, also as Envoy's endpoint picker (``ext_proc`` over
    gRPC on that port, its health service on ``picker_health_port`` too, ``picker_fallbacks`` endpoints after the
    primary: ``gateway/picker/``). Returns the
    process exit status: 0 after a stop SIGTERM started, 130 after one Ctrl-C's SIGINT started (as a shell reports
    it; ``tandem engine serve`` too), 2 = invalid config, refused bind, or a config the picker cannot serve, 3 =
    the address taken (uvicorn's ``STARTUP_FAILURE``), found before anything is started or published."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (compiled := load_config_or_report(config_path, "tandem serve: ")) is None:
        return 2
    cfg = compiled.config
    host = host or cfg.server.host
    port = cfg.server.port if port is None else port
    if why := bind_refusal(compiled, host, insecure):
        print(f"tandem serve: {why}", file=sys.stderr)
        return 2
    picker = None
    if picker_port is not None:
        try:
            from gateway.picker.ext_proc import PickerServer
            from gateway.picker.pick import check_config
        except ImportError as e:
            print(f"tandem serve --picker-port: {e.name} is not installed (pip install 'tandem[picker]')",
                  file=sys.stderr)
            return 2
        if why := check_config(compiled):
            print(f"tandem serve --picker-port: {why}", file=sys.stderr)
            return 2
    try:
        sock = listen(host, port)
    except OSError as e:
        print(f"tandem serve: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return STARTUP_FAILURE
    embedded = None
    if cfg.state.redis == "embedded":       # the one-machine default: start or join a private redis-server
        try:
            embedded = start_or_join(Path(cfg.state.data_dir) / "redis")
        except RuntimeError as e:
            print(f"tandem serve: {e}", file=sys.stderr)
            sock.close()
            return 2
        compiled = with_redis_url(compiled, embedded.url)
    gw = Gateway(config_path, compiled, start_engine=start_engine)
    gw.listen = (host, insecure)     # a later config without keys closes it (``exposed_without_keys``)
    if picker_port is not None:
        picker = PickerServer(gw, host, picker_port, picker_health_port, picker_fallbacks)
    door = DoorLimits(cfg.server.max_header_bytes, cfg.server.max_headers, cfg.server.header_timeout_s)
    config = uvicorn.Config(create_app(gw, cfg.server.cors), host=host, port=port, loop="uvloop",
                            http=door_protocol(door),
                            lifespan="on", access_log=False, log_level=cfg.server.log_level,
                            timeout_graceful_shutdown=cfg.server.drain_timeout_s, timeout_keep_alive=30,
                            proxy_headers=False, server_header=False)
    server = GatewayServer(config, gw, picker)
    supervisor = Supervisor(embedded) if embedded is not None else None
    if supervisor is not None:
        supervisor.start()                  # a server that dies is started again
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if supervisor is not None:
            release(supervisor.stop())      # shut down when no other gateway uses it
    return stop_exit_status(server.stop_signal)
