"""The host-memory tier of the llama.cpp engine's KV cache: parked sequences (pure).

A KV slot's cells are the engine's prefix cache (:mod:`.slotcache`), but there are
only ``max_num_seqs`` slots: with more open conversations than slots, a slot given to
another sequence would lose what it held, and that conversation's next turn would
compute its whole history again. So what a slot is about to lose is *parked* here
first: its tokens and its cells' bytes (``llama_state_seq_get_data``), in host
memory. A later prompt that continues a parked sequence further than any slot does
gets it back into a free slot (``llama_state_seq_set_data``), cut to the common
prefix: the cells are the ones the slot held, bit for bit.

:class:`HostTier` decides, and holds the entries; it never touches llama.cpp (the
state is an opaque value it only counts the bytes of), so it is unit-tested without
a model. Its rules:

* **Bounded in bytes** (``capacity``): parking evicts the least recently used entries
  until the new one fits; one that can never fit is not parked.
* **No sequence twice**: a sequence that is (all but fewer than
  ``KV_COPY_MIN_TOKENS`` tokens of) a prefix of one still held, in a slot or here, is
  not parked; parking a sequence drops the entries it continues (they are its
  prefixes, and restoring the longer one cut to the common prefix gives the same
  cells). Two conversations that share only a system prompt each hold it: llama.cpp
  restores a sequence whole, from position 0.
* **Placement**: :meth:`HostTier.match` names the entry sharing the longest prefix
  with a prompt; the engine restores it when that is at least ``KV_COPY_MIN_TOKENS``
  more than any slot offers.
* **Published**: ``listener`` hears of every cached entry as it is parked
  (``listener(key, tokens)``) and as it leaves (``listener(key, None)``), restored
  whole, evicted, subsumed or cleared, so that routing knows what the tier holds
  (:meth:`tokenmill.kvblocks.CachePublisher.park`). Swapped sequences are not
  published: they are live requests, not a cache.
* **Swapped sequences** (``pinned``): a running sequence preempted from a full KV
  pool is parked here too, and never evicted: it is a request's live state, not a
  cache. It makes room by evicting cached entries, and is held even beyond
  ``capacity`` when nothing cached is left to evict (a request is never failed for
  want of host memory: the pool bounds what can be swapped out).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tokenmill.engines.llamacpp.slots import KV_COPY_MIN_TOKENS, common_prefix

__all__ = ["HostTier", "Match", "Parked", "TierStats", "covered", "longest_prefix"]

B = TypeVar("B")  # the parked state (llama.cpp's sequence bytes); opaque here
K = TypeVar("K")


@dataclass(slots=True)
class Parked(Generic[B]):
    """One parked sequence: its tokens (position 0 on) and its KV cells' bytes."""

    key: int
    tokens: tuple[int, ...]
    state: B
    nbytes: int
    last_used: float
    pinned: bool = False  # a preempted running sequence: never evicted


@dataclass(frozen=True, slots=True)
class Match:
    """Entry ``key`` shares its first ``common`` tokens with the prompt."""

    key: int
    common: int


@dataclass(slots=True)
class TierStats:
    parks: int = 0  # sequences parked (cached entries; swaps are counted apart)
    hits: int = 0  # prompts whose longest cached prefix was a parked entry
    restores: int = 0  # entries restored into a slot (hits and resumed swaps)
    restored_tokens: int = 0  # tokens of those restores a prompt reused
    evictions: int = 0  # entries dropped, least recently used, for room
    subsumed: int = 0  # entries dropped because a longer parked one continues them
    swaps: int = 0  # running sequences swapped out of a full pool (pinned entries)


def longest_prefix(
    held: Iterable[tuple[K, Sequence[int]]], prompt: Sequence[int], better_than: int
) -> tuple[K, int] | None:
    """Of ``held`` (key, tokens), most recently used first, the one sharing the longest
    prefix with ``prompt`` (the first among ties), with how many tokens it shares, if
    that is at least ``KV_COPY_MIN_TOKENS`` more than ``better_than`` (what a slot
    offers: restoring costs about what a copy between slots does)."""
    best: tuple[K, int] | None = None
    for key, tokens in held:
        common = common_prefix(tokens, prompt)
        if best is None or common > best[1]:
            best = (key, common)
    if best is None or best[1] < better_than + KV_COPY_MIN_TOKENS:
        return None
    return best


def covered(tokens: Sequence[int], held: Sequence[int]) -> bool:
    """``held`` holds (all but fewer than ``KV_COPY_MIN_TOKENS`` tokens of) ``tokens``
    from position 0: parking ``tokens`` would save next to nothing."""
    return common_prefix(tokens, held) >= len(tokens) - KV_COPY_MIN_TOKENS + 1


