"""A full shared KV pool: preemption by swap, for the decode loop (:mod:`.loop`).

In a unified KV pool a step writes as many cells as it has rows, and the pool must
have them. Before a step, :meth:`Swapper.fit` gives up cached cells of free slots and,
if that is not enough for the decoding choices and one prompt token, swaps the newest
running choices out: their cells are parked in host memory (pinned: the tier never
evicts them), their slots stay theirs. :meth:`Swapper.resume` brings them back, first
out first in, bit for bit where they stopped, while the pool holds them and a step's
tokens for what runs; nothing new is admitted while one waits. Nothing a choice has
generated or will be billed for changes by it.

Of a :class:`~.choices.Choice` this module alone writes ``swapped``; it moves choices
between the loop's ``running`` and its own ``swapped``.
"""

from __future__ import annotations

import logging
import time

from tokenmill.engines.llamacpp.choices import Choice
from tokenmill.engines.llamacpp.context import LlamaContext
from tokenmill.engines.llamacpp.counters import Counters
from tokenmill.engines.llamacpp.kvslots import KvSlots

__all__ = ["Swapper"]

log = logging.getLogger("tokenmill.engines.llamacpp")


class Swapper:
    """The choices swapped out of a full pool (``swapped``, by key, in the order they
    were), and the moves between it and the loop's running choices."""

    def __init__(self, context: LlamaContext, kv: KvSlots, counters: Counters) -> None:
        self.context = context
        self.kv = kv
        self.counters = counters
        self.swapped: dict[str, Choice] = {}

    def fit(self, running: dict[str, Choice], chunk: int) -> int:
        """Make the pool hold this step's cells; returns the rows it may have.

        A token for every decoding choice, and a prompt ``chunk``: cached cells of free
        slots are given up for them; if that is not enough for the decoding choices
        and one prompt token, the newest running choices are swapped out.
        """
        kv, slots = self.kv, self.kv.cache.slots
        while True:
            decoding = sum(1 for s in running.values() if s.prefilled)
            prefilling = any(not s.prefilled and s.leader is None for s in running.values())
            want = decoding + (chunk if prefilling else 0)
            free = kv.free_cells()
            if free >= want:  # (every step but those of a full pool: one sum, no search)
                return free
            if kv.make_room(want) or kv.make_room(decoding + prefilling):
                return kv.free_cells()
            victim = next((s for s in reversed(running.values()) if slots[s.slot].tokens), None)
            if victim is None or len(running) == 1:
                return kv.free_cells()  # nothing to give: what fits runs
            self._swap_out(victim, running)

    def _swap_out(self, seq: Choice, running: dict[str, Choice]) -> None:
        slot = seq.slot
        cache = self.kv.cache
        tokens = cache.slots[slot].tokens
        state = self.context.save_seq(slot)
        if state is None:
            raise RuntimeError(f"llama.cpp gave no state for slot {slot} to swap out")
        seq.swapped = self.kv.tier.park(
            tokens, state, len(state), now=time.monotonic(), pinned=True
        )
        self.context.drop(slot, -1)
        cache.truncate(slot, 0)
        del running[seq.key]
        self.swapped[seq.key] = seq
        self.counters.preemptions += 1
        log.info(
            "request %s swapped out of a full KV pool (%d tokens)", seq.request_id, len(tokens)
        )

    def resume(self, running: dict[str, Choice]) -> None:
        """Swapped-out choices back into their slots, first out first in, while the
        pool holds them and a step's tokens for what runs."""
        kv, tier = self.kv, self.kv.tier
        for key, seq in list(self.swapped.items()):
            assert seq.swapped is not None
            entry = tier.get(seq.swapped)
            decoding = sum(1 for s in running.values() if s.prefilled)
            if not kv.make_room(len(entry.tokens) + decoding + 1):
                return
            if not self.context.restore_seq(seq.slot, entry.state):
                raise RuntimeError(f"llama.cpp refused slot {seq.slot}'s swapped-out cells")
            tier.unpin(seq.swapped)
            seq.swapped = None
            kv.cache.restore(seq.slot, entry.tokens)
            del self.swapped[key]
            running[key] = seq
            self.counters.resumes += 1

    def forget(self, seq: Choice) -> None:
        """``seq`` ended (cancelled) while swapped out: its parked cells go."""
        if seq.swapped is not None:
            self.swapped.pop(seq.key, None)
            self.kv.tier.unpin(seq.swapped, resumed=False)
            seq.swapped = None
