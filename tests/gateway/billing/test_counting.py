"""``lacks_usage``: whether a whole answer the client is about to get carries no ``usage`` (the gateway then fills
in the ledger's count), read by byte searches on every whole answer; checked against the answer decoded."""

from __future__ import annotations

import json

import pytest

from gateway.billing.counting import lacks_usage

ANSWERS = [
    {"choices": [{"message": {"content": "hi"}}]},
    {"choices": [{"message": {"content": "hi"}}], "usage": None},
    {"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
    {"choices": [{"text": "usage"}]},                                  # the word as a value, not a key
    {"choices": [{"text": '"usage": 7'}], "usage": None},             # a key-like text inside a string
    {"choices": [{"text": '"usage":{"x": 1}'}]},
]


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("dumps", [lambda o: json.dumps(o).encode(),
                                   lambda o: json.dumps(o, separators=(",", ":")).encode()])
def test_lacks_usage_reads_the_bytes_as_the_decoded_answer_says(answer, dumps):
    assert lacks_usage(dumps(answer)) == (not isinstance(answer.get("usage"), dict))


def test_a_report_since_an_iso_datetime_starts_on_its_utc_day():
    """Usage is kept per UTC day: a datetime names its UTC day (a FinOps trial's ``2026-12-08T00:00:00+05:00``, 19:00
    UTC on Dec 7, was read as Dec 8, the offset dropped)."""
    import datetime as dt

    from gateway.billing.periods import parse_since

    now = dt.datetime(2026, 12, 8, 12, tzinfo=dt.timezone.utc).timestamp()
    assert parse_since("2026-12-08T00:00:00+05:00", now) == dt.date(2026, 12, 7)
    assert parse_since("2026-12-07T23:20:00Z", now) == parse_since("2026-12-07", now) == dt.date(2026, 12, 7)
    assert parse_since("1d", now) == dt.date(2026, 12, 7) and parse_since(None, now) == dt.date(2026, 12, 8)
    with pytest.raises(ValueError, match="whole UTC days"):
        parse_since("yesterday", now)
