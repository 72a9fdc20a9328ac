"""What the llama.cpp engine publishes of its KV slots, against what they really hold.

The gateway routes by an index built from the engine's published block names
(``publish_cache``, :mod:`tokenmill.kvblocks`, :mod:`tokenmill.gateway.prefix`).
Here the index is fed every event of a real engine and, once the engine is idle,
compared with the block names of every slot's real tokens, after stores (a prompt and
its answer), extensions (the next-turn warm-up, a chat's next turn), parks (a slot's
cache copied away before a new prompt takes the slot, or into the host-memory tier,
published as lanes after the slots) and evictions (a slot taken by an unrelated
prompt).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.waiting import wait_until_async
from tokenmill.engines import ChatMessage, GenerationRequest, SamplingParams
from tokenmill.engines.llamacpp import LlamaCppEngine
from tokenmill.gateway.prefix import PrefixIndex
from tokenmill.kvblocks import BLOCK_TOKENS, BlockSnapshot, BlockUpdate, CacheEvent, chain

SLOTS = 3
SYSTEM = ChatMessage(
    "system",
    "You are the support assistant of a bicycle shop. Answer in one short sentence, "
    "name the part involved, and never promise a repair date.",
)


@pytest.fixture
async def engine() -> AsyncIterator[LlamaCppEngine]:
    eng = LlamaCppEngine(max_num_seqs=SLOTS, n_ctx=1024, n_threads=1)
    try:
        yield eng
    finally:
        await eng.close()


class Published:
    """The events an engine published, applied to a gateway's index on demand."""

    def __init__(self) -> None:
        self.events: list[CacheEvent] = []  # appended on the decode thread
        self.cut = 0  # updates that took blocks away from a slot

    def index(self) -> PrefixIndex:
        index = PrefixIndex()
        held: dict[int, int] = {}
        for event in list(self.events):
            if isinstance(event, BlockSnapshot):
                index.reset(0, event.slots, event.n_slots, event.disk)
                held = {i: len(names) for i, names in enumerate(event.slots)}
            else:
                assert isinstance(event, BlockUpdate)
                self.cut += event.kept < held.get(event.slot, 0)
                held[event.slot] = event.kept + len(event.added)
                index.update(0, event)
        return index


def real(engine: LlamaCppEngine) -> list[tuple[int, ...]]:
    return [tuple(chain(engine.slot_cache.tokens(i))) for i in range(engine.max_num_seqs)]


def parked(engine: LlamaCppEngine) -> set[tuple[int, ...]]:
    """The chains of the sequences the engine's host tier holds as a cache."""
    entries = list(engine._require().tier.entries.values())
    return {tuple(chain(e.tokens)) for e in entries if not e.pinned}


def on_disk(engine: LlamaCppEngine) -> list[tuple[int, ...]]:
    """The chains of the sequences the engine's disk tier holds as files."""
    disk = engine._require().disk
    return [] if disk is None else [tuple(chain(e.tokens)) for e in disk.tier.entries.values()]


def matches(engine: LlamaCppEngine, index: PrefixIndex) -> bool:
    """The index holds what the engine holds: every slot's chain, in order, then one
    lane a parked sequence or disk tier file (in any order; freed lanes are empty)."""
    chains, slots = index.chains(0), engine.max_num_seqs
    lanes = [c for c in chains[slots:] if c]
    held = [*parked(engine), *on_disk(engine)]
    return chains[:slots] == real(engine) and sorted(lanes) == sorted(held)


async def settled(engine: LlamaCppEngine, published: Published, what: str) -> None:
    """Until the index built from the events matches every slot's real contents."""
    await wait_until_async(
        lambda: engine.health().running == 0 and matches(engine, published.index()),
        f"the published cache to match the slots and the tier after {what}",
    )


async def chat(engine: LlamaCppEngine, rid: str, messages: list[ChatMessage]) -> str:
    request = GenerationRequest(
        rid, SamplingParams(max_tokens=6, temperature=0.0), messages=tuple(messages)
    )
    info = await engine.prepare(request)
    assert info.tokens is not None and len(info.tokens[0]) == info.prompt_tokens
    text = ""
    async for chunk in engine.generate(request):
        text += chunk.text
    return text


async def test_the_published_cache_follows_every_slot(engine: LlamaCppEngine) -> None:
    published = Published()
    engine.publish_cache(published.events.append)  # before start: a snapshot at start
    await engine.start()
    assert published.events[-1] == BlockSnapshot(((),) * SLOTS, n_slots=SLOTS)

    first = [SYSTEM, ChatMessage("user", "My chain keeps slipping on the largest cog.")]
    answer = await chat(engine, "store", first)
    await settled(engine, published, "a store")
    assert max(map(len, real(engine))) * BLOCK_TOKENS >= 32

    await wait_until_async(lambda: engine.warmups >= 1, "the next turn warmed up")
    await settled(engine, published, "the next-turn warm-up")
    second = [*first, ChatMessage("assistant", answer), ChatMessage("user", "And the brakes?")]
    await chat(engine, "extend", second)
    await settled(engine, published, "a next turn")

    copies = engine.kv_copies
    for i, topic in enumerate(["a flat tyre", "a loose saddle", "squeaky pedals", "rust"]):
        await chat(engine, f"other-{i}", [SYSTEM, ChatMessage("user", f"What about {topic}?")])
        await settled(engine, published, f"unrelated prompt {i}")
    # Slots were taken by other prompts (what they held went, blocks published away)
    # and caches were copied between slots (parked, or a shared system prompt).
    assert published.cut > 0
    assert engine.kv_copies > copies

    # The index answers what a prompt finds cached exactly as the slots do.
    tokens = (
        await engine.prepare(GenerationRequest("q", SamplingParams(1), messages=tuple(second)))
    ).tokens
    assert tokens is not None
    names = chain(tokens[0])
    held = [*real(engine), *parked(engine)]
    best = max(sum(1 for a, b in zip(names, c, strict=False) if a == b) for c in held)
    assert published.index().cached_blocks(names) == {0: best}
