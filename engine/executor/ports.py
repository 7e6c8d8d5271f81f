"""Free TCP ports for the servers a process is about to start (tensor-parallel rendezvous, load tests, tests).

A port the kernel hands out for ``bind(port=0)`` comes from its ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), the same range every outgoing
connection takes its source port from. Between picking such a port and the server binding it, any client on
the machine may take it for a connection, and the server then fails with "Address already in use" (a CI run
lost a test to exactly that while the other test worker made thousands of connections). So ports here come
from the 16,384 below the ephemeral range, where no outgoing connection lands; each process walks them from
a random start, and one process never hands out the same port twice in a walk (16,384 picks). Two processes
whose walks cross could still hand out one port twice before either server bound it (an engine binds after its
model loads, seconds later: a three-worker test run lost six servers to that), so a pick is also claimed for
``HOLD_S`` seconds among this machine's processes: a file per port under ``$TMPDIR/tandem-ports``, created
exclusively; a port another process claimed within the hold is passed over.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import socket
import tempfile
import time
from pathlib import Path

_SPAN = 16384
HOLD_S = 120.0   # how long a pick stays claimed: a server that binds later than this (a slow model load) may lose it


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class _Walk:
    """The per-process walk over the ports below the ephemeral range (see the module's docstring)."""

    def __init__(self) -> None:
        high = _ephemeral_low()
        self.low = max(1024, high - _SPAN)
        self.span = max(1, high - self.low)
        self.steps = itertools.count(random.randrange(self.span))

    def next(self) -> int:
        return self.low + next(self.steps) % self.span


@functools.cache
def _process_walk(pid: int) -> _Walk:
    """This process's walk, built on first use (importing this module reads nothing); keyed by pid so that a
    forked child starts a walk of its own instead of repeating its parent's."""
    return _Walk()


def _bindable(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound right now (nothing listens on it nor holds it)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _claim(port: int) -> bool:
    """Claim ``port`` for ``HOLD_S`` seconds among this machine's processes (see the module's docstring): False
    when another process claimed it within the hold; True also where the claims cannot be written (no shared
    temporary directory: the walk alone then)."""
    claims = Path(tempfile.gettempdir()) / "tandem-ports"
    path = claims / str(port)
    try:
        claims.mkdir(mode=0o1777, exist_ok=True)
        for _ in range(2):
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
                return True
            except FileExistsError:
                if time.time() - path.stat().st_mtime < HOLD_S:
                    return False
                path.unlink(missing_ok=True)   # an older claim: its server bound the port or never will
        return False
    except OSError:
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that can be bound now, below the kernel's ephemeral range so that no outgoing
    connection takes it before the caller's server binds it, and that no other process of this machine was
    handed in the last ``HOLD_S`` seconds; the OS's pick (``bind(port=0)``) after 64 ports in a row are taken."""
    walk = _process_walk(os.getpid())
    for _ in range(64):
        port = walk.next()
        if _bindable(host, port) and _claim(port):
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
