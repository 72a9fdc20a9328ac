"""The official openai (Responses API), anthropic (Messages API) and openai-agents
packages, unchanged, against a real gateway and the real model.

The model is greedy here (temperature 0), so a streamed answer and an unstreamed one
to the same request are the same answer. It is a 135M model: tests that need a tool
call force one (``tool_choice`` required / any) and check the protocol's round trip,
not the model's judgement.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import agents
import anthropic
import httpx
import openai
import pytest
from anthropic.types import ToolParam as AnthropicTool
from openai.types.responses import FunctionToolParam, ResponseFunctionToolCall

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment


@pytest.fixture(scope="module")
def server(stable_server: ServerProcess) -> ServerProcess:
    """Streamed answers are compared with whole ones token for token:
    the KV-stream-a-slot server (conftest.stable_server)."""
    return stable_server


MODEL = "smollm2"
GREEDY = {"temperature": 0}
WEATHER: FunctionToolParam = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
ANTHROPIC_WEATHER: AnthropicTool = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER["parameters"],  # type: ignore[typeddict-item]
}
ASK = "What is the weather in Paris?"


@pytest.fixture
def oai(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
def claude(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as c:
        yield c


def receipt(server: ServerProcess, request_id: str) -> dict[str, Any]:
    r = httpx.get(f"{server.base_url}/usage/{request_id}", timeout=60)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


# -- the Responses API ----------------------------------------------------------------


def test_responses_streamed_equals_unstreamed(oai: openai.OpenAI) -> None:
    kwargs: Any = {
        "model": MODEL,
        "input": "Name a colour.",
        "max_output_tokens": 12,
        "temperature": 0,
    }
    whole = oai.responses.create(**kwargs)
    events = list(oai.responses.create(**kwargs, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    streamed = last.response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert whole.output_text
    assert "".join(deltas) == streamed.output_text == whole.output_text
    assert streamed.status == whole.status
    assert streamed.usage is not None and whole.usage is not None
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert streamed.usage.input_tokens == whole.usage.input_tokens


def test_responses_max_output_tokens_is_strict_and_billed_exactly(
    oai: openai.OpenAI, server: ServerProcess
) -> None:
    raw = oai.responses.with_raw_response.create(
        model=MODEL, input="Tell me a long story.", max_output_tokens=5, temperature=0
    )
    response = raw.parse()
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 5
    bill = receipt(server, raw.headers["x-request-id"])
    assert bill["completion_tokens"] == 5
    assert bill["prompt_tokens"] == response.usage.input_tokens


def test_responses_json_schema(oai: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = oai.responses.create(
        model=MODEL,
        input="Invent a person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
        max_output_tokens=60,
        temperature=0,
    )
    assert response.status == "completed"
    person = json.loads(response.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_function_call_round_trip_through_previous_response_id(
    oai: openai.OpenAI,
) -> None:
    first = oai.responses.create(
        model=MODEL,
        input=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    calls = [o for o in first.output if isinstance(o, ResponseFunctionToolCall)]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    assert first.status == "completed"
    second = oai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "21C"}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=30,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert second.output_text
    # The stored conversation: the question, the call, its output, newest first.
    items = oai.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert oai.responses.retrieve(second.id).output_text == second.output_text
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)


def test_store_false_is_not_stored(oai: openai.OpenAI) -> None:
    response = oai.responses.create(
        model=MODEL, input="Hi.", store=False, max_output_tokens=3, temperature=0
    )
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(response.id)


# -- Anthropic's Messages API ---------------------------------------------------------


def test_messages_streamed_equals_unstreamed(claude: anthropic.Anthropic) -> None:
    kwargs: Any = {
        "model": MODEL,
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "extra_body": GREEDY,
    }
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    (answer,) = whole.content
    (streamed_answer,) = streamed.content
    assert answer.type == streamed_answer.type == "text"
    assert text == answer.text == streamed_answer.text
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    # The prompt is the same; how much of it the replica had cached may differ.
    assert streamed.usage.input_tokens + (
        streamed.usage.cache_read_input_tokens or 0
    ) == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


def test_messages_max_tokens_is_strict_and_billed_exactly(
    claude: anthropic.Anthropic, server: ServerProcess
) -> None:
    raw = claude.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=5,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        extra_body=GREEDY,
    )
    message = raw.parse()
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5
    bill = receipt(server, raw.headers["x-request-id"])
    assert bill["completion_tokens"] == 5
    prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert bill["prompt_tokens"] == prompt
    counted = claude.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}]
    )
    assert counted.input_tokens == prompt


def test_messages_stop_sequence_is_reported(claude: anthropic.Anthropic) -> None:
    ask: Any = {
        "model": MODEL,
        "max_tokens": 30,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "extra_body": GREEDY,
    }
    (whole,) = claude.messages.create(**ask).content
    assert whole.type == "text"
    words = whole.text.split()
    assert len(words) >= 4, whole.text
    stop = words[2]  # a word the greedy answer reaches after some text
    expected = whole.text[: whole.text.index(stop)]
    stopped = claude.messages.create(**ask, stop_sequences=[stop, "never said"])
    with claude.messages.stream(**ask, stop_sequences=["never said", stop]) as stream:
        streamed_text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    for message in (stopped, streamed):
        assert message.stop_reason == "stop_sequence"
        assert message.stop_sequence == stop
        (block,) = message.content
        assert isinstance(block, anthropic.types.TextBlock) and block.text == expected
    assert streamed_text == expected
    # Ended by end of sequence or max_tokens, nothing names a stop sequence.
    plain = claude.messages.create(**ask, stop_sequences=["never said"])
    assert plain.stop_reason in ("end_turn", "max_tokens") and plain.stop_sequence is None


def test_a_scripted_stop_sequence_crosses_the_replica_frames(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> None:
    # The scripted engine runs in a replica process: its final chunk, naming the stop
    # string, reaches the gateway in a chunks frame.
    srv = start_server(config=scripted_deployment(driver))
    ask: Any = {
        "model": "scripted",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "Count words."}],
        "stop_sequences": ["STOP", "END"],
    }
    with (
        anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0) as client,
        ThreadPoolExecutor(1) as pool,
    ):

        def streamed() -> anthropic.types.Message:
            with client.messages.stream(**ask) as stream:
                return stream.get_final_message()

        asks: list[Callable[[], anthropic.types.Message]] = [
            lambda: client.messages.create(**ask),
            streamed,
        ]
        for count, send in enumerate(asks, 1):
            pending = pool.submit(send)
            rid = str(driver.wait("started", count=count)["id"])
            driver.emit(rid, 2)
            driver.finish(rid, stop="END")
            message = pending.result(timeout=120)
            assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
            (block,) = message.content
            assert isinstance(block, anthropic.types.TextBlock) and block.text == " w1 w2"
            assert message.usage.output_tokens == 2


def test_count_tokens_counts_tools_and_calls_as_billed(
    claude: anthropic.Anthropic, server: ServerProcess
) -> None:
    ask: Any = {"role": "user", "content": ASK}
    one_call = {"type": "any", "disable_parallel_tool_use": True}
    tools: Any = {"tools": [ANTHROPIC_WEATHER], "tool_choice": one_call}
    first = claude.messages.with_raw_response.create(
        model=MODEL, max_tokens=40, messages=[ask], extra_body=GREEDY, **tools
    )
    message = first.parse()
    (use,) = [b for b in message.content if b.type == "tool_use"]
    counted = claude.messages.count_tokens(model=MODEL, messages=[ask], **tools)
    bill = receipt(server, first.headers["x-request-id"])
    assert counted.input_tokens == bill["prompt_tokens"]
    assert counted.input_tokens == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0
    )
    # The tool's definition is in the prompt: without it, fewer tokens.
    bare = claude.messages.count_tokens(model=MODEL, messages=[ask])
    assert bare.input_tokens < counted.input_tokens
    # A conversation with the call and its result: counted as the next turn is billed.
    result: Any = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21C"}],
    }
    turns: Any = [ask, {"role": "assistant", "content": message.content}, result]
    after: Any = {"tools": [ANTHROPIC_WEATHER], "tool_choice": {"type": "none"}}
    second = claude.messages.with_raw_response.create(
        model=MODEL, max_tokens=5, messages=turns, extra_body=GREEDY, **after
    )
    recount = claude.messages.count_tokens(model=MODEL, messages=turns, **after)
    assert recount.input_tokens == receipt(server, second.headers["x-request-id"])["prompt_tokens"]
    asked = claude.messages.count_tokens(model=MODEL, messages=[ask], **after)
    assert recount.input_tokens > asked.input_tokens


def test_tool_use_tool_result_round_trip(claude: anthropic.Anthropic) -> None:
    ask: Any = {"role": "user", "content": ASK}
    first = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[ask],
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city"}
    result: Any = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21C"}],
    }
    second = claude.messages.create(
        model=MODEL,
        max_tokens=30,
        tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "none"},
        messages=[ask, {"role": "assistant", "content": first.content}, result],
        extra_body=GREEDY,
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.content and all(b.type == "text" for b in second.content)


def test_messages_streamed_tool_use(claude: anthropic.Anthropic) -> None:
    kwargs: Any = {
        "model": MODEL,
        "max_tokens": 60,
        "tools": [ANTHROPIC_WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": ASK}],
        "extra_body": GREEDY,
    }
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == [
        (b.type, getattr(b, "input", None)) for b in whole.content
    ]


# -- the OpenAI Agents SDK ------------------------------------------------------------


@pytest.fixture
async def agents_client(server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    agents.set_tracing_disabled(True)  # no export to OpenAI's platform
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


async def test_agents_sdk_runs_an_agent_with_a_tool(agents_client: openai.AsyncOpenAI) -> None:
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return "21C and sunny"

    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather. Use the tool.",
        tools=[get_weather],
        # The first turn must call the tool; the SDK then resets tool_choice, so
        # the second turn answers.
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=agents_client),
        model_settings=agents.ModelSettings(
            tool_choice="required", temperature=0, max_tokens=40, parallel_tool_calls=False
        ),
    )
    result = await agents.Runner.run(agent, ASK, max_turns=4)
    assert len(asked) == 1
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, str) and result.final_output
