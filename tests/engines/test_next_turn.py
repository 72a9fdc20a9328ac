"""A chat's next turn, computed while the person reads the answer.

Once a chat's answer has ended whole (EOS or max_tokens) and the engine has had
nothing to do for ``WARM_AFTER_S``, the answer's slot computes what the next request
of that conversation starts with beyond the answer: the answer's last token (at
max_tokens it was sampled, never decoded) and what the template writes before the next
user message. The next turn then finds all of it cached. Never while another request
runs: it would only slow that one down.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.waiting import wait_until_async
from tokenmill.engines import ChatMessage, GenerationRequest, SamplingParams, Usage
from tokenmill.engines.chat_template import next_user_turn
from tokenmill.engines.llamacpp import LlamaCppEngine

SYSTEM = ChatMessage("system", "You are a concise assistant.")
FIRST = ChatMessage("user", "Name three rivers of Europe.")


@pytest.fixture
async def engine() -> AsyncIterator[LlamaCppEngine]:
    eng = LlamaCppEngine(max_num_seqs=2)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.close()


async def chat(
    eng: LlamaCppEngine, rid: str, messages: list[ChatMessage], **sampling: object
) -> tuple[str, str | None, Usage]:
    params = SamplingParams(temperature=0.0, **sampling)  # type: ignore[arg-type]
    request = GenerationRequest(rid, params, messages=tuple(messages))
    await eng.prepare(request)
    text, reason, usage = "", None, None
    async for chunk in eng.generate(request):
        text += chunk.text
        if chunk.finish_reason is not None:
            reason, usage = chunk.finish_reason, chunk.usage
    assert usage is not None
    return text, reason, usage


def suffix_tokens(eng: LlamaCppEngine) -> int:
    vocab = eng.vocab
    text = next_user_turn(vocab.template or "", vocab.bos, vocab.eos)
    assert text == "<|im_end|>\n<|im_start|>user\n"  # SmolLM2's ChatML
    return len(vocab.tokenize(text, bos=False))


async def test_the_next_turn_is_cached_after_an_answer_cut_at_max_tokens(
    engine: LlamaCppEngine,
) -> None:
    answer, reason, first = await chat(engine, "t1", [SYSTEM, FIRST], max_tokens=12)
    assert reason == "length" and first.completion_tokens == 12
    await wait_until_async(lambda: engine.warmups == 1, "the next turn computed")

    history = [SYSTEM, FIRST, ChatMessage("assistant", answer)]
    _, _, second = await chat(
        engine, "t2", [*history, ChatMessage("user", "Thanks.")], max_tokens=4
    )
    # The whole first exchange (its last token too) and the template's next user
    # turn; without the warm-up the last answer token and those would be computed now.
    assert second.cached_tokens == first.prompt_tokens + 12 + suffix_tokens(engine)
    assert second.prompt_tokens > second.cached_tokens


async def test_the_next_turn_is_cached_after_an_answer_ended_by_eos(
    engine: LlamaCppEngine,
) -> None:
    answer, reason, first = await chat(engine, "e1", [SYSTEM, FIRST], max_tokens=200)
    assert reason == "stop"
    await wait_until_async(lambda: engine.warmups == 1, "the next turn computed")
    history = [SYSTEM, FIRST, ChatMessage("assistant", answer)]
    _, _, second = await chat(
        engine, "e2", [*history, ChatMessage("user", "Thanks.")], max_tokens=4
    )
    # The answer's last counted token is its end-of-sequence token, <|im_end|>: sampled,
    # never decoded, and the first token of the template's next user turn, so the
    # next prompt holds it once, as the turn's end.
    expected = first.prompt_tokens + first.completion_tokens - 1 + suffix_tokens(engine)
    assert second.cached_tokens == expected


async def test_no_warm_up_while_another_request_runs(engine: LlamaCppEngine) -> None:
    long = GenerationRequest(
        "long", SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True), prompt="Once"
    )
    await engine.prepare(long)
    stream = engine.generate(long)
    first = await anext(aiter(stream))  # running
    assert first.finish_reason is None
    _, reason, _ = await chat(engine, "short", [SYSTEM, FIRST], max_tokens=2)
    assert reason == "length"  # its warm-up is due, but "long" still runs
    async for chunk in stream:
        assert engine.warmups == 0
        if chunk.finish_reason is not None:
            assert chunk.finish_reason == "length"
    # Idle at last: now it is computed.
    await wait_until_async(lambda: engine.warmups == 1, "the next turn computed")


async def test_completions_and_stopped_answers_are_not_warmed(engine: LlamaCppEngine) -> None:
    request = GenerationRequest(
        "plain", SamplingParams(max_tokens=4, temperature=0.0), prompt="Name three rivers"
    )
    await engine.prepare(request)
    async for _ in engine.generate(request):
        pass
    # The decode thread plans a warm-up before it sends the last chunk: none here.
    assert engine.slot_cache.warm_up is None
    # An answer a stop string cut: the client sends back text the cache does not hold.
    _, reason, _ = await chat(engine, "s", [SYSTEM, FIRST], max_tokens=40, stop=(" ",))
    assert reason == "stop"
    assert engine.slot_cache.warm_up is None
    assert engine.warmups == 0
    # A chat's answer, for contrast: planned (or, on a slow machine, already done).
    await chat(engine, "c", [SYSTEM, FIRST], max_tokens=2)
    assert engine.slot_cache.warm_up is not None or engine.warmups == 1
