"""The local journal of usage settled (and budget reservations released) while Redis was unreachable: each entry
is a ledger script's name, keys and arguments (``gateway/billing/usage.py``), kept in process and, with
``budgets.journal_path``, appended to a file (one JSON line each, flushed) so that a replica restarted during an
outage still has them. On rejoin (and at
start) the ledger replays every entry through the same script; the script records the request id first
(``HSETNX``), so an entry replayed twice, or one whose late script already ran when Redis woke, counts once.

Replicas may share the file (the config is one for all, so they do): each write holds a lock (``<path>.lock``,
``flock``), a replay takes the file's entries of every replica too (a dead one's are replayed by the next to
rejoin), and a compaction drops only the lines replayed. A replica that rewrote the file with its own entries
had erased another's (a trial billed 4 of 8 answers).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from dataclasses import dataclass

log = logging.getLogger("tandem.gateway.journal")


@dataclass(frozen=True)
class JournalEntry:
    """One script to replay: the request id, the script's ``keys`` and ``args``, the record's cost (nano-USD),
    and which script (``settle``, or ``release``: a reservation dropped without spending)."""

    request_id: str
    keys: list
    args: list
    nusd: int
    script: str = "settle"

    @property
    def key(self) -> tuple[str, str]:
        """What replaying it records once: its request id and script."""
        return self.request_id, self.script

    def to_line(self) -> str:
        return json.dumps({"rid": self.request_id, "keys": self.keys, "args": self.args, "nusd": self.nusd,
                           "script": self.script})

    @classmethod
    def from_line(cls, line: str) -> "JournalEntry":
        d = json.loads(line)
        return cls(d["rid"], list(d["keys"]), list(d["args"]), int(d["nusd"]), d.get("script", "settle"))


class Journal:
    """Settles waiting for Redis, in arrival order.

    Args:
        path: the file that keeps them across restarts (None: in process only).
    """

    def __init__(self, path: str | None = None):
        self.path = path
        self.entries: list[JournalEntry] = self._read()   # this process's (and the file's at start), not replayed

    def __len__(self) -> int:
        return len(self.entries)

    @contextlib.contextmanager
    def _locked(self):
        """The file's lock, held by one process (a replica) at a time."""
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _read(self) -> list[JournalEntry]:
        """The file's entries (none without a file); a torn line (a crash mid-write) is skipped, and said."""
        if not self.path or not os.path.exists(self.path):
            return []
        entries = []
        with open(self.path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        entries.append(JournalEntry.from_line(line))
                    except (ValueError, KeyError, TypeError):
                        log.warning("usage journal %s line %d unreadable: skipped", self.path, n)
        return entries

    def append(self, entry: JournalEntry) -> None:
        """Keep ``entry`` (and write it to the file, flushed, when there is one)."""
        self.entries.append(entry)
        if self.path:
            try:
                with self._locked(), open(self.path, "a", encoding="utf-8") as f:
                    f.write(entry.to_line() + "\n")
            except OSError as e:          # the in-process copy is still replayed
                log.warning("usage journal %s: cannot append: %s", self.path, e)

    def take(self) -> tuple[list[JournalEntry], int]:
        """Every entry waiting, to replay in order: this process's, then those only the file holds (other
        replicas'); and how many are this process's. The caller gives the outcome to ``finished``."""
        own, self.entries = self.entries, []
        if not self.path:
            return own, len(own)
        try:
            with self._locked():
                on_file = self._read()
        except OSError as e:
            log.warning("usage journal %s: cannot read: %s", self.path, e)
            on_file = []
        mine = {e.key for e in own}
        return own + [e for e in on_file if e.key not in mine], len(own)

    def finished(self, entries: list[JournalEntry], done: int, own: int) -> None:
        """After a replay of ``take``'s ``entries`` that went through for the first ``done``: this process's
        others wait again (ahead of any added meanwhile), and the file keeps every line but the replayed ones."""
        self.entries = entries[done:own] + self.entries
        if not self.path or not done:
            return
        replayed = {e.key for e in entries[:done]}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with self._locked():
                kept = [e for e in self._read() if e.key not in replayed]
                with open(tmp, "w", encoding="utf-8") as f:
                    f.writelines(e.to_line() + "\n" for e in kept)
                os.replace(tmp, self.path)
        except OSError as e:
            log.warning("usage journal %s: cannot rewrite: %s", self.path, e)
