"""Token sequences as chains of block hashes: how a KV cache's contents are named.

A replica's KV slot holds a token sequence; a prompt is a token sequence. Both are
cut into blocks of :data:`BLOCK_TOKENS` tokens, and block ``i`` is named by
``hash(name of block i-1, its tokens)``: a chain, so one name stands for the whole
prefix up to the end of its block, and two sequences share a block name exactly when
they share every token up to it. The gateway compares a prompt's chain with the
chains its replicas publish (:mod:`tokenmill.gateway.prefix`) to know how much of
the prompt each one has cached. Only full blocks are named: the tokens after the last
full block are not published and not counted.

The hash is BLAKE2b cut to 8 bytes, over the parent's name and the tokens as 32-bit
little-endian integers: stable across processes and machines (never Python's
``hash()``, which is salted per process), and fast enough (about 1 us a block).

:class:`SlotChains` follows a replica's slots as they change and says, for each
change, which names a slot now has: what a replica publishes, through a
:class:`CachePublisher`. Plain Python, no
engine in it; it must never be given anything but token ids.

A replica's host-memory tier (sequences parked when their slot was given to another)
is published on the same stream, each parked sequence as one more chain after the
slots' (a *lane*: ``n_slots`` on, reused once its sequence leaves the tier), so that
the gateway routes a conversation back to the replica that parked its history; the
snapshot's ``n_slots`` says which chains are slots and which are parked. The disk
tier's files are published as lanes too (a replica that restarts announces them so).
"""

from __future__ import annotations

import hashlib
import heapq
import struct
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

__all__ = [
    "BLOCK_TOKENS",
    "ROOT",
    "BlockSnapshot",
    "BlockUpdate",
    "CacheEvent",
    "CachePublisher",
    "SlotChains",
    "chain",
    "extend_chain",
]

# 16 tokens a block: a system prompt or a previous turn is hundreds of tokens, so a
# prefix is found to within 16 tokens (what it saves is prefill of the rest); shorter
# blocks cost more names to publish and look up for no better routing decision.
BLOCK_TOKENS = 16

ROOT = 0  # the name "before" the first block
_NAME = struct.Struct("<Q")


def _block_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def extend_chain(parent: int, tokens: Sequence[int]) -> list[int]:
    """The names of the full blocks of ``tokens``, continuing a chain after ``parent``."""
    names: list[int] = []
    full = len(tokens) - len(tokens) % BLOCK_TOKENS
    if not full:
        return names
    data = _block_bytes(tokens[:full])
    step = BLOCK_TOKENS * 4
    name = parent
    for start in range(0, len(data), step):
        digest = hashlib.blake2b(
            _NAME.pack(name) + data[start : start + step], digest_size=8
        ).digest()
        (name,) = _NAME.unpack(digest)
        names.append(name)
    return names


def chain(tokens: Sequence[int]) -> list[int]:
    """The names of ``tokens``' full blocks, from position 0."""
    return extend_chain(ROOT, tokens)


@dataclass(frozen=True, slots=True)
class BlockUpdate:
    """Slot ``slot`` now holds its first ``kept`` block names as before, then ``added``
    (a slot emptied or cut below a block boundary has ``kept`` lower, ``added`` empty)."""

    slot: int
    kept: int
    added: tuple[int, ...]
    disk: bool = False  # the lane is a file of the disk tier's (a lane past the slots)


@dataclass(frozen=True, slots=True)
class BlockSnapshot:
    """Every chain's block names, by index: what a replica holds as a whole. The
    first ``n_slots`` are its KV slots', the rest its parked sequences' (host memory,
    or the disk tier's files: the lanes in ``disk``); ``n_slots`` None: every chain is
    a slot's."""

    slots: tuple[tuple[int, ...], ...]
    n_slots: int | None = None
    disk: tuple[int, ...] = ()


# What a replica publishes: a snapshot when it (re)connects, then one update a change.
CacheEvent = BlockSnapshot | BlockUpdate


