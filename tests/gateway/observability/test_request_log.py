"""The request log's line: written straight to its handler's stream (no ``LogRecord``) while nothing else listens
on ``tandem.requests``, and through ``logging`` otherwise; both write the same bytes."""

from __future__ import annotations

import io
import json
import logging

from gateway.observability.request_log import Redactor, RequestLog

FIELDS = {"event": "request", "request_id": "gw-1", "tenant": "t", "status": 200, "latency_s": 0.001234,
          "error": "upstream said: 100% wrong, Bearer abcdefgh and s3cr3t-value", "prompt": ["é", "\n"]}


class _Passing(logging.Filter):
    """A filter that keeps every record: its presence alone sends the line through ``logging``."""


def _write(path, via_logging: bool) -> str:
    log = RequestLog(str(path))
    log.open()
    try:
        if via_logging:
            log.logger.addFilter(_Passing())
        line = log.write(FIELDS, Redactor(["s3cr3t-value"]), ["client-key-123"])
    finally:
        for f in list(log.logger.filters):
            log.logger.removeFilter(f)
        log.close()
    return line


def test_direct_and_logging_paths_write_the_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr("time.time", lambda: 1765000000.123456)
    direct, through = tmp_path / "direct.log", tmp_path / "logging.log"
    line = _write(direct, via_logging=False)
    assert _write(through, via_logging=True) == line
    assert direct.read_bytes() == through.read_bytes() == (line + "\n").encode()
    rec = json.loads(line)
    assert rec["ts"] == 1765000000.123456 and rec["prompt"] == ["é", "\n"]
    assert "s3cr3t-value" not in line and "abcdefgh" not in line and "100% wrong" in line


def test_a_handler_added_to_the_logger_gets_the_line_too(tmp_path):
    log = RequestLog(str(tmp_path / "r.log"))
    log.open()
    extra = logging.StreamHandler(io.StringIO())
    log.logger.addHandler(extra)
    try:
        line = log.write({"event": "request", "status": 200}, Redactor())
    finally:
        log.logger.removeHandler(extra)
        log.close()
    assert extra.stream.getvalue() == line + "\n"
    assert (tmp_path / "r.log").read_text() == line + "\n"


def test_a_disabled_logger_writes_nothing(tmp_path):
    log = RequestLog(str(tmp_path / "r.log"))
    log.open()
    log.logger.disabled = True
    try:
        log.write({"event": "request"}, Redactor())
    finally:
        log.logger.disabled = False
        log.close()
    assert (tmp_path / "r.log").read_text() == ""
