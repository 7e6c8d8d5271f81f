"""How the two HTTP servers (``tandem serve``: gateway/http/server.py; ``tandem engine serve``:
engine/entrypoints/server.py) read their stop signals: one rule for both."""

from __future__ import annotations

# A second SIGINT or SIGTERM this soon (seconds) after the first is the same stop: a terminal's Ctrl-C reaches the
# whole process group, and a wrapper (``make serve``) forwards it again; not an operator insisting.
SIGNAL_ECHO_S = 1.0
