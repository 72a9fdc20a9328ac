"""A deployment's index of what its replicas' KV caches hold, by block name.

Each replica that publishes its cache (the llama.cpp engine, see
:mod:`tokenmill.kvblocks`) tells the gateway, slot by slot, the chain of block names
its KV cells hold: a snapshot when it (re)connects, then one update per change. The
index keeps every replica's chains and, per block name, the replicas holding it, so
that for a prompt's chain it answers how many leading blocks each replica has cached.
A replica that dies or restarts is dropped until its next snapshot. An upstream
replica publishes nothing and never appears here.

A replica's chains past its slots are the sequences its host-memory tier parked, and
its disk tier's files (:mod:`tokenmill.kvblocks`): a prompt they hold is cached there
too, one restore (or one file read) away instead of in a slot;
:meth:`PrefixIndex.tiers` says which.

The index only ever under-reports: it is bounded (:data:`MAX_BLOCKS_PER_REPLICA`),
and blocks past the bound, or whose parent it does not have, are not indexed; a
replica is never credited with a block it did not publish. It is owned by the event
loop: no locks, every method returns at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from tokenmill.kvblocks import BLOCK_TOKENS, BlockUpdate

__all__ = ["MAX_BLOCKS_PER_REPLICA", "PrefixIndex", "Tier"]

# Where a replica holds a prompt's cached prefix: in a KV slot, parked in its host
# memory, or in its disk tier's files (restored into a slot, or read and restored,
# before the rest of the prompt is computed).
Tier = Literal["slot", "host", "disk"]

# Block names indexed per replica: 65,536 blocks are 1M tokens of KV cache (16 slots
# of 64k tokens; tokenmill's default is 16 of 2k), at about 200 bytes an entry 13 MB
# a replica at most. Beyond it, what a slot adds is not indexed: the replica's cache
# is under-reported, its requests are routed as if it cached less, nothing else.
MAX_BLOCKS_PER_REPLICA = 1 << 16


class PrefixIndex:
    def __init__(self, max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA) -> None:
        self._limit = max_blocks_per_replica
        # replica -> its slots' indexed chains (a prefix of what each slot holds)
        self._chains: dict[int, list[list[int]]] = {}
        self._sizes: dict[int, int] = {}  # replica -> names indexed, all slots
        # block name -> replica -> how many of its slots hold the block
        self._holders: dict[int, dict[int, int]] = {}
        # replica -> how many of its chains are slots (the rest: parked sequences)
        self._slots: dict[int, int] = {}
        # replica -> its lanes that are disk tier files (the other lanes: host memory)
        self._disk: dict[int, set[int]] = {}

    def reset(
        self,
        replica: int,
        slots: Sequence[Sequence[int]],
        n_slots: int | None = None,
        disk: Sequence[int] = (),
    ) -> None:
        """Replace what ``replica`` holds with a snapshot (one chain a slot, then one a
        parked sequence: the first ``n_slots`` are slots, None: all are; the lanes in
        ``disk`` are disk tier files)."""
        self.drop(replica)
        self._chains[replica] = [[] for _ in slots]
        self._slots[replica] = len(slots) if n_slots is None else n_slots
        self._disk[replica] = set(disk)
        self._sizes[replica] = 0
        for slot, names in enumerate(slots):
            self._extend(replica, slot, names)

    def update(self, replica: int, change: BlockUpdate) -> None:
        """One slot of ``replica`` changed (see :class:`~tokenmill.kvblocks.BlockUpdate`)."""
        chains = self._chains.get(replica)
        if chains is None:  # no snapshot yet: updates before it mean nothing
            return
        while len(chains) <= change.slot:
            chains.append([])
        chain = chains[change.slot]
        disk = self._disk.setdefault(replica, set())
        if change.disk:
            disk.add(change.slot)
        else:
            disk.discard(change.slot)
        indexed = len(chain)
        for name in chain[change.kept :]:
            self._forget(replica, name)
        del chain[change.kept :]
        if change.kept <= indexed:  # else the parent was never indexed: nor is this
            self._extend(replica, change.slot, change.added)

    def drop(self, replica: int) -> None:
        """Forget ``replica`` (it died, restarted or went away)."""
        for chain in self._chains.pop(replica, []):
            for name in chain:
                self._forget(replica, name)
        self._sizes.pop(replica, None)
        self._slots.pop(replica, None)
        self._disk.pop(replica, None)

    def cached_blocks(self, names: Sequence[int]) -> dict[int, int]:
        """For a prompt's chain, each indexed replica's number of leading blocks held."""
        out: dict[int, int] = {}
        for replica in self._chains:
            # A replica holding block k holds blocks 0..k-1 (one slot's chain holds
            # them all): the blocks held are a prefix, found by bisection.
            lo, hi = 0, len(names)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if replica in self._holders.get(names[mid - 1], _NONE):
                    lo = mid
                else:
                    hi = mid - 1
            out[replica] = lo
        return out

    def continued(self, names: Sequence[int], held: Mapping[int, int]) -> set[int]:
        """The replicas, of ``held`` (:meth:`cached_blocks` of ``names``), where the
        blocks held end where one slot's chain ends: the prompt continues what that
        slot holds whole (a conversation's next turn, an agent's next call), rather
        than sharing only its first part (a system prompt other conversations share
        too). Chains are chained hashes: equal last names mean equal chains."""
        out = set()
        for replica, n in held.items():
            if n and any(
                len(c) == n and c[-1] == names[n - 1] for c in self._chains.get(replica, ())
            ):
                out.add(replica)
        return out

    def tiers(self, names: Sequence[int], held: Mapping[int, int]) -> dict[int, Tier]:
        """For the replicas of ``held`` (:meth:`cached_blocks` of ``names``) that hold
        any of it, where: ``slot`` when a slot holds all those blocks, else ``host``
        when a sequence parked in host memory does, else ``disk`` (only a file)."""
        out: dict[int, Tier] = {}
        for replica, n in held.items():
            if not n:
                continue
            chains = self._chains.get(replica, [])
            n_slots, disk = self._slots.get(replica, 0), self._disk.get(replica, set())
            holding = [i for i, c in enumerate(chains) if len(c) >= n and c[n - 1] == names[n - 1]]
            if any(i < n_slots for i in holding):
                out[replica] = "slot"
            elif any(i not in disk for i in holding):
                out[replica] = "host"
            else:
                out[replica] = "disk"
        return out

    def cached_tokens(self, names: Sequence[int]) -> dict[int, int]:
        """:meth:`cached_blocks` in tokens."""
        return {r: n * BLOCK_TOKENS for r, n in self.cached_blocks(names).items()}

    def chains(self, replica: int) -> list[tuple[int, ...]]:
        """What is indexed for ``replica``, one chain a slot then one a parked
        sequence's lane (empty if unknown)."""
        return [tuple(c) for c in self._chains.get(replica, [])]

    def blocks(self, replica: int) -> int:
        """Block names indexed for ``replica``, all slots together."""
        return self._sizes.get(replica, 0)

    def _extend(self, replica: int, slot: int, names: Sequence[int]) -> None:
        chain = self._chains[replica][slot]
        room = self._limit - self._sizes[replica]
        for name in names[: max(room, 0)]:
            chain.append(name)
            holders = self._holders.setdefault(name, {})
            holders[replica] = holders.get(replica, 0) + 1
        self._sizes[replica] += min(len(names), max(room, 0))

    def _forget(self, replica: int, name: int) -> None:
        self._sizes[replica] -= 1
        holders = self._holders[name]
        left = holders[replica] - 1
        if left:
            holders[replica] = left
        else:
            del holders[replica]
            if not holders:
                del self._holders[name]


_NONE: Mapping[int, int] = {}