@dataclass(slots=True)
class HostTier(Generic[B]):
    """Parked sequences in host memory, at most ``capacity`` bytes of cached ones."""

    capacity: int
    entries: dict[int, Parked[B]] = field(default_factory=dict)  # least recently used first
    used: int = 0  # bytes of every entry, pinned ones too
    stats: TierStats = field(default_factory=TierStats)
    # Hears of cached entries parked (key, tokens) and gone (key, None); see above.
    listener: Callable[[int, tuple[int, ...] | None], None] | None = None
    _next_key: int = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def cached_entries(self) -> int:
        """Entries that are a cache (not swapped-out running sequences)."""
        # Read by health() on the event loop's thread while the decode thread parks
        # and restores: iterating the dict itself would raise if its size changed
        # meanwhile; list() copies it in one step under the GIL.
        return sum(1 for e in list(self.entries.values()) if not e.pinned)

    # -- placement -----------------------------------------------------------------

    def match(self, prompt: Sequence[int], *, better_than: int = 0) -> Match | None:
        """The cached entry sharing the longest prefix with ``prompt`` (the most
        recently used among ties), if it shares at least ``KV_COPY_MIN_TOKENS`` more
        than ``better_than`` (what a slot offers: restoring costs about what a copy
        between slots does)."""
        cached = ((e.key, e.tokens) for e in reversed(self.entries.values()) if not e.pinned)
        best = longest_prefix(cached, prompt, better_than)
        return None if best is None else Match(*best)

    def get(self, key: int) -> Parked[B]:
        return self.entries[key]

    def restored(self, key: int, *, reused: int, now: float, whole: bool) -> None:
        """Entry ``key`` was restored into a slot and ``reused`` of its tokens kept.
        ``whole``: the slot now continues the whole entry, which so leaves this tier
        (the slot holds it, and parks it again, longer, if it is ever reassigned);
        otherwise it stays, as recently used."""
        self.stats.hits += 1
        self.stats.restores += 1
        self.stats.restored_tokens += reused
        if whole:
            self._remove(key)
        else:
            self._touch(key, now)

    # -- parking -------------------------------------------------------------------

    def worth_parking(self, tokens: Sequence[int], held: Iterable[Sequence[int]]) -> bool:
        """Whether ``tokens`` (a slot's, about to be lost) should be parked: the tier
        is on, it is long enough to matter, and neither a slot (``held``: what the
        slots will hold) nor a parked entry already holds it."""
        if not self.enabled or len(tokens) < KV_COPY_MIN_TOKENS:
            return False
        if any(covered(tokens, other) for other in held):
            return False
        return not any(covered(tokens, e.tokens) for e in self.entries.values())

    def fits(self, nbytes: int) -> bool:
        """Whether a cached entry of ``nbytes`` can be parked (evicting others)."""
        pinned = sum(e.nbytes for e in self.entries.values() if e.pinned)
        return nbytes <= self.capacity - pinned

    def park(
        self, tokens: Sequence[int], state: B, nbytes: int, *, now: float, pinned: bool = False
    ) -> int | None:
        """Park ``tokens`` with its ``state`` of ``nbytes``; returns its key, or None
        when a cached entry cannot fit. Drops the cached entries it continues, then
        the least recently used ones until it fits (a pinned one evicts every cached
        entry before it goes over ``capacity``)."""
        if not pinned and not self.fits(nbytes):
            return None
        tokens = tuple(tokens)
        for entry in list(self.entries.values()):
            if not entry.pinned and covered(entry.tokens, tokens):
                self._remove(entry.key)
                self.stats.subsumed += 1
        for entry in list(self.entries.values()):
            if self.used + nbytes <= self.capacity:
                break
            if not entry.pinned:
                self._remove(entry.key)
                self.stats.evictions += 1
        key = self._next_key
        self._next_key += 1
        self.entries[key] = Parked(key, tokens, state, nbytes, now, pinned)
        self.used += nbytes
        if pinned:
            self.stats.swaps += 1
        else:
            self.stats.parks += 1
            if self.listener is not None:
                self.listener(key, tokens)
        return key

    def unpin(self, key: int, *, resumed: bool = True) -> Parked[B]:
        """Take swapped-out entry ``key`` back: its sequence resumes (or ended)."""
        entry = self._remove(key)
        self.stats.restores += resumed
        return entry

    def clear(self) -> None:
        for key in list(self.entries):
            self._remove(key)

    # -- internals -----------------------------------------------------------------

    def _touch(self, key: int, now: float) -> None:
        entry = self.entries.pop(key)
        entry.last_used = now
        self.entries[key] = entry

    def _remove(self, key: int) -> Parked[B]:
        entry = self.entries.pop(key)
        self.used -= entry.nbytes
        if not entry.pinned and self.listener is not None:
            self.listener(key, None)
        return entry
