"""A shared replica's own count of its slots: who holds each, across every gateway.

A replica of a pool (:mod:`tokenmill.replicas.shared`) serves several gateways at once,
each admitting against its own view. The replica alone knows how many of its slots
are taken, so it alone says yes or no: a gateway's ``prepare`` *reserves* a request's
slots (one per choice), its ``generate`` turns the reservation into a running
request, and the request's final chunk frees them. A reservation that no ``generate``
follows (the gateway refused the request afterwards, say for credit) is dropped by
the gateway's ``abort``, by its connection closing, or, as a last resort, after
``hold_s``. The book never lets the slots taken exceed ``slots``.

Pure bookkeeping: no I/O, no clock of its own (``now`` is passed in), no lock (its
owner holds one when the decode thread frees slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# A reservation lives this long without its generate: far longer than a credit hold
# takes on a loaded database, short enough that a lost one does not hold a slot for good.
RESERVATION_S = 60.0

Booked = Literal["ok", "full", "duplicate"]


@dataclass(slots=True)
class _Entry:
    owner: int  # the connection (gateway) that holds it
    weight: int  # slots: one per choice
    since: float
    running: bool = False


class SlotBook:
    """Slots of one replica, by request id. See the module docstring."""

    def __init__(self, slots: int, hold_s: float = RESERVATION_S) -> None:
        if slots < 1:
            raise ValueError("a replica has at least one slot")
        self.slots = slots
        self.hold_s = hold_s
        self.taken = 0
        self._entries: dict[str, _Entry] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._entries

    def owner(self, rid: str) -> int | None:
        entry = self._entries.get(rid)
        return None if entry is None else entry.owner

    def running(self, rid: str) -> bool:
        entry = self._entries.get(rid)
        return entry is not None and entry.running

    def reserve(self, owner: int, rid: str, weight: int, now: float) -> Booked:
        """Hold ``weight`` slots for ``rid`` until its :meth:`start`: ``"ok"``, ``"full"``
        (nothing is held), or ``"duplicate"`` (the id is already held here)."""
        if rid in self._entries:
            return "duplicate"
        if self.taken + weight > self.slots:
            self.expire(now)
            if self.taken + weight > self.slots:
                return "full"
        self._entries[rid] = _Entry(owner, weight, now)
        self.taken += weight
        return "ok"

    def start(self, owner: int, rid: str, weight: int, now: float) -> Booked:
        """``rid`` begins generating: its reservation (``owner``'s) runs, or, without
        one (it expired), slots are taken now if they are free."""
        entry = self._entries.get(rid)
        if entry is None:
            booked = self.reserve(owner, rid, weight, now)
            if booked != "ok":
                return booked
            entry = self._entries[rid]
        elif entry.owner != owner or entry.running:
            return "duplicate"
        entry.running = True
        return "ok"

    def end(self, rid: str) -> int | None:
        """``rid`` is over (its final chunk, or its reservation dropped): its slots are
        free. Its owner, or None when it held none."""
        entry = self._entries.pop(rid, None)
        if entry is None:
            return None
        self.taken -= entry.weight
        return entry.owner

    def held_by(self, owner: int) -> tuple[list[str], list[str]]:
        """``owner``'s requests: (reserved only, running)."""
        reserved = [rid for rid, e in self._entries.items() if e.owner == owner and not e.running]
        running = [rid for rid, e in self._entries.items() if e.owner == owner and e.running]
        return reserved, running

    def expire(self, now: float) -> list[str]:
        """Drop reservations older than ``hold_s`` that never started; their ids."""
        old = [
            rid for rid, e in self._entries.items() if not e.running and now - e.since > self.hold_s
        ]
        for rid in old:
            self.end(rid)
        return old


__all__ = ["RESERVATION_S", "Booked", "SlotBook"]
