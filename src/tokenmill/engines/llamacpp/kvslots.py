"""The slots' KV cells on llama.cpp: placements, copies, releases and warm-ups.

Which slot a request takes and what moves with it is decided by
:func:`~tokenmill.engines.llamacpp.slots.plan_placement`; what every slot holds is recorded
in a :class:`~.slotcache.SlotCache`. :class:`KvSlots` carries the decisions out on
the llama.cpp context and records each in the cache (whose listeners so see every
change), in that order.
"""

from __future__ import annotations

import logging
import time

from tokenmill.engines.llamacpp.choices import Choice
from tokenmill.engines.llamacpp.context import LlamaContext
from tokenmill.engines.llamacpp.counters import Counters
from tokenmill.engines.llamacpp.slotcache import SlotCache, WarmUp
from tokenmill.engines.llamacpp.slots import plan_placement

__all__ = ["KvSlots"]

log = logging.getLogger("tokenmill.engines.llamacpp")


class KvSlots:
    """The KV cells of every slot of ``context``, as ``cache`` records them."""

    def __init__(self, context: LlamaContext, cache: SlotCache[Choice], counters: Counters) -> None:
        self.context = context
        self.cache = cache
        self.counters = counters  # kv_copies and warmups are counted here

    def assign(self, seq: Choice, *, pending: int = 0, fills: bool = False) -> None:
        """Give ``seq`` a free slot, reusing the longest cached prefix of its prompt.

        ``pending``: requests about to need a slot after it; ``fills``: this round of
        admissions takes every free slot (see ``plan_placement``). Sets ``seq.slot``
        and how much of its prompt is cached (``n_past``, ``cached``).
        """
        plan = plan_placement(
            self.cache.slots,
            seq.prompt,
            pending=pending,
            fills=fills,
            # Its prompt's log probabilities need logits of every prompt row: a cached
            # prefix would skip computing them. A follower's prompt comes from its
            # leader, whole.
            reuse_prefix=seq.prompt_logprobs is None and seq.leader is None,
        )
        context = self.context
        # What ``dest`` holds is parked before anything is copied into it.
        if plan.park_to is not None:
            context.copy_seq(plan.dest, plan.park_to)
        if plan.copy_from is not None:
            context.copy_seq(plan.copy_from, plan.dest)
        keep = plan.keep
        if not context.drop(plan.dest, keep):
            context.drop(plan.dest, -1)
            keep = 0
        self.cache.place(plan, seq, now=time.monotonic(), keep=keep)
        self.counters.kv_copies += plan.copies
        seq.slot = plan.dest
        seq.n_past = keep
        seq.cached = keep

    def share(self, src: int, dst: int) -> None:
        """Slot ``dst`` takes a copy of slot ``src``'s cells (a follower of ``n``
        starting from its leader's prompt)."""
        self.context.copy_seq(src, dst)
        self.counters.kv_copies += 1
        self.cache.copy(src, dst)

    def release(self, index: int) -> None:
        """Slot ``index``'s request ended: keep only what is really in its cells (the
        prompt part decoded so far plus generated tokens already fed back; the last
        sampled one never was) as its cache, and free the slot."""
        self.context.drop(index, len(self.cache.slots[index].tokens))
        self.cache.release(index, now=time.monotonic())

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
