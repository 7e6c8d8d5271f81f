"""The usage journal's file (``budgets.journal_path``): what a replica settled during a Redis outage survives the
replica itself, and reaches Redis once, from whichever process replays it. Real Redis, paused with SIGSTOP."""

from __future__ import annotations

import signal

from gateway.billing.journal import Journal, JournalEntry
from gateway.billing.usage import UsageLedger, UsageRecord
from gateway.config.schema import StateSettings
from gateway.state import SharedState


def test_journal_file_keeps_entries_and_skips_a_torn_line(tmp_path):
    path = str(tmp_path / "journal.jsonl")
    j = Journal(path)
    j.append(JournalEntry("r1", ["k"], [1, "a"], 5))
    j.append(JournalEntry("r2", ["k"], ["r2"], 0, "release"))
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"rid": "r3", "keys": [')                 # a crash mid-write
    again = Journal(path)
    assert [(e.request_id, e.script, e.nusd) for e in again.entries] == [("r1", "settle", 5), ("r2", "release", 0)]
    again.take()
    again.compact()
    assert Journal(path).entries == []


async def test_settles_of_a_replica_that_died_during_an_outage_are_replayed_by_its_successor(redis_server, tmp_path):
    path = str(tmp_path / "journal.jsonl")
    settings = StateSettings(redis_url=redis_server.url, socket_timeout_s=0.3, reconnect_min_s=0.05)
    first, second = SharedState(settings), SharedState(settings)
    try:
        ledger = UsageLedger(first, journal=Journal(path))
        assert await first.ping()
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            for i in range(3):
                assert await ledger.settle(UsageRecord(f"r{i}", "t1", "up", 10, 20, 0, 1000 + i))
            assert first.degraded and len(ledger.journal) == 3
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        await first.close()                             # the replica dies before it rejoins
        successor = UsageLedger(second, journal=Journal(path))
        assert len(successor.journal) == 3
        assert await successor.replay() == 3 and await successor.replay() == 0
        assert Journal(path).entries == []              # the file is compacted once replayed
        recs = await successor.records("t1")
        assert sorted(recs) == ["r0", "r1", "r2"] and sum(r.nusd for r in recs.values()) == 3003
        assert (await successor.report("t1"))["requests"] == 3
    finally:
        await second.close()
