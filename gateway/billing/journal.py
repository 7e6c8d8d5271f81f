"""The local journal of usage settled (and budget reservations released) while Redis was unreachable: each entry
is a ledger script's name, keys and arguments (``gateway/billing/usage.py``), kept in process and, with
``budgets.journal_path``, appended to a file (one JSON line each, flushed) so that a replica restarted during an
outage still has them. On rejoin (and at
start) the ledger replays every entry through the same script; the script records the request id first
(``HSETNX``), so an entry replayed twice, or one whose late script already ran when Redis woke, counts once.
"""

from __future__ import annotations

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
        self.entries: list[JournalEntry] = []
        if path and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            self.entries.append(JournalEntry.from_line(line))
                        except (ValueError, KeyError, TypeError):   # a torn last line of a crash: skipped, said
                            log.warning("usage journal %s line %d unreadable: skipped", path, n)

    def __len__(self) -> int:
        return len(self.entries)

    def append(self, entry: JournalEntry) -> None:
        """Keep ``entry`` (and write it to the file, flushed, when there is one)."""
        self.entries.append(entry)
        if self.path:
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(entry.to_line() + "\n")
            except OSError as e:          # the in-process copy is still replayed
                log.warning("usage journal %s: cannot append: %s", self.path, e)

    def take(self) -> list[JournalEntry]:
        """The entries kept so far (the caller replays them and gives back those it could not: ``put_back``)."""
        out, self.entries = self.entries, []
        return out

    def put_back(self, entries: list[JournalEntry]) -> None:
        """Entries not replayed (Redis went away again), ahead of any added meanwhile; rewrites the file."""
        self.entries = entries + self.entries
        self._rewrite()

    def _rewrite(self) -> None:
        if not self.path:
            return
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(e.to_line() + "\n" for e in self.entries)
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("usage journal %s: cannot rewrite: %s", self.path, e)

    def compact(self) -> None:
        """Write the file anew with only the entries still waiting (after a replay)."""
        self._rewrite()
