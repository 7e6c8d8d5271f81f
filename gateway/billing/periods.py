"""UTC calendar arithmetic of the usage ledger: the day a usage record counts on, a budget's period id and
when it ends, and the days a report covers. Kept apart from ``usage.py`` so the ledger reads as Redis/in-process
accounting only."""

from __future__ import annotations

import datetime as _dt
import functools
import time

USAGE_TTL_S = 400 * 86400          # usage hashes live 400 days


@functools.lru_cache(maxsize=8)
def utc_day(day_number: int) -> str:
    """``YYYYMMDD`` of the UTC day ``day_number`` (days since the epoch)."""
    return (_dt.date(1970, 1, 1) + _dt.timedelta(days=day_number)).strftime("%Y%m%d")


def period_id(period: str, now_s: float | None = None) -> str:
    """``d<YYYYMMDD>`` or ``m<YYYYMM>`` (UTC) of ``now_s`` (epoch seconds).

    Raises:
        ValueError: period not "day" or "month"."""
    t = _dt.datetime.fromtimestamp(time.time() if now_s is None else now_s, _dt.timezone.utc)
    if period == "day":
        return t.strftime("d%Y%m%d")
    if period == "month":
        return t.strftime("m%Y%m")
    raise ValueError(f"period must be day or month, got {period!r}")


def period_end_s(period: str, now_s: float) -> float:
    """Epoch seconds when the period containing ``now_s`` ends (UTC)."""
    t = _dt.datetime.fromtimestamp(now_s, _dt.timezone.utc)
    if period == "day":
        start = _dt.datetime(t.year, t.month, t.day, tzinfo=_dt.timezone.utc)
        return (start + _dt.timedelta(days=1)).timestamp()
    y, m = (t.year + 1, 1) if t.month == 12 else (t.year, t.month + 1)
    return _dt.datetime(y, m, 1, tzinfo=_dt.timezone.utc).timestamp()


def parse_since(since: str | None, now_s: float | None = None) -> _dt.date:
    """The first UTC day of a report: ``YYYY-MM-DD``, an ISO datetime (its UTC day: usage is kept per UTC day, so a
    report counts whole days; a FinOps trial's ``...T00:00:00+05:00`` was read as the next day), ``Nd`` (N days back,
    ``0d`` = today), or None (today).

    Raises:
        ValueError: anything else."""
    now = _dt.datetime.fromtimestamp(time.time() if now_s is None else now_s, _dt.timezone.utc)
    if not since:
        return now.date()
    s = since.strip()
    if s.endswith("d") and s[:-1].isdigit():   # further back than the calendar goes: its first day
        return now.date() - _dt.timedelta(days=min(int(s[:-1]), (now.date() - _dt.date.min).days))
    try:
        at = _dt.datetime.fromisoformat(s)
    except ValueError:
        raise ValueError(f"since must be YYYY-MM-DD, an ISO datetime (its UTC day: usage is counted in whole UTC "
                         f"days) or Nd (days back), got {since!r}") from None
    return at.astimezone(_dt.timezone.utc).date() if at.tzinfo is not None else at.date()


def days_since(since: _dt.date, now_s: float) -> list[str]:
    """The ``YYYYMMDD`` UTC days from ``since`` through today, no further back than usage hashes live."""
    today = _dt.datetime.fromtimestamp(now_s, _dt.timezone.utc).date()
    start = max(since, today - _dt.timedelta(days=USAGE_TTL_S // 86400))
    n = (today - start).days
    return [(start + _dt.timedelta(days=i)).strftime("%Y%m%d") for i in range(n + 1)] if n >= 0 else []
