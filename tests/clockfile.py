"""A clock a test sets for the gateways it starts (``TOKENMILL_LEDGER_CLOCK_FILE``).

The ledger of a server started with :attr:`ClockFile.env` reads the time from the
file instead of the wall clock: rate windows, budget windows, timestamps and
heartbeats all stand still until the test moves them, so a test steps across a
window's end instead of waiting for it (or racing it).
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenmill.ledger.database import CLOCK_FILE_ENV


class ClockFile:
    def __init__(self, path: Path, now: float) -> None:
        self.path = path
        self.set(now)

    @property
    def now(self) -> float:
        return float(self.path.read_text())

    @property
    def env(self) -> dict[str, str]:
        return {CLOCK_FILE_ENV: str(self.path)}

    def set(self, now: float) -> None:
        # Replaced whole: a server reading it meanwhile sees the old time or the new.
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(repr(now))
        os.replace(tmp, self.path)

    def advance(self, seconds: float) -> None:
        self.set(self.now + seconds)
