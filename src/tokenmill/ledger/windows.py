"""Budget windows on the calendar: a duration (``30s``, ``30m``, ``24h``, ``7d``,
``1mo``) cuts time into windows that start on calendar boundaries in a time zone.

- seconds, minutes, hours (at most a day): from local midnight, every ``N`` units of
  elapsed time; the day's last window ends at the next midnight (``5h``: 0:00, 5:00 ...
  20:00-24:00);
- days: runs of ``N`` local days counted from a Monday, so ``1d`` is each day and
  ``7d`` each ISO week (Monday to Monday);
- months: runs of ``N`` months from January, starting on the 1st at local midnight:
  ``1mo`` each month, ``3mo`` each quarter, ``12mo`` each year.

A local day may last 23 or 25 hours (daylight saving): boundaries are local times,
so a daily window always starts at midnight. Pure: no database, no clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

_DURATION = re.compile(r"^([1-9][0-9]{0,3})(s|m|h|d|mo)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
DAY_S = 86_400
# The Monday that day windows count from: 7d windows are ISO weeks.
_MONDAY = date(1970, 1, 5)
MAX_DAYS = 366
MAX_MONTHS = 12
DURATION_HELP = (
    "a number and a unit: s, m or h (at most a day: 30s, 30m, 24h), d (7d: weeks from "
    f"Monday; at most {MAX_DAYS}d) or mo (1mo: months; at most {MAX_MONTHS}mo)"
)


@dataclass(frozen=True, slots=True)
class Duration:
    count: int
    unit: str  # s, m, h, d or mo

    @classmethod
    def parse(cls, text: str) -> Duration:
        """``text`` as a window's duration; ValueError saying what is accepted."""
        match = _DURATION.match(text)
        if match is None:
            raise ValueError(f"duration {text!r}: use {DURATION_HELP}")
        duration = cls(int(match[1]), match[2])
        if duration.unit in _UNIT_S and duration.count * _UNIT_S[duration.unit] > DAY_S:
            raise ValueError(f"duration {text!r}: at most a day in s, m or h; use d for more")
        if duration.unit == "d" and duration.count > MAX_DAYS:
            raise ValueError(f"duration {text!r}: at most {MAX_DAYS}d; use mo for more")
        if duration.unit == "mo" and duration.count > MAX_MONTHS:
            raise ValueError(f"duration {text!r}: at most {MAX_MONTHS}mo")
        return duration

    def __str__(self) -> str:
        return f"{self.count}{self.unit}"

    @property
    def nominal_s(self) -> int:
        """About how long a window lasts (a month as 31 days): to order windows."""
        unit_s = {**_UNIT_S, "d": DAY_S, "mo": 31 * DAY_S}[self.unit]
        return self.count * unit_s


def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name`` (``UTC``, ``Europe/Paris``); ValueError if unknown."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r}: use an IANA name such as 'UTC'") from None


def _midnight(day: date, tz: ZoneInfo) -> float:
    return datetime(day.year, day.month, day.day, tzinfo=tz).timestamp()


def _month_start(index: int, tz: ZoneInfo) -> float:
    """Local midnight of the 1st of month ``index`` (year * 12 + month - 1)."""
    return datetime(index // 12, index % 12 + 1, 1, tzinfo=tz).timestamp()


def window(duration: Duration, tz: ZoneInfo, now: float) -> tuple[float, float]:
    """The window of ``duration`` in ``tz`` that ``now`` falls in: (start, end), seconds
    since the epoch, start <= now < end."""
    today = datetime.fromtimestamp(now, tz).date()
    if duration.unit in _UNIT_S:
        midnight = _midnight(today, tz)
        step = duration.count * _UNIT_S[duration.unit]
        start = midnight + (now - midnight) // step * step
        return start, min(start + step, _midnight(today + timedelta(days=1), tz))
    if duration.unit == "d":
        first = today - timedelta(days=(today - _MONDAY).days % duration.count)
        return _midnight(first, tz), _midnight(first + timedelta(days=duration.count), tz)
    month = today.year * 12 + today.month - 1
    first_month = month - month % duration.count
    return _month_start(first_month, tz), _month_start(first_month + duration.count, tz)
