"""What every KV slot's cells hold: the one record of it, and the one place it changes.

Each slot of the llama.cpp engine is a llama.cpp sequence with its own KV stream. The
tokens a request leaves in its slot's cells stay there after it ends, as a prefix
cache (see :mod:`tokenmill.engines.llamacpp.slots`, which places requests by it).
:class:`SlotCache` records, for every slot, exactly which token sequence its cells
hold, position 0 on; the engine changes the record only through its methods, right
after (or, for a decode, right before) it changes the cells themselves.

Read API: :meth:`SlotCache.tokens` (one slot's sequence), :meth:`SlotCache.contents`
(every slot's), :meth:`SlotCache.used_tokens` and :meth:`SlotCache.free_slots`.

Every change of a slot's sequence is reported to the listeners registered with
:meth:`SlotCache.subscribe`, as a :class:`SlotChange` (what stayed, what follows it):
tokens stored by a placement or a copy, extended by a decode, cut by an eviction.
That is the hook for publishing the cache's contents (hashed token blocks for
cache-aware routing); listeners run on the decode thread, so they must be quick and
must not call back into the engine.

The next-turn warm-up (see :class:`WarmUp`) is planned here too: it is about what a
free slot will hold. Plain Python, no llama.cpp: unit-tested without a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tokenmill.engines.llamacpp.slots import Placement, Slot, apply_placement, common_prefix

__all__ = ["SlotCache", "SlotChange", "SlotListener", "WarmUp"]

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class SlotChange:
    """Slot ``slot`` now holds its first ``kept`` tokens as before, then ``added``.

    A decode that extends the slot has ``kept`` = the old length; a placement or copy
    that overwrites it keeps the prefix it shares with what was there; an eviction
    has ``added`` empty and ``kept`` = the new, shorter length.
    """

    slot: int
    kept: int
    added: tuple[int, ...]

    @property
    def length(self) -> int:
        """How many tokens the slot holds after the change."""
        return self.kept + len(self.added)


SlotListener = Callable[[SlotChange], None]


@dataclass(frozen=True, slots=True)
class WarmUp:
    """Tokens to decode into free slot ``slot`` after its first ``length`` cached ones:
    the end of a chat's answer and the template's start of the next user turn."""

    slot: int
    length: int
    tokens: tuple[int, ...]


class SlotCache(Generic[S]):
    """The token sequence every slot's KV cells hold, and the request in each slot.

    ``slots`` is the list :func:`~tokenmill.engines.llamacpp.slots.plan_placement` reads; it
    is for reading only: every write goes through a method here, so that listeners
    see it.
    """

    def __init__(self, n_slots: int, n_ctx: int) -> None:
        self.slots: list[Slot[S]] = [Slot(i) for i in range(n_slots)]
        self.n_ctx = n_ctx  # tokens one slot holds at most
        self._listeners: list[SlotListener] = []
        # A next-turn warm-up planned when a chat's answer ended (see plan_warm_up).
        self.warm_up: WarmUp | None = None

    # -- reading ---------------------------------------------------------------------

    def tokens(self, index: int) -> tuple[int, ...]:
        """The tokens slot ``index``'s KV cells hold, positions 0 on."""
        return tuple(self.slots[index].tokens)

    def contents(self) -> list[tuple[int, ...]]:
        """Every slot's tokens, by slot index."""
        return [tuple(slot.tokens) for slot in self.slots]

    def used_tokens(self) -> int:
        """KV cells in use, all slots together."""
        return sum(len(slot.tokens) for slot in self.slots)

    def free_slots(self) -> int:
        """Slots no request decodes in."""
        return sum(1 for slot in self.slots if slot.seq is None)

    def subscribe(self, listener: SlotListener) -> None:
        """Call ``listener`` with every change of a slot's tokens (on the decode thread)."""
        self._listeners.append(listener)

    # -- changing (each call reports what it changed) -----------------------------

    def place(self, plan: Placement, seq: S, *, now: float, keep: int) -> None:
        """Record a carried-out placement: what was parked, copied and kept (see
        :func:`~tokenmill.engines.llamacpp.slots.apply_placement`); ``seq`` takes ``plan.dest``."""
        touched = [plan.dest] if plan.park_to is None else [plan.park_to, plan.dest]
        before = [self.slots[i].tokens[:] for i in touched] if self._listeners else []
        apply_placement(self.slots, plan, seq, now=now, keep=keep)
        for index, old in zip(touched, before, strict=False):
            self._report_replaced(index, old)

    def extend(self, index: int, tokens: Sequence[int]) -> None:
        """Slot ``index``'s cells now hold ``tokens`` after what they held."""
        held = self.slots[index].tokens
        kept = len(held)
        held.extend(tokens)
        if self._listeners and tokens:
            self._report(SlotChange(index, kept, tuple(tokens)))

    def append(self, index: int, token: int) -> None:
        """Slot ``index``'s cells now hold ``token`` after what they held (one step)."""
        held = self.slots[index].tokens
        held.append(token)
        if self._listeners:
            self._report(SlotChange(index, len(held) - 1, (token,)))

    def copy(self, src: int, dst: int) -> None:
        """Slot ``dst``'s cells are now a copy of slot ``src``'s."""
        old = self.slots[dst].tokens
        self.slots[dst].tokens = list(self.slots[src].tokens)
        self._report_replaced(dst, old)

    def restore(self, index: int, tokens: Sequence[int]) -> None:
        """Slot ``index``'s cells now hold ``tokens``, restored from host memory."""
        old = self.slots[index].tokens
        self.slots[index].tokens = list(tokens)
        self._report_replaced(index, old)

    def truncate(self, index: int, length: int) -> None:
        """Slot ``index``'s cells from position ``length`` on are gone (evicted)."""
        held = self.slots[index].tokens
        if len(held) > length:
            del held[length:]
            if self._listeners:
                self._report(SlotChange(index, length, ()))

    def release(self, index: int, *, now: float) -> None:
        """Slot ``index``'s request ended: the slot is free, its cells stay cached."""
        slot = self.slots[index]
        slot.seq = None
        slot.last_used = now

    # -- the next-turn warm-up -----------------------------------------------------

    def plan_warm_up(self, index: int, tokens: Sequence[int]) -> None:
        """Plan computing ``tokens`` after what slot ``index`` holds, once the engine
        is idle; not if they would fill its context (the next prompt needs room)."""
        held = len(self.slots[index].tokens)
        if held + len(tokens) < self.n_ctx:
            self.warm_up = WarmUp(index, held, tuple(tokens))

    def still_warmable(self, warm: WarmUp) -> bool:
        """The slot is free and holds as many tokens as when ``warm`` was planned:
        it has not moved on since the answer ended."""
        slot = self.slots[warm.slot]
        return slot.seq is None and len(slot.tokens) == warm.length

    # -- reports -------------------------------------------------------------------

    def _report_replaced(self, index: int, old: list[int]) -> None:
        if not self._listeners:
            return
        new = self.slots[index].tokens
        kept = common_prefix(old, new)
        if kept == len(old) == len(new):
            return  # nothing changed
        self._report(SlotChange(index, kept, tuple(new[kept:])))

    def _report(self, change: SlotChange) -> None:
        for listener in self._listeners:
            listener(change)
