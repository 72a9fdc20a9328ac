"""Tool calling over HTTP against the real model (SmolLM2, whose template knows no
tools: the generic format, constrained by a JSON schema)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import pytest

from tests.conftest import ServerProcess
from tests.sse import to_done
from tokenmill.chat.tools import describe_tools
from tokenmill.server.openai.replies import ChatCompletion, ChatCompletionChunk
from tokenmill.server.openai.tools import Tool


@pytest.fixture(scope="module")
def server(stable_server: ServerProcess) -> ServerProcess:
    """Streamed tool calls are compared with the whole body's token for token:
    the KV-stream-a-slot server (conftest.stable_server)."""
    return stable_server


CHAT = "/v1/chat/completions"

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
BOOKING: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "book_table",
        "description": "Book a table at a restaurant",
        "parameters": {
            "type": "object",
            "properties": {
                "restaurant": {"type": "string", "minLength": 1},
                "guests": {"type": "integer", "minimum": 1, "maximum": 12},
                "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                "requests": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                "contact": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "phone": {"type": "string"}},
                    "required": ["name"],
                },
            },
            "required": ["restaurant", "guests", "time"],
        },
    },
}
CONVERT: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "convert_currency",
        "description": "Convert an amount of money from one currency to another",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "exclusiveMinimum": 0},
                "from": {"type": "string", "enum": ["EUR", "USD", "GBP", "JPY"]},
                "to": {"type": "string", "enum": ["EUR", "USD", "GBP", "JPY"]},
            },
            "required": ["amount", "from", "to"],
        },
    },
}
NO_ARGS: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "description": "The current time"},
}
TOOLS = {t["function"]["name"]: t for t in (WEATHER, BOOKING, CONVERT, NO_ARGS)}


def ask(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 96,
        "temperature": 0,
        "seed": 7,
        **extra,
    }


def answer(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    ChatCompletion.model_validate(data)  # the shape the OpenAPI document declares
    return data


def warm(http: httpx.Client, body: dict[str, Any]) -> None:
    """Read ``body``'s prompt once, so that the two answers compared after it both find
    it cached and read only its last token. A prompt read whole and one found cached
    differ in the last digits (a one-row step against a many-row one), in llama-server
    as here, and greedy parts where two tokens nearly tie; where the cached cells sit
    still moves the last digits (docs/exactness.md), so these comparisons keep to
    prompts whose answers lead clearly."""
    answer(http, {**body, "max_tokens": 1})


def stream(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", CHAT, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read().decode()
        chunks = to_done(r)
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    return chunks


def check_call(call: dict[str, Any], tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A call's arguments parse and validate against its tool's schema; its arguments."""
    assert call["type"] == "function"
    assert call["id"].startswith("call_")
    offered = {t["function"]["name"]: t for t in tools}
    name = call["function"]["name"]
    assert name in offered
    args = json.loads(call["function"]["arguments"])
    schema = offered[name]["function"].get("parameters") or {"type": "object"}
    jsonschema.validate(args, schema)
    assert isinstance(args, dict)
    return args


