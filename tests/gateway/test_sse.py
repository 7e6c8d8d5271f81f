"""The SSE codec (gateway/sse.py) against the WHATWG spec's reading of a stream, byte split by byte split."""

from __future__ import annotations

import pytest

from gateway.sse import EventReader, event

STREAM = (b": keep-alive\r\n\r\n"                       # a comment-only block: no event
          b"event: message\r\nid: 7\r\ndata: {\"a\":\r\ndata:  1}\r\n\r\n"   # CRLF, two data lines, other fields
          b"data\n\n"                                     # a field name alone: one empty data line
          b"data: [DONE]\n\n")


def read_all(raw: bytes, step: int) -> list[bytes]:
    r, out = EventReader(), []
    for i in range(0, len(raw), step):
        r.feed(raw[i:i + step])
        while (item := r.pop()) is not None:
            out.append(item)
    if (item := r.tail()) is not None:
        out.append(item)
    return out


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_events_as_the_spec_reads_them(step):
    events = read_all(STREAM, step)
    assert [data for _, data in events] == [b'{"a":\n 1}', b"", b"[DONE]"]
    # relayed as valid events: a reader of the relayed bytes gets the same data
    assert [data for _, data in read_all(b"".join(raw for raw, _ in events), 1)] == [b'{"a":\n 1}', b"",
                                                                                      b"[DONE]"]


def test_multi_line_payload_is_written_as_one_data_line_per_line():
    assert event(b"x\ny") == b"data: x\ndata: y\n\n"
    assert event(b'{"a":1}') == b'data: {"a":1}\n\n'
