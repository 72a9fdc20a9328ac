"""Requests waiting for slots and requests running, in the llama.cpp engine.

A request is admitted whole, first come first served: all of its choices get a slot
in the same round, or it waits, and nothing behind it overtakes it. Plain Python,
unit-tested without a model; the decode loop holds its lock around every call.
"""

from __future__ import annotations

import collections

from tokenmill.engines.llamacpp.choices import Choice, Group

__all__ = ["RequestQueue", "pool_cells"]


def pool_cells(group: Group) -> int:
    """KV cells a request takes once its prompts are in: every choice's prompt and
    the first token it samples."""
    return sum(len(seq.prompt) + 1 for seq in group.members)


class RequestQueue:
    """The queue of requests (``Group``) and those admitted from it, by request id."""

    def __init__(self) -> None:
        self._queued: collections.deque[Group] = collections.deque()
        self._admitted: dict[str, Group] = {}

    @property
    def waiting(self) -> int:
        """Requests queued."""
        return len(self._queued)

    def push(self, group: Group) -> None:
        self._queued.append(group)

    def admit(self, free: int, *, now: float, cells: int | None = None) -> list[Choice]:
        """The choices of the requests at the head of the queue that ``free`` slots
        hold whole; each admitted request is marked ``now``. ``cells``: KV cells the
        requests may take (a shared pool), which each one's prompts, a cell a choice
        more, must fit; the first always does when nothing runs."""
        admitted: list[Choice] = []
        while self._queued and free >= len(self._queued[0].members):
            if cells is not None:
                need = pool_cells(self._queued[0])
                if need > cells and (admitted or self._admitted):
                    break
                cells -= need
            group = self._queued.popleft()
            group.marks.append(now)
            self._admitted[group.request_id] = group
            admitted.extend(group.members)
            free -= len(group.members)
        return admitted

    def running(self, request_id: str) -> Group | None:
        """The admitted request ``request_id``, if it still runs."""
        return self._admitted.get(request_id)

    def finished(self, request_id: str) -> None:
        """The request's last choice ended."""
        self._admitted.pop(request_id, None)

    def withdraw(self, request_id: str) -> Group | None:
        """Take request ``request_id`` out of the queue (cancelled before it ran); its
        choices are done. None if it is not queued."""
        for group in self._queued:
            if group.request_id == request_id:
                self._queued.remove(group)
                for seq in group.members:
                    seq.done = True
                group.open = 0
                return group
        return None

    def pending(self) -> list[Choice]:
        """A choice of every request running or queued (one each: an error ends all
        of a request's choices)."""
        groups = [*self._admitted.values(), *self._queued]
        return [g.members[0] for g in groups if g.open > 0]

    def clear_queued(self) -> None:
        self._queued.clear()

    def clear(self) -> None:
        self._queued.clear()
        self._admitted.clear()
