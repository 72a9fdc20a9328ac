"""Which KV slot a new request takes, and which cached tokens move with it.

The llama.cpp engine (``llamacpp/``) gives every running request a slot: a llama.cpp
sequence with its own KV stream. What a slot's KV cells hold outlives the request
that wrote them, as a prefix cache. This module decides, for a request about to be
admitted, which free slot it takes, whether another slot's cached prefix is copied
into it, whether what the slot cached is first parked elsewhere, and how many prompt
tokens the request reuses. It is plain Python with no llama.cpp in it: the engine
issues the llama.cpp calls a ``Placement`` stands for, then records them here with
``apply_placement``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = [
    "KV_COPY_MIN_TOKENS",
    "Placement",
    "Slot",
    "apply_placement",
    "common_prefix",
    "plan_placement",
]

# Copying another slot's cached cells costs in proportion to them, about 4 us a cell
# (0.7 ms for 180 cells of SmolLM2-135M measured here, ``LlamaContext.copy_seq``),
# far less than computing them; a copy saving fewer tokens than this is not worth the
# bookkeeping.
KV_COPY_MIN_TOKENS = 4

S = TypeVar("S")


@dataclass(slots=True)
class Slot(Generic[S]):
    """One KV slot: ``slots[i].index == i`` in every list passed to this module."""

    index: int
    tokens: list[int] = field(default_factory=list)  # what the slot's KV holds
    seq: S | None = None  # the request decoding in it; None: the slot is free
    last_used: float = 0.0  # when its cached tokens were last written or reused

    @property
    def busy(self) -> bool:
        return self.seq is not None


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request goes and what its slot's KV stream is made of.

    The engine carries it out in this order: park (copy ``dest``'s stream into
    ``park_to``), then copy (``copy_from``'s stream into ``dest``), then drop
    ``dest``'s cells from position ``keep`` on. llama.cpp runs queued copies in order
    at the next decode, so ``dest`` is copied out before anything is copied into it.
    """

    dest: int
    """The free slot the request takes."""
    keep: int
    """Leading prompt tokens reused from ``dest``'s cache once any copy is in:
    ``dest``'s KV from this position on is dropped and the prompt is decoded from
    here. Always below ``len(prompt)``, so that at least one prompt token is decoded
    and gives logits for the first sample; 0 when prefixes are not reused."""
    source: int
    """The slot whose cache shares most of the prompt (the lowest index among ties,
    slot 0 when none shares anything). It may be ``dest`` itself, the copy source or
    neither; its ``last_used`` is refreshed together with ``dest``'s."""
    copy_from: int | None = None
    """The slot (free or running) whose cached cells are all copied into ``dest``,
    because its cache shares at least ``KV_COPY_MIN_TOKENS`` more of the prompt than
    ``dest``'s; None: no copy. When set it equals ``source``."""
    copy_tokens: int = 0
    """With a copy: how many leading tokens of ``copy_from``'s cache match the prompt,
    which is what ``dest`` is recorded to hold after the copy (before the cut to
    ``keep``); 0 without one."""
    park_to: int | None = None
    """The least recently used free slot that receives a copy of what ``dest``
    cached, before the prompt (or a copy) overwrites it; None: nothing is parked."""

    @property
    def copies(self) -> int:
        """KV streams copied to carry out this placement (parking and copy)."""
        return (self.park_to is not None) + (self.copy_from is not None)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_placement(
    slots: Sequence[Slot[S]],
    prompt: Sequence[int],
    *,
    pending: int = 0,
    fills: bool = False,
    reuse_prefix: bool = True,
    park: bool = True,
) -> Placement:
    """Give a request a free slot, reusing the longest cached prefix of its prompt.

    The slot is chosen to keep the running slots in few runs of consecutive ids:
    llama.cpp decodes each run in a pass of its own (see ``llamacpp/batch.py``), so
    a slot that opens a new run costs an extra pass on every step until the gap fills
    (measured here: 4 sequences in one run ~21 ms a step, in two ~32 ms). Among
    equally good slots, the one whose own cache shares most of the prompt wins, then
    the least recently used, then the lowest index; when this round ``fills`` every
    free slot there will be no gap to avoid, and only the cached prefix counts.
    (Least recently used first: what it caches is what parking would overwrite
    anyway. One stream whose prompts share a system prompt with every cached
    conversation so takes the oldest one's slot directly, instead of the lowest slot
    and a copy of that slot's cells into the oldest's on its first token's path, as
    llama-server's LRU slot choice does.)

    The prefix may be cached in another slot, free or running (the same system
    prompt, the previous turn of a chat). Copying that slot's cells into the chosen
    one costs far less than computing them (see ``KV_COPY_MIN_TOKENS``), so they are
    copied. For the same price, what the chosen slot held is first parked in the
    least recently used free slot, so that low slots taken again and again do not
    evict every other cached conversation; not when ``pending`` requests are about to
    take the free slots anyway (a burst of arrivals), where parking would overwrite
    prefixes they are about to reuse. See ``_park_target`` for when exactly.

    ``reuse_prefix`` is False when the prompt's own log probabilities are collected:
    they need logits of every prompt row, and a cached prefix would skip computing
    them. Then nothing is kept or copied (what ``dest`` held may still be parked).

    ``park`` False: never park in another slot (the engine parks what ``dest`` loses
    in host memory instead, :mod:`tokenmill.engines.llamacpp.hosttier`).

    Raises ``ValueError`` when no slot is free.
    """
    n = len(slots)
    busy = [slot.busy for slot in slots]
    shared = [common_prefix(slot.tokens, prompt) for slot in slots] if reuse_prefix else [0] * n

    def placement(i: int) -> tuple[int, int, float, int]:
        left = i > 0 and busy[i - 1]
        right = i + 1 < n and busy[i + 1]
        runs_added = 0 if fills else 1 - left - right  # +1 opens a run, -1 joins two
        return (runs_added, -shared[i], slots[i].last_used, i)

    free = [i for i in range(n) if not busy[i]]
    if not free:
        raise ValueError("no free slot")
    dest = min(free, key=placement)
    common = shared[dest]
    source = max(range(n), key=shared.__getitem__)
    source_common = shared[source]
    copy = source != dest and source_common >= common + KV_COPY_MIN_TOKENS
    park_to = None
    if (
        park and len(slots[dest].tokens) - common >= KV_COPY_MIN_TOKENS
    ):  # what the prompt will overwrite
        park_to = _park_target(slots, dest, avoid=source, pending=pending)
    if copy:
        common = source_common
    return Placement(
        dest=dest,
        # At least one prompt token must be decoded to get logits for the first sample.
        keep=min(common, len(prompt) - 1),
        source=source,
        copy_from=source if copy else None,
        copy_tokens=source_common if copy else 0,
        park_to=park_to,
    )