def reassemble(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed choice 0 put back together, checking OpenAI's delta shape on the way."""
    content = ""
    calls: list[dict[str, Any]] = []
    reasons = []
    for c in chunks:
        for choice in c["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                if "id" in tc:  # a new call: id, type and name once, arguments ""
                    assert tc["index"] == len(calls)
                    assert tc["type"] == "function"
                    assert tc["function"]["arguments"] == ""
                    calls.append(
                        {"id": tc["id"], "type": "function", "function": {**tc["function"]}}
                    )
                else:  # then only its index and an arguments fragment
                    assert set(tc) == {"index", "function"}
                    assert set(tc["function"]) == {"arguments"}
                    assert tc["function"]["arguments"]
                    calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
            if choice["finish_reason"] is not None:
                reasons.append(choice["finish_reason"])
    assert len(reasons) == 1
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    return {"message": message, "finish_reason": reasons[0]}


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    calls = [{**c, "id": None} for c in message.get("tool_calls") or []]
    return {**message, "tool_calls": calls, "content": message["content"] or None}


REQUIRED_CASES = [
    ("What's the weather like in Lisbon?", [WEATHER]),
    ("Book a table for four at Chez Anna at 19:30, by the window.", [BOOKING]),
    ("How many yen is 250 euros?", [CONVERT, WEATHER]),
    ("What time is it?", [NO_ARGS, WEATHER]),
    (
        "Plan my evening: dinner for two at Sakura, then check the weather in Osaka.",
        list(TOOLS.values()),
    ),
]


@pytest.mark.parametrize(("text", "tools"), REQUIRED_CASES)
def test_required_always_calls_with_valid_arguments(
    http: httpx.Client, text: str, tools: list[dict[str, Any]]
) -> None:
    # Sampled, not greedy: whatever the model draws, the call is well formed.
    for seed, parallel in [(0, False), (1, False), (2, True), (3, True)]:
        body = ask(
            text,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=parallel,
            temperature=1.0,
            seed=seed,
            max_tokens=256,
        )
        choice = answer(http, body)["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert choice["message"]["content"] is None
        assert calls
        if choice["finish_reason"] == "length":
            # A small model at temperature 1 may call on and on, or run one argument
            # on (a run of 256 tokens inside one string was seen): max_tokens cuts the
            # last call short, and the ones before it are whole.
            calls = calls[:-1]
        else:
            assert choice["finish_reason"] == "tool_calls", choice
        assert parallel or len(calls) <= 1
        for call in calls:
            check_call(call, tools)


def test_streamed_call_reassembles_to_the_non_streamed_one(http: httpx.Client) -> None:
    body = ask(
        "Book a table for 3 people at Luigi's at 20:00 under the name Ada.",
        tools=[WEATHER, BOOKING],
        tool_choice="required",
        stream_options={"include_usage": True},
    )
    warm(http, body)
    whole = answer(http, body)
    chunks = stream(http, body)
    got = reassemble(chunks)
    assert got["finish_reason"] == whole["choices"][0]["finish_reason"] == "tool_calls"
    assert without_ids(got["message"]) == without_ids(whole["choices"][0]["message"])
    fragments = [
        tc
        for c in chunks
        for ch in c["choices"]
        for tc in ch["delta"].get("tool_calls") or []
        if "id" not in tc
    ]
    assert len(fragments) > 3, "arguments stream as they are generated"
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"]
    for call in got["message"]["tool_calls"]:
        check_call(call, [WEATHER, BOOKING])


def test_named_tool_choice_calls_that_tool(http: httpx.Client) -> None:
    tools = [WEATHER, CONVERT, BOOKING]
    choice = {"type": "function", "function": {"name": "convert_currency"}}
    data = answer(http, ask("Is it raining in Oslo?", tools=tools, tool_choice=choice))
    calls = data["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["convert_currency"]
    check_call(calls[0], tools)
    assert data["choices"][0]["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_makes_one_call(http: httpx.Client) -> None:
    text = "What is the weather in Paris, in London and in Rome?"
    data = answer(
        http, ask(text, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    )
    calls = data["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1
    check_call(calls[0], [WEATHER])


@pytest.mark.parametrize(
    "text",
    ["What's the weather in Paris?", "Tell me a joke about cats.", "Convert 10 USD to EUR."],
)
def test_auto_answers_or_calls(http: httpx.Client, text: str) -> None:
    tools = [WEATHER, CONVERT]
    body = ask(text, tools=tools)  # tool_choice defaults to auto
    whole = answer(http, body)["choices"][0]
    if whole["message"].get("tool_calls"):
        assert whole["message"]["content"] is None
        calls = whole["message"]["tool_calls"]
        # A small model may go on calling until max_tokens cuts the last call short.
        assert whole["finish_reason"] in ("tool_calls", "length")
        if whole["finish_reason"] == "length":
            calls = calls[:-1]
        for call in calls:
            check_call(call, tools)
    else:
        assert whole["finish_reason"] in ("stop", "length")
        assert isinstance(whole["message"]["content"], str)
        assert "tool_calls" not in whole["message"]
        assert not whole["message"]["content"].lstrip().startswith('{"response"')
    # Streamed, the answer is either too. (Not compared with the one above: with the
    # answer branch in the grammar, greedy decoding on this build is not the same from
    # one request to the next.)
    got = reassemble(stream(http, body))
    if got["message"].get("tool_calls"):
        assert got["finish_reason"] in ("tool_calls", "length")
        assert got["message"]["content"] is None
    else:
        assert got["finish_reason"] in ("stop", "length") and got["message"]["content"]


def test_tool_choice_none_is_plain_text(http: httpx.Client) -> None:
    data = answer(http, ask("What's the weather in Paris?", tools=[WEATHER], tool_choice="none"))
    choice = data["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")


def test_cut_by_max_tokens_is_length(http: httpx.Client) -> None:
    body = ask("Book a table for two at Nora's at 18:00.", tools=[BOOKING], tool_choice="required")
    body["max_tokens"] = 24  # past the name, not to the end of the arguments
    choice = answer(http, body)["choices"][0]
    assert choice["finish_reason"] == "length"
    calls = choice["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "book_table"
    assert reassemble(stream(http, body))["finish_reason"] == "length"


def test_a_call_and_its_result_round_trip(http: httpx.Client) -> None:
    history = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc123",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc123", "content": "18 degrees, sunny"},
    ]
    first = answer(http, ask("What's the weather in Paris?", tools=[WEATHER]))
    body = ask("", tools=[WEATHER])
    body["messages"] = history
    data = answer(http, body)
    choice = data["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    for call in choice["message"].get("tool_calls") or []:
        check_call(call, [WEATHER])
    # The earlier call and its result are part of the prompt (and of its price).
    assert data["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] + 10
    # Without tools, the exchange is still rendered (a follow-up the client sends
    # without repeating its tools).
    plain = answer(http, {**body, "tools": None})
    assert plain["choices"][0]["message"]["content"]


def test_the_tool_descriptions_are_prompt_tokens(http: httpx.Client) -> None:
    tools = [WEATHER, CONVERT]
    data = answer(http, ask("Hello!", tools=tools, max_tokens=4))
    described = describe_tools(
        [Tool.model_validate(t).function_tool() for t in tools],
        answer=True,
        parallel=True,
        named=None,
    )
    r = http.post(
        "/tokenize",
        json={
            "model": "smollm2",
            "messages": [
                {"role": "system", "content": described},
                {"role": "user", "content": "Hello!"},
            ],
        },
    )
    assert r.status_code == 200, r.text
    assert data["usage"]["prompt_tokens"] == r.json()["count"]


def test_several_choices_each_call(http: httpx.Client) -> None:
    body = ask("Weather in Madrid?", tools=[WEATHER], tool_choice="required", n=2, temperature=1)
    data = answer(http, body)
    assert [c["index"] for c in data["choices"]] == [0, 1]
    for choice in data["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        check_call(choice["message"]["tool_calls"][0], [WEATHER])


def test_predict_endpoints_call_tools(http: httpx.Client) -> None:
    body = ask("Weather in Berlin?", tools=[WEATHER], tool_choice="required")
    warm(http, body)
    r = http.post("/v1/deployments/smollm2/predict", json=body)
    assert r.status_code == 200, r.text
    whole = r.json()["choices"][0]
    check_call(whole["message"]["tool_calls"][0], [WEATHER])
    with http.stream(
        "POST", "/v1/deployments/smollm2/predictWithResponseStream", json=body
    ) as resp:
        assert resp.status_code == 200
        got = reassemble(to_done(resp))
    assert without_ids(got["message"]) == without_ids(whole["message"])
    # On the completion route, tools have no meaning: a 400 naming them.
    r = http.post(
        "/v1/deployments/smollm2/predict",
        json={"prompt": "Weather in Berlin?", "tools": [WEATHER], "endpoint_type": "completion"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools.0.type"),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools.0.function.name",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools.0.function.parameters",
        ),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"logprobs": True}, "logprobs"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": 7}}},
                        },
                    }
                ]
            },
            "tools",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    http: httpx.Client, change: dict[str, Any], param: str
) -> None:
    body = {**ask("Weather in Rome?", tools=[WEATHER]), **change}
    r = http.post(CHAT, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_tools_refused_on_completions(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hi", "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_an_upstream_deployment_forwards_tools_and_relays_its_calls(
    server: ServerProcess, http: httpx.Client, start_server: Callable[..., ServerProcess]
) -> None:
    # The upstream is the test session's tokenmill: its answers are known.
    config = f"""
[[deployments]]
id = "proxied"
engine = "upstream"
url = "{server.base_url}"
upstream_model = "smollm2"
"""
    srv = start_server(config=config)
    body = ask("Convert 75 EUR to JPY.", tools=[CONVERT, WEATHER], tool_choice="required")
    warm(http, body)
    direct = answer(http, body)["choices"][0]
    with httpx.Client(base_url=srv.url, timeout=120) as proxied:
        relayed = answer(proxied, {**body, "model": "proxied"})["choices"][0]
        streamed = reassemble(stream(proxied, {**body, "model": "proxied"}))
        assert relayed["finish_reason"] == streamed["finish_reason"] == "tool_calls"
        assert without_ids(relayed["message"]) == without_ids(direct["message"])
        assert without_ids(streamed["message"]) == without_ids(direct["message"])
        # The upstream's own call ids come through.
        assert relayed["message"]["tool_calls"][0]["id"].startswith("call_")
        # A call and its result go back as they are, and the upstream renders them.
        call = relayed["message"]["tool_calls"][0]
        history = [
            *body["messages"],
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "11,800 JPY"},
        ]
        follow = {**body, "messages": history, "tool_choice": "auto"}
        # Compared with a direct request that, like the relayed one, finds the prompt in
        # the upstream's prefix cache (computed whole, a near tie can flip under greedy).
        answer(http, follow)
        again = answer(proxied, {**follow, "model": "proxied"})["choices"][0]["message"]
        assert without_ids(again) == without_ids(answer(http, follow)["choices"][0]["message"])
        metrics = proxied.get("/metrics").text
    # Each of the three requests had its first token measured (calls count as output).
    count = 'tokenmill_time_to_first_token_seconds_count{deployment="proxied"}'
    assert f"{count} 3.0" in metrics, [m for m in metrics.splitlines() if "_count" in m]


def test_the_answer_beside_tools_follows_the_response_format(http: httpx.Client) -> None:
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        # Closed: with room for properties of its own, SmolLM2 may add them until
        # max_tokens (a "description" that repeats itself, seen under load).
        "additionalProperties": False,
    }
    body = ask(
        "Describe a made-up person.",
        tools=[WEATHER],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": person}},
    )
    choice = answer(http, body)["choices"][0]
    if choice["message"].get("tool_calls"):
        for call in choice["message"]["tool_calls"][
            : -1 if choice["finish_reason"] == "length" else None
        ]:
            check_call(call, [WEATHER])
    else:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), person)
