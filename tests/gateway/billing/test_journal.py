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
    entries, own = again.take()
    again.finished(entries, len(entries), own)
    assert Journal(path).entries == []


def test_replicas_sharing_the_file_keep_each_others_lines(tmp_path):
    """Two replicas on one journal file (the config is one for all): a replay takes the other's lines too and drops
    only those replayed; one that went through before Redis left again keeps the rest (a trial: a replica's
    compaction rewrote the file with its own entries, erasing the other's 4 settles)."""
    path = str(tmp_path / "journal.jsonl")
    a, b = Journal(path), Journal(path)
    a.append(JournalEntry("a1", ["k"], [1], 5))
    b.append(JournalEntry("b1", ["k"], [1], 6))
    a.append(JournalEntry("a2", ["k"], [1], 7))
    b.append(JournalEntry("b2", ["k"], [1], 8))
    entries, own = a.take()
    assert [e.request_id for e in entries] == ["a1", "a2", "b1", "b2"] and own == 2
    a.finished(entries, 3, own)                     # Redis went away after a1, a2, b1
    assert [e.request_id for e in Journal(path).entries] == ["b2"] and len(a) == 0
    b.append(JournalEntry("b3", ["k"], [1], 9))
    entries, own = b.take()                         # its own (b1 again: replayed twice counts once), then the file's
    assert [e.request_id for e in entries] == ["b1", "b2", "b3"] and own == 3
    b.finished(entries, 1, own)
    assert [e.request_id for e in b.entries] == ["b2", "b3"]
    assert [e.request_id for e in Journal(path).entries] == ["b2", "b3"]


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


async def test_two_replicas_on_one_file_bill_every_answer_when_one_dies(redis_server, tmp_path):
    """The trial's run: both replicas settle during an outage, one dies before Redis answers again, the other
    rejoins and replays; every settle is billed once, and the dead one's successor finds nothing left."""
    path = str(tmp_path / "journal.jsonl")
    settings = StateSettings(redis_url=redis_server.url, socket_timeout_s=0.3, reconnect_min_s=0.05)
    a_state, b_state, c_state = SharedState(settings), SharedState(settings), SharedState(settings)
    try:
        a, b = UsageLedger(a_state, journal=Journal(path)), UsageLedger(b_state, journal=Journal(path))
        assert await a_state.ping() and await b_state.ping()
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            for i in range(4):
                assert await a.settle(UsageRecord(f"a{i}", "t1", "up", 10, 20, 0, 1000))
                assert await b.settle(UsageRecord(f"b{i}", "t1", "up", 10, 20, 0, 1000))
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        await b_state.close()                           # replica b dies before it rejoins
        assert await a.replay() == 8
        successor = UsageLedger(c_state, journal=Journal(path))
        assert len(successor.journal) == 0 and await successor.replay() == 0
        recs = await successor.records("t1")
        assert len(recs) == 8 and sum(r.nusd for r in recs.values()) == 8000
    finally:
        await a_state.close()
        await c_state.close()
