"""How the two HTTP servers (``tandem serve``: gateway/http/server.py; ``tandem engine serve``:
engine/entrypoints/server.py) read their stop signals and report them in their exit status: one rule for both."""

from __future__ import annotations

import signal

# A second SIGINT or SIGTERM this soon (seconds) after the first is the same stop: a terminal's Ctrl-C reaches the
# whole process group, and a wrapper (``make serve``) forwards it again; not an operator insisting.
SIGNAL_ECHO_S = 1.0


def stop_exit_status(stop_signal: int | None) -> int:
    """A server's exit status after a clean stop that ``stop_signal`` started (None: none, e.g. an admin drain):
    130 after SIGINT, as a shell reports Ctrl-C; 0 otherwise (SIGTERM: an orchestrator's normal stop)."""
    return 130 if stop_signal == signal.SIGINT else 0
