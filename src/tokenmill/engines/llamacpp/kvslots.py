"""The slots' KV cells on llama.cpp: placements, copies, parks, restores, releases,
swaps and warm-ups.

Which slot a request takes and what moves with it (copied from another slot, restored
from host memory or from a file, and the room that takes) is decided by
:func:`~tokenmill.engines.llamacpp.placement.place`, and what is parked in host memory
by a :class:`~.hosttier.HostTier`; what every slot holds is
recorded in a :class:`~.slotcache.SlotCache`. :class:`KvSlots` carries the decisions
out on the llama.cpp context and records each in the cache (whose listeners so see
every change), in that order.

In a unified pool (see :mod:`.context`) the cells are shared: before anything takes
cells (a copy, a restore, a step's tokens) there must be that many free, and cached
cells of free slots are given up for them, least recently used first (parked in host
memory when the tier is on).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

from tokenmill.engines.llamacpp.choices import Choice
from tokenmill.engines.llamacpp.context import LlamaContext
from tokenmill.engines.llamacpp.counters import Counters
from tokenmill.engines.llamacpp.disktier import DiskEntry, DiskTier, DiskWriter
from tokenmill.engines.llamacpp.hosttier import HostTier, Parked, covered
from tokenmill.engines.llamacpp.placement import (
    DiskOffer,
    Event,
    HostOffer,
    HostRestored,
    KvCopied,
    Room,
    Source,
    place,
    refused,
)
from tokenmill.engines.llamacpp.slotcache import SlotCache, WarmUp
from tokenmill.engines.llamacpp.slots import KV_COPY_MIN_TOKENS, common_prefix

__all__ = ["KvSlots"]


def _as_is(entry: Parked[bytearray]) -> tuple[tuple[int, ...], bytearray | None]:
    return entry.tokens, entry.state


def _read(disk: DiskTier, file: DiskEntry) -> tuple[tuple[int, ...], bytearray | None]:
    return file.tokens, disk.read(file)


log = logging.getLogger("tokenmill.engines.llamacpp")


class KvSlots:
    """The KV cells of every slot of ``context``, as ``cache`` records them."""

    def __init__(
        self,
        context: LlamaContext,
        cache: SlotCache[Choice],
        counters: Counters,
        tier: HostTier[bytearray] | None = None,
        disk: DiskWriter | None = None,
    ) -> None:
        self.context = context
        self.cache = cache
        self.counters = counters  # kv_copies and warmups are counted here
        self.tier: HostTier[bytearray] = tier if tier is not None else HostTier(0)
        # The disk tier (with the host tier on): what is parked is written there too.
        self.writer = disk
        self.disk: DiskTier | None = None if disk is None else disk.tier

    # -- the pool ------------------------------------------------------------------

    def free_cells(self) -> int:
        """Cells of the pool no slot holds (a unified pool; else every slot's own
        stream has room for its whole context: unbounded here)."""
        context = self.context
        if not context.unified:
            return context.pool_tokens
        return context.pool_tokens - self.cache.used_tokens()

    def make_room(self, cells: int, *, spare: Sequence[int] = ()) -> bool:
        """Free at least ``cells`` cells of the pool, giving up the cached cells of
        free slots (not those in ``spare``), least recently used first, each parked
        in host memory first if worth it. False if that is not enough."""
        if self.free_cells() >= cells:
            return True
        slots = self.cache.slots
        idle = [s for s in slots if s.seq is None and s.tokens and s.index not in spare]
        for slot in sorted(idle, key=lambda s: (s.last_used, s.index)):
            self._give_up((slot.index,))
            if self.free_cells() >= cells:
                return True
        return False

    # -- host memory -----------------------------------------------------------------

    def park(self, index: int, after: Sequence[int]) -> None:
        """Slot ``index``'s cells are about to hold only ``after`` (a prefix of the
        tokens they hold, or others): park what they hold now in host memory, unless
        that loses next to nothing or is held elsewhere (:meth:`HostTier.worth_parking`)."""
        tier, held = self.tier, self.cache.slots[index].tokens
        if not tier.enabled or covered(held, after):
            return
        others = [s.tokens for s in self.cache.slots if s.index != index]
        if not tier.worth_parking(held, [*others, after]):
            return
        if not tier.fits(len(held) * self.context.bytes_per_token):
            return
        state = self.context.save_seq(index)
        if state is None:
            return
        if tier.park(held, state, len(state), now=time.monotonic()) is not None:
            self.counters.kv_copies += 1
            if self.writer is not None:  # (its thread skips what a file holds)
                self.writer.submit(held, state)

    # -- moves between replicas ------------------------------------------------------

    def export(
        self, prompt: Sequence[int], min_tokens: int
    ) -> tuple[tuple[int, ...], bytearray] | None:
        """The held sequence sharing the longest prefix with ``prompt`` (at least
        ``min_tokens``; a slot's, then a parked one's, then a disk tier file's among
        equals), with its state, for another replica (see
        :class:`tokenmill.engines.KvMoving`). Runs on the decode thread."""
        Reader = Callable[[], tuple[tuple[int, ...], bytearray | None]]
        found: list[tuple[int, Reader]] = []
        for slot in self.cache.slots:
            # A running slot's record may run ahead of its cells (a sampled token not
            # yet decoded): what its cells hold, exactly.
            tokens, index = tuple(slot.tokens[: self.context.held(slot.index)]), slot.index
            if tokens:
                found.append((common_prefix(tokens, prompt), partial(self._saved, index, tokens)))
        for entry in list(self.tier.entries.values()):
            if not entry.pinned:
                found.append((common_prefix(entry.tokens, prompt), partial(_as_is, entry)))
        disk = self.disk
        if disk is not None:
            for file in list(disk.entries.values()):
                found.append((common_prefix(file.tokens, prompt), partial(_read, disk, file)))
        common, source = max(found, key=lambda f: f[0], default=(0, None))
        if source is None or common < min_tokens:
            return None
        tokens, state = source()
        return None if state is None else (tokens, state)

    def held(self, min_tokens: int) -> list[tuple[int, ...]]:
        """The sequences the slots' cells and the host tier hold, at least
        ``min_tokens`` each, most recently used first, none a prefix of another listed
        (:class:`tokenmill.engines.KvMoving`). Runs on the decode thread."""
        found: list[tuple[float, tuple[int, ...]]] = []
        for slot in self.cache.slots:
            tokens = tuple(slot.tokens[: self.context.held(slot.index)])
            found.append((slot.last_used, tokens))
        for entry in list(self.tier.entries.values()):
            if not entry.pinned:
                found.append((entry.last_used, entry.tokens))
        out: list[tuple[int, ...]] = []
        for _, tokens in sorted(found, key=lambda f: -f[0]):
            if len(tokens) >= min_tokens and not any(covered(tokens, t) for t in out):
                out.append(tokens)
        return out

    def _saved(
        self, index: int, tokens: tuple[int, ...]
    ) -> tuple[tuple[int, ...], bytearray | None]:
        return tokens, self.context.save_seq(index)

    def take(self, tokens: Sequence[int], state: bytearray) -> bool:
        """Keep a sequence another replica computed as a parked one (restored when a
        prompt continues it); True if it is held here now. Runs on the decode thread."""
        tier = self.tier
        if not tier.enabled or len(tokens) < KV_COPY_MIN_TOKENS:
            return False
        if not tier.worth_parking(tokens, [s.tokens for s in self.cache.slots]):
            return True  # a slot or a parked sequence holds it already
        if not tier.fits(len(state)):
            return False
        if tier.park(tokens, state, len(state), now=time.monotonic()) is None:
            return False
        if self.writer is not None:
            self.writer.submit(tokens, state)
        return True

    def save_to_disk(self) -> None:
        """Write what every slot holds to the disk tier (the loop has stopped: the
        replica is closing, so its next start finds these histories too)."""
        if self.writer is None:
            return
        for slot in self.cache.slots:
            self.context.drop(slot.index, len(slot.tokens))  # only what was recorded
            self._write(slot.index)

    # -- placements ------------------------------------------------------------------

    def assign(self, seq: Choice, *, pending: int = 0, fills: bool = False) -> None:
        """Give ``seq`` a free slot, reusing the longest cached prefix of its prompt:
        in a slot (copied if it is another one), parked in host memory or in a file of
        the disk tier (restored), whichever holds more of it.

        ``pending``: requests about to need a slot after it; ``fills``: this round of
        admissions takes every free slot (see ``plan_placement``). Sets ``seq.slot``
        and how much of its prompt is cached (``n_past``, ``cached``). What to do is
        :func:`~.placement.place`'s decision; this looks up what the tiers offer for
        it, carries it out and counts its events.
        """
        # Its prompt's log probabilities need logits of every prompt row: a cached
        # prefix would skip computing them. A follower's prompt comes from its
        # leader, whole.
        reuse = seq.prompt_logprobs is None and seq.leader is None
        slots, prompt, tier, context = self.cache.slots, seq.prompt, self.tier, self.context
        host, found = None, None
        if reuse and tier.enabled:
            match = tier.match(prompt)
            if match is not None:
                host = HostOffer(match.key, match.common, len(tier.get(match.key).tokens))
            found = None if self.disk is None else self.disk.match(prompt)
        decision = place(
            slots,
            prompt,
            room=Room(self.free_cells(), unified=context.unified),
            pending=pending,
            fills=fills,
            reuse=reuse,
            tiers=tier.enabled,
            host=host,
            disk=None if found is None else DiskOffer(found[1], len(found[0].tokens)),
        )
        self._give_up(decision.evict)
        restore: tuple[tuple[int, ...], bytearray] | None = None
        if decision.source is Source.DISK:
            assert self.disk is not None and found is not None and decision.fallback is not None
            state = self.disk.read(found[0])  # None: it did not check out (deleted, logged)
            if state is None:
                decision = decision.fallback
                self._give_up(decision.evict)
            else:
                restore = (found[0].tokens, state)
        if decision.source is Source.HOST:
            assert decision.host_key is not None
            entry = tier.get(decision.host_key)
            restore = (entry.tokens, entry.state)
        plan = decision.plan
        dest = plan.dest
        if restore is not None:
            tokens, state = restore
            self.park(dest, tokens[: plan.keep])
            if context.restore_seq(dest, state):
                self.cache.restore(dest, tokens)
            else:
                log.warning("llama.cpp refused a parked sequence for slot %d", dest)
                self.cache.truncate(dest, 0)
                decision = refused(decision)
        else:
            # What ``dest`` holds is parked before anything is copied into it.
            if plan.park_to is not None:
                context.copy_seq(dest, plan.park_to)
            kept = dest if plan.copy_from is None else plan.copy_from
            self.park(dest, slots[kept].tokens[: plan.keep])
            if plan.copy_from is not None:
                context.copy_seq(plan.copy_from, dest)
        self._count(decision.events)
        keep = decision.keep
        if not context.drop(dest, keep):
            context.drop(dest, -1)
            keep = 0
        self.cache.place(decision.plan, seq, now=time.monotonic(), keep=keep)
        seq.slot = dest
        seq.n_past = keep
        seq.cached = keep
        for index, kept in decision.trim:
            self._cut(index, kept)
            self.counters.span_trims += 1

    def _give_up(self, slots: Sequence[int]) -> None:
        """Free slots ``slots``' cached cells go, in this order, for room in the pool
        (each parked in host memory first if worth it)."""
        for index in slots:
            self._cut(index, 0)
            self.counters.pool_evictions += 1

    def _cut(self, index: int, keep: int) -> None:
        """Free slot ``index`` keeps only its first ``keep`` tokens' cells; what it held
        is parked in host memory first if worth it."""
        self.park(index, self.cache.slots[index].tokens[:keep])
        self.context.drop(index, keep)
        self.cache.truncate(index, keep)

    def _count(self, events: Sequence[Event]) -> None:
        """Count what a carried-out placement did (:data:`~.placement.Event`)."""
        for event in events:
            if isinstance(event, KvCopied):
                self.counters.kv_copies += event.streams
            elif isinstance(event, HostRestored):
                whole, now = event.whole, time.monotonic()
                self.tier.restored(event.key, reused=event.reused, now=now, whole=whole)
            elif self.disk is not None:
                self.disk.stats.hits += 1
                self.disk.stats.restored_tokens += event.reused

    def share(self, src: int, dst: int) -> None:
        """Slot ``dst`` takes a copy of slot ``src``'s cells (a follower of ``n``
        starting from its leader's prompt)."""
        self.make_room(len(self.cache.slots[src].tokens), spare=(src,))
        self.context.copy_seq(src, dst)
        self.counters.kv_copies += 1
        self.cache.copy(src, dst)

    def release(self, index: int) -> None:
        """Slot ``index``'s request ended: keep only what is really in its cells (the
        prompt part decoded so far plus generated tokens already fed back; the last
        sampled one never was) as its cache, and free the slot."""
        self.context.drop(index, len(self.cache.slots[index].tokens))
        self.cache.release(index, now=time.monotonic())
        self._write(index)

    def _write(self, index: int) -> None:
        """With a disk tier, what slot ``index`` now holds goes to disk too (a copy of
        its cells now, written by the writer's thread), so that a crash loses no
        finished turn's history; skipped when a file already holds it (no copy)."""
        writer = self.writer
        tokens = self.cache.slots[index].tokens
        if writer is None or len(tokens) < KV_COPY_MIN_TOKENS or writer.tier.covers(tokens):
            return
        state = self.context.save_seq(index)
        if state is not None:
            writer.submit(tokens, state)

    def warm(self, warm: WarmUp) -> None:
        """Decode ``warm.tokens`` into its free slot after the cached ones.

        A chat's next request is its history plus a new message: the prompt cache
        holds the history up to the answer's last decoded token, and the rest is
        computed on that request's first-token path: the answer's last token when it
        ended at max_tokens, the template's end of the answer and start of the next
        user turn (ChatML: ``<|im_end|>\\n<|im_start|>user\\n``, 5 tokens), then the new
        message. The first two are known when the answer ends, so they are computed
        while the person reads it: the loop calls this only after ``WARM_AFTER_S``
        with nothing to do, never while anything runs or waits. If the next request
        is something else (a tool's answer, another conversation) the cells are
        simply not reused.
        """
        if not self.cache.still_warmable(warm):
            return  # the slot moved on since the answer ended
        if self.free_cells() < len(warm.tokens):
            return  # a full pool: not worth giving up other cached cells for
        context, tokens = self.context, warm.tokens
        for i, token in enumerate(tokens):
            context.add(i, token, warm.length + i, warm.slot, i == len(tokens) - 1)
        rc = context.decode(len(tokens))
        if rc != 0:
            log.warning("llama_decode returned %d warming slot %d's next turn", rc, warm.slot)
            context.drop(warm.slot, warm.length)
            return
        self.cache.extend(warm.slot, tokens)
        self.counters.warmups += 1