class SlotChains:
    """The block names of every slot of one replica, kept up to date change by change.

    The engine reports each change of a slot's tokens as "the first ``kept`` tokens
    stay, then ``added`` follow" (a decode, a placement, a copy, an eviction);
    :meth:`change` returns the :class:`BlockUpdate` to publish, or None when the slot's
    full blocks did not change (a decode inside a block).
    """

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self._tokens: list[list[int]] = [[] for _ in range(n_slots)]
        self._names: list[list[int]] = [[] for _ in range(n_slots)]
        self._disk: set[int] = set()  # lanes holding a disk tier file's sequence

    def change(
        self, slot: int, kept: int, added: Sequence[int], *, disk: bool = False
    ) -> BlockUpdate | None:
        while len(self._tokens) <= slot:  # a lane (a parked sequence) past the slots
            self._tokens.append([])
            self._names.append([])
        tokens, names = self._tokens[slot], self._names[slot]
        if kept > len(tokens):
            raise ValueError(f"slot {slot} holds {len(tokens)} tokens, not {kept}")
        if (
            kept == len(tokens)
            and kept % BLOCK_TOKENS + len(added) < BLOCK_TOKENS
            and not disk
            and slot not in self._disk
        ):
            # A decode inside a block (15 steps of 16): no name changes, nothing to hash
            # or compare. This runs on the decode thread once a token.
            tokens.extend(added)
            return None
        del tokens[kept:]
        tokens.extend(added)
        if disk:
            self._disk.add(slot)
        else:
            self._disk.discard(slot)
        whole = kept // BLOCK_TOKENS  # blocks untouched by the change
        cut = min(whole, len(names))
        new = extend_chain(names[cut - 1] if cut else ROOT, tokens[cut * BLOCK_TOKENS :])
        if names[cut:] == new:
            return None
        del names[cut:]
        names.extend(new)
        return BlockUpdate(slot, cut, tuple(new), disk)

    def snapshot(self) -> BlockSnapshot:
        """Every slot's and lane's block names (what a (re)connecting gateway reads)."""
        return BlockSnapshot(
            tuple(tuple(names) for names in self._names), self.n_slots, tuple(sorted(self._disk))
        )

    def tokens(self, slot: int) -> tuple[int, ...]:
        """The tokens slot ``slot`` holds, as the changes said."""
        return tuple(self._tokens[slot])


class CachePublisher:
    """What an engine's slots hold, told to listeners as :data:`CacheEvent` objects.

    The engine calls :meth:`change` with every change of a slot's tokens (from its
    decode thread), :meth:`park` and :meth:`unpark` as a sequence enters and leaves its
    host-memory tier, and :meth:`reset` when it (re)starts with empty slots and an
    empty tier; a listener added with :meth:`subscribe` gets a :class:`BlockSnapshot`
    first, then every :class:`BlockUpdate`, in order (one lock keeps a change from
    slipping between a snapshot and the updates after it). Listeners must be quick and
    never raise.
    """

    def __init__(self, n_slots: int) -> None:
        self._lock = threading.Lock()
        self._chains = SlotChains(n_slots)
        self._n_slots = n_slots
        self._listeners: list[Callable[[CacheEvent], None]] = []
        # Parked sequences' lanes: key -> lane; lanes freed, lowest reused first.
        self._lanes: dict[Hashable, int] = {}
        self._free: list[int] = []

    def subscribe(self, listener: Callable[[CacheEvent], None]) -> Callable[[], None]:
        """Add ``listener``; returns the function that removes it."""
        with self._lock:
            listener(self._chains.snapshot())
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def change(self, slot: int, kept: int, added: Sequence[int]) -> None:
        with self._lock:
            self._change(slot, kept, added)

    def park(self, key: Hashable, tokens: Sequence[int], *, disk: bool = False) -> None:
        """Sequence ``key`` of the host-memory tier (``disk``: of the disk tier) holds
        ``tokens`` (from position 0)."""
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = heapq.heappop(self._free) if self._free else self._n_slots + len(self._lanes)
                self._lanes[key] = lane
            self._change(lane, 0, tokens, disk=disk)

    def unpark(self, key: Hashable) -> None:
        """Sequence ``key`` left its tier (restored, evicted, resumed, deleted)."""
        with self._lock:
            lane = self._lanes.pop(key, None)
            if lane is not None:
                self._change(lane, 0, ())
                heapq.heappush(self._free, lane)

    def _change(self, slot: int, kept: int, added: Sequence[int], *, disk: bool = False) -> None:
        update = self._chains.change(slot, kept, added, disk=disk)
        if update is not None:
            for listener in self._listeners:
                listener(update)

    def reset(self) -> None:
        """Every slot and the tier are empty again (the engine (re)started): listeners
        get a snapshot."""
        with self._lock:
            self._chains = SlotChains(self._n_slots)
            self._lanes.clear()
            self._free.clear()
            snapshot = self._chains.snapshot()
            for listener in self._listeners:
                listener(snapshot)

    def snapshot(self) -> BlockSnapshot:
        with self._lock:
            return self._chains.snapshot()
