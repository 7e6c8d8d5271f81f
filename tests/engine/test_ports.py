"""``free_port``: ports below the kernel's ephemeral range, bindable, never repeated within a walk, a forked
child's walk its own (engine/executor/ports.py)."""

from __future__ import annotations

import os
import socket

from engine.executor import ports
from engine.executor.ports import free_port


def test_ports_lie_below_the_ephemeral_range_and_a_walk_never_repeats():
    low = ports._ephemeral_low()
    picked = [free_port() for _ in range(2000)]
    assert all(max(1024, low - 16384) <= p < low for p in picked)
    assert len(set(picked)) == len(picked)
    with socket.socket() as s:      # the last pick is bindable now
        s.bind(("127.0.0.1", picked[-1]))


def test_a_port_in_use_is_skipped():
    walk = ports._process_walk(os.getpid())
    with socket.socket() as held:
        nxt = free_port()
        held.bind(("127.0.0.1", walk.low + (nxt + 1 - walk.low) % walk.span))   # the walk's next port
        held.listen()
        assert free_port() not in (nxt, held.getsockname()[1])


def test_a_forked_child_walks_its_own_ports():
    """A child forked after its parent picked walks ports of its own: the parent's walk, inherited, would hand
    out the very ports the parent hands out next (the two would meet only if the child's random start fell on
    the parent's next port, 1 in 16,384)."""
    free_port()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, ",".join(str(free_port()) for _ in range(20)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = [int(p) for p in os.read(read, 1000).decode().split(",")]
    os.close(read)
    assert len(child) == 20 and child != [free_port() for _ in range(20)]


def test_a_port_another_process_was_handed_is_passed_over(tmp_path, monkeypatch):
    """A three-worker test run lost six servers to "Address already in use": two workers' walks crossed, and
    each handed out a port the other's server had not bound yet (an engine binds after its model loads). A
    pick is claimed among the machine's processes for HOLD_S seconds; a claim older than that is taken over."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(ports.tempfile, "tempdir", None)   # gettempdir reads TMPDIR again
    walk = ports._process_walk(os.getpid())
    nxt = walk.low + (free_port() + 1 - walk.low) % walk.span   # the walk's next port
    claims = tmp_path / "tandem-ports"
    (claims / str(nxt)).touch()                               # another process was handed it just now
    assert free_port() != nxt
    stale = walk.low + (free_port() + 1 - walk.low) % walk.span
    (claims / str(stale)).touch()
    os.utime(claims / str(stale), (0, 0))                     # handed out long ago: taken over
    assert free_port() == stale
