"""Structured request logs and secret redaction.

``RequestLog`` writes one JSON object per finished request (one line) to its
own logger ``tandem.requests`` (not propagated, so the line stays pure JSON):
``ts``, ``request_id``, ``trace_id``, ``endpoint`` (the client API's path
after ``/v1/``: ``chat/completions``, ``completions``, ``embeddings``,
``responses``, ``messages``), ``tenant``, ``model``, ``route``, ``rule``,
``backend``, ``status``, ``attempts``, ``stream``,
``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
``usage_estimated``, ``ttft_s``, ``latency_s``, ``cost_usd``, ``error``
and, only with ``observability.logs.include_prompts``, ``prompt`` and
``completion``.

``Redactor`` removes secrets from text and bytes: the exact values of every
secret the config names (upstream API keys, virtual keys given by env var,
the admin token) and, by pattern, anything after ``Bearer`` and
``sk-``-style keys. ``RedactingFilter`` applies it to every record of the
process's log handlers, so a secret echoed back by an upstream never reaches a
log line; the request path applies it to error bodies before they reach a
client.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Iterable

import msgspec

MASK = "[REDACTED]"
_PATTERNS = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{4,}|\bsk-[A-Za-z0-9_-]{8,}")
_PATTERNS_B = re.compile(rb"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{4,}|\bsk-[A-Za-z0-9_-]{8,}")


# In an upstream's error, a run of half a secret's characters (at least this many) is masked too: an upstream may
# echo part of its key (a security trial's echoed all but its first 3 characters). Shorter runs are not: a key
# may hold words ("sk-tandem-responses-..." and an error's "response_format").
FRAGMENT_CHARS = 12


def _without_fragments(s, secret, mask):
    """``s`` (str or bytes, as ``secret`` and ``mask``) with every run of half of ``secret``'s characters or more
    (at least ``FRAGMENT_CHARS``) replaced by ``mask``."""
    n = len(secret)
    k = max(FRAGMENT_CHARS, n // 2)
    if n <= k:
        return s
    spans = []
    for j in range(n - k + 1):
        p = s.find(secret[j:j + k])
        while p != -1:
            a, b, e, f = p, j, p + k, j + k        # grow the run to the left and right while it follows the secret
            while a > 0 and b > 0 and s[a - 1:a] == secret[b - 1:b]:
                a, b = a - 1, b - 1
            while e < len(s) and f < n and s[e:e + 1] == secret[f:f + 1]:
                e, f = e + 1, f + 1
            spans.append((a, e))
            p = s.find(secret[j:j + k], p + 1)
    if not spans:
        return s
    out, at = [], 0
    for a, e in sorted(spans):
        if e > at:
            out += [s[at:max(a, at)], mask] if a >= at else []
            at = e
    return s[:0].join(out) + s[at:]


def _sub(m: re.Match) -> str:
    return (m.group(1) or "") + MASK


def _sub_b(m: re.Match) -> bytes:
    return (m.group(1) or b"") + MASK.encode()


class Redactor:
    """Replaces known secret values (and bearer / ``sk-`` patterns) with ``[REDACTED]``.

    Args:
        secrets: exact secret strings; values shorter than 4 characters are
            ignored (they would mask ordinary text).
    """

    def __init__(self, secrets: Iterable[str] = ()):
        self.secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)
        self._secrets_b = [s.encode() for s in self.secrets]

    def text(self, s: str, extra: Iterable[str] = (), fragments: bool = False) -> str:
        """``s`` without secrets (``extra``: per-request secrets, e.g. the client's key; ``fragments``: runs of half
        a secret's characters too, ``_without_fragments``, for an upstream's error)."""
        for secret in (*self.secrets, *extra):
            if secret and len(secret) >= 4 and secret in s:
                s = s.replace(secret, MASK)
            if fragments and secret:
                s = _without_fragments(s, secret, MASK)
        low = s.lower()
        if "bearer" not in low and "sk-" not in low:      # the regex costs ~15 us on a log line; this ~1 us
            return s
        return _PATTERNS.sub(_sub, s)

    def bytes(self, b: bytes, extra: Iterable[str] = (), fragments: bool = False) -> bytes:
        """``b`` without secrets (same rules as ``text``)."""
        for secret in (*self._secrets_b, *(e.encode() for e in extra if e)):
            if len(secret) >= 4 and secret in b:
                b = b.replace(secret, MASK.encode())
            if fragments:
                b = _without_fragments(b, secret, MASK.encode())
        low = b.lower()
        if b"bearer" not in low and b"sk-" not in low:
            return b
        return _PATTERNS_B.sub(_sub_b, b)


def config_secrets(config, environ=None) -> list[str]:
    """The secret values a gateway config refers to (by environment variable):
    upstream API keys, virtual keys given by ``env``, the admin token."""
    env = os.environ if environ is None else environ
    names = [config.admin.token_env]
    names += [b.api_key_env for b in config.backends.values() if getattr(b, "api_key_env", None)]
    names += [k.env for k in config.auth.keys if k.env]
    return [env[n] for n in names if env.get(n)]


class RedactingFilter(logging.Filter):
    """A handler filter that redacts every record's formatted message (and
    exception text) with ``redactor_fn()`` (a callable: the config can change)."""

    def __init__(self, redactor_fn):
        super().__init__("tandem-redact")
        self.redactor_fn = redactor_fn

    def filter(self, record: logging.LogRecord) -> bool:
        red = self.redactor_fn()
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 -- a bad format string: leave it to the formatter
            return True
        clean = red.text(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = red.text(record.exc_text)
        return True


def install_redaction(redactor_fn, logger: logging.Logger | None = None) -> list:
    """Add a ``RedactingFilter`` to the handlers of ``logger`` (default: the
    root logger). Returns what to pass to ``remove_redaction``."""
    logger = logger or logging.getLogger()
    added = []
    for h in logger.handlers:
        if not any(isinstance(f, RedactingFilter) for f in h.filters):
            f = RedactingFilter(redactor_fn)
            h.addFilter(f)
            added.append((h, f))
    return added


def remove_redaction(added: list[tuple[logging.Handler, logging.Filter]]) -> None:
    for h, f in added:
        h.removeFilter(f)


class RequestLog:
    """One JSON line per request on logger ``tandem.requests``.

    Args:
        destination: "stderr", "stdout" or a file path (appended).
        enabled: False = write nothing.
    """

    def __init__(self, destination: str = "stderr", enabled: bool = True):
        self.enabled = enabled
        self.destination = destination
        self.logger = logging.getLogger("tandem.requests")
        self._handler: logging.StreamHandler | None = None
        self._formatter = logging.Formatter("%(message)s")
        self._encode = msgspec.json.Encoder().encode

    @property
    def active(self) -> bool:
        """True once opened (and enabled): ``write`` writes."""
        return self._handler is not None

    def open(self) -> None:
        """Attach this log's handler (the app's startup; ``close`` detaches it)."""
        if not self.enabled or self._handler is not None:
            return
        self.logger.propagate = False
        self.logger.setLevel(logging.INFO)
        if self.destination == "stdout":
            h: logging.Handler = logging.StreamHandler(sys.stdout)
        elif self.destination == "stderr":
            h = logging.StreamHandler(sys.stderr)
        else:
            h = logging.FileHandler(self.destination, encoding="utf-8")
        h.setFormatter(self._formatter)
        self.logger.addHandler(h)
        self._handler = h

    def write(self, fields: dict, redactor: Redactor, extra_secrets: Iterable[str] = ()) -> str | None:
        """Log ``fields`` (plus ``ts``, epoch seconds) as one JSON line,
        redacted; returns the line (None when disabled)."""
        if self._handler is None:
            return None
        line = self._encode({"ts": round(time.time(), 6), **fields}).decode()
        line = redactor.text(line, extra_secrets)
        self._emit(line)
        return line

    def _emit(self, line: str) -> None:
        """``self.logger.info(line)``: while this log's handler is the logger's only one and no filter is set,
        the line is written as that handler would write it (``StreamHandler.emit``: the line and its terminator,
        then a flush, under the handler's lock; the formatter is ``%(message)s``, the message ``line`` itself),
        without the ``LogRecord`` (caller lookup, record, format: ~2/3 of the line's cost); otherwise (handlers
        or filters added to ``tandem.requests``, another formatter, the logger disabled) through ``logging``."""
        h, logger = self._handler, self.logger
        if logger.handlers != [h] or logger.filters or h.filters or h.formatter is not self._formatter \
                or h.level > logging.INFO or h.stream is None or not logger.isEnabledFor(logging.INFO):
            logger.info(line)
            return
        h.acquire()
        try:
            stream = h.stream
            stream.write(line + h.terminator)
            stream.flush()
        except Exception:  # noqa: BLE001 -- what Handler.emit does with a failed write (logging.raiseExceptions)
            h.handleError(logger.makeRecord(logger.name, logging.INFO, "", 0, line, None, None))
        finally:
            h.release()

    def close(self) -> None:
        if self._handler is not None:
            self.logger.removeHandler(self._handler)
            self._handler.close()
            self._handler = None