def _park_target(slots: Sequence[Slot[S]], dest: int, avoid: int, pending: int) -> int | None:
    """The least recently used free slot to copy what ``dest`` caches into, if older.

    None when (nearly) all of it, all but fewer than ``KV_COPY_MIN_TOKENS`` tokens,
    is cached in some other slot already; when the free slots other than ``dest`` and
    ``avoid`` (the copy source) are no more than the ``pending`` requests about to
    take them; or when the least recently used of them caches something used no
    earlier than what ``dest`` holds.
    """
    slot = slots[dest]
    others = [s for s in slots if s is not slot]
    held = len(slot.tokens) - KV_COPY_MIN_TOKENS
    if any(common_prefix(s.tokens, slot.tokens) >= held for s in others):
        return None  # (nearly) all of it is cached elsewhere already
    spare = [s for s in others if not s.busy and s.index != avoid]
    if len(spare) <= pending:
        return None
    park = min(spare, key=lambda s: (s.last_used, s.index))
    if park.tokens and park.last_used >= slot.last_used:
        return None
    return park.index


def apply_placement(
    slots: Sequence[Slot[S]],
    plan: Placement,
    seq: S,
    *,
    now: float,
    keep: int | None = None,
) -> None:
    """Record in ``slots`` what carrying out ``plan`` did to the KV streams.

    The parked slot takes what ``dest`` held and when it was last used; ``dest``
    takes the copied prefix, is cut to ``keep`` tokens (``plan.keep`` unless the
    engine had to clear the slot and keep none), and is occupied by ``seq``; ``dest``
    and ``plan.source`` count as used ``now``.
    """
    kept = plan.keep if keep is None else keep
    dest = slots[plan.dest]
    if plan.park_to is not None:
        park = slots[plan.park_to]
        park.tokens = list(dest.tokens)
        park.last_used = dest.last_used
    if plan.copy_from is not None:
        dest.tokens = slots[plan.copy_from].tokens[: plan.copy_tokens]
    del dest.tokens[kept:]
    dest.seq = seq
    dest.last_used = slots[plan.source].last_used = now
