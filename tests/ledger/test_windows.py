"""Budget windows on the calendar (tokenmill.ledger.windows): named cases in several
zones, across daylight saving, and a property over random instants: a window holds
its instant, starts on its unit's boundary, and the windows tile time."""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from tokenmill.ledger.windows import Duration, window, zone

UTC = ZoneInfo("UTC")
PARIS = ZoneInfo("Europe/Paris")
NEW_YORK = ZoneInfo("America/New_York")


def at(tz: ZoneInfo, *parts: int) -> float:
    year, month, day, *rest = parts
    hour, minute, second = (*rest, 0, 0, 0)[:3]
    return datetime(year, month, day, hour, minute, second, tzinfo=tz).timestamp()


def local(tz: ZoneInfo, seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz).replace(tzinfo=None)


@pytest.mark.parametrize(
    ("duration", "tz", "now", "start", "end"),
    [
        ("30s", UTC, (2026, 3, 4, 10, 0, 45), (2026, 3, 4, 10, 0, 30), (2026, 3, 4, 10, 1, 0)),
        ("30m", UTC, (2026, 3, 4, 10, 44), (2026, 3, 4, 10, 30), (2026, 3, 4, 11, 0)),
        # From midnight every 5 hours; the day's last window is cut at midnight.
        ("5h", UTC, (2026, 3, 4, 22, 0), (2026, 3, 4, 20, 0), (2026, 3, 5, 0, 0)),
        ("24h", PARIS, (2026, 3, 4, 0, 30), (2026, 3, 4, 0, 0), (2026, 3, 5, 0, 0)),
        ("1d", NEW_YORK, (2026, 3, 4, 23, 59), (2026, 3, 4, 0, 0), (2026, 3, 5, 0, 0)),
        # 2026-03-04 is a Wednesday: the week from Monday the 2nd.
        ("7d", UTC, (2026, 3, 4, 12, 0), (2026, 3, 2, 0, 0), (2026, 3, 9, 0, 0)),
        ("1mo", PARIS, (2026, 2, 28, 23, 0), (2026, 2, 1, 0, 0), (2026, 3, 1, 0, 0)),
        ("3mo", UTC, (2026, 5, 15, 0, 0), (2026, 4, 1, 0, 0), (2026, 7, 1, 0, 0)),
        ("12mo", UTC, (2026, 12, 31, 23, 59), (2026, 1, 1, 0, 0), (2027, 1, 1, 0, 0)),
    ],
)
def test_named_windows(
    duration: str,
    tz: ZoneInfo,
    now: tuple[int, ...],
    start: tuple[int, ...],
    end: tuple[int, ...],
) -> None:
    assert window(Duration.parse(duration), tz, at(tz, *now)) == (at(tz, *start), at(tz, *end))


def test_a_day_of_daylight_saving_is_23_or_25_hours_from_midnight_to_midnight() -> None:
    # Paris: clocks go forward on 2026-03-29, back on 2026-10-25.
    for day, hours in ((29, 23), (30, 24)):
        start, end = window(Duration.parse("24h"), PARIS, at(PARIS, 2026, 3, day, 12))
        assert (end - start) / 3600 == hours
        assert local(PARIS, start) == datetime(2026, 3, day)
    start, end = window(Duration.parse("1d"), PARIS, at(PARIS, 2026, 10, 25, 12))
    assert (end - start) / 3600 == 25
    # Hours are elapsed time from local midnight: on the 25-hour day 6h windows start at
    # 0:00, 5:00, 11:00, 17:00 and 23:00 on the wall clock, the last cut at midnight.
    starts = []
    for hour in range(24):
        start, end = window(Duration.parse("6h"), PARIS, at(PARIS, 2026, 10, 25, hour, 30))
        starts.append(local(PARIS, start).hour)
    assert sorted(set(starts)) == [0, 5, 11, 17, 23]
    assert local(PARIS, end) == datetime(2026, 10, 26)


@pytest.mark.parametrize(
    "text", ["", "0s", "30", "1w", "25h", "1441m", "86401s", "367d", "13mo", "1.5h", "-1d"]
)
def test_bad_durations_are_refused_saying_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        Duration.parse(text)


def test_an_unknown_zone_is_refused() -> None:
    with pytest.raises(ValueError, match="time zone"):
        zone("Mars/Olympus_Mons")
    assert zone("Europe/Paris") == PARIS


def test_windows_hold_their_instant_start_on_boundaries_and_tile_time() -> None:
    rng = random.Random(50)
    zones = [UTC, PARIS, NEW_YORK, ZoneInfo("Asia/Kolkata"), ZoneInfo("Australia/Lord_Howe")]
    durations = ["1s", "45s", "30m", "7m", "1h", "5h", "24h", "1d", "3d", "7d", "1mo", "3mo"]
    lo, hi = at(UTC, 2024, 1, 1), at(UTC, 2028, 1, 1)
    for _ in range(3000):
        tz = rng.choice(zones)
        duration = Duration.parse(rng.choice(durations))
        now = rng.uniform(lo, hi)
        start, end = window(duration, tz, now)
        assert start <= now < end
        first = local(tz, start)
        if duration.unit in ("s", "m", "h"):
            midnight = datetime.combine(first.date(), datetime.min.time())
            step = duration.count * {"s": 1, "m": 60, "h": 3600}[duration.unit]
            # Time elapsed since local midnight is a multiple of the step.
            since = start - datetime(*midnight.timetuple()[:3], tzinfo=tz).timestamp()
            assert since % step == 0
        elif duration.unit == "d":
            assert first.time() == datetime.min.time()
            assert (first.date() - datetime(1970, 1, 5).date()).days % duration.count == 0
        else:
            assert (first.day, first.time()) == (1, datetime.min.time())
            assert (first.year * 12 + first.month - 1) % duration.count == 0
        # The next window starts where this one ends; the one before ends where it starts.
        assert window(duration, tz, end)[0] == end
        assert window(duration, tz, start - 1e-3)[1] == start
        assert end - start <= timedelta(days=93).total_seconds()
