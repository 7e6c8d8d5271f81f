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
