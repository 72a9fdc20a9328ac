"""Tool calling over HTTP against the real model (SmolLM2, whose template knows no
tools: the generic format, constrained by a JSON schema)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import ServerProcess
from tests.sse import to_done
from tokenmill.server.protocol import ChatCompletion, ChatCompletionChunk
from tokenmill.server.tool_protocol import Tool
from tokenmill.server.tools import describe_tools

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
        if parallel and choice["finish_reason"] == "length":
            # A small model may call on and on: max_tokens cuts the last call short.
            calls = calls[:-1]
        else:
            assert choice["finish_reason"] == "tool_calls", choice
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            check_call(call, tools)


def test_streamed_call_reassembles_to_the_non_streamed_one(http: httpx.Client) -> None:
    body = ask(
        "Book a table for 3 people at Luigi's at 20:00 under the name Ada.",
        tools=[WEATHER, BOOKING],
        tool_choice="required",
        stream_options={"include_usage": True},
    )
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
        [Tool.model_validate(t) for t in tools], answer=True, parallel=True, named=None
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
        again = answer(proxied, {**follow, "model": "proxied"})["choices"][0]["message"]
        assert without_ids(again) == without_ids(answer(http, follow)["choices"][0]["message"])


# A chat template that knows tools (Hermes' markup, as Qwen's): SmolLM2's own with
# the tools, calls and results written the way Qwen 2.5's template writes them.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments
within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls is defined %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% if not loop.last %}

{% endif %}{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""


def test_a_template_that_knows_tools_renders_them_and_its_markup_is_read(
    http: httpx.Client,
) -> None:
    tools = [WEATHER, CONVERT]
    body = ask(
        "What is the weather in Kyoto?",
        tools=tools,
        tool_choice="required",
        chat_template=HERMES_TEMPLATE,
    )
    whole = answer(http, body)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    for call in choice["message"]["tool_calls"]:
        check_call(call, tools)
    got = reassemble(stream(http, body))
    assert without_ids(got["message"]) == without_ids(choice["message"])
    # The template wrote the tools into the prompt.
    bare = answer(http, {**body, "tools": None, "tool_choice": None, "max_tokens": 1})
    assert whole["usage"]["prompt_tokens"] > bare["usage"]["prompt_tokens"] + 50
    # A named function: one call of it, in the markup.
    named = {"type": "function", "function": {"name": "convert_currency"}}
    calls = answer(http, {**body, "tool_choice": named})["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["convert_currency"]
    check_call(calls[0], tools)


def test_a_template_that_knows_tools_renders_calls_and_results(http: httpx.Client) -> None:
    call = {
        "id": "call_k1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Kyoto"}'},
    }
    history = [
        {"role": "user", "content": "What is the weather in Kyoto?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_k1", "content": "light rain, 14 degrees"},
    ]
    body = ask("", tools=[WEATHER], chat_template=HERMES_TEMPLATE)
    first = answer(http, {**body, "messages": history[:1]})
    data = answer(http, {**body, "messages": history})
    choice = data["choices"][0]
    # auto: SmolLM2 writes no markup of its own, so it answers in text, and no tag
    # reaches the content.
    assert "<tool_call>" not in (choice["message"]["content"] or "")
    assert data["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] + 20


def test_a_template_markup_and_a_response_format_are_not_both_asked(
    http: httpx.Client,
) -> None:
    body = ask("Hi", tools=[WEATHER], chat_template=HERMES_TEMPLATE)
    r = http.post(CHAT, json={**body, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_the_answer_beside_tools_follows_the_response_format(http: httpx.Client) -> None:
    person = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
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


# -- real clients -----------------------------------------------------------------------


def chat_openai(server: ServerProcess) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=server.base_url,
        api_key="unused",  # type: ignore[arg-type]
        model="smollm2",
        max_tokens=96,  # type: ignore[call-arg]
        temperature=0,
        max_retries=0,
    )


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


def test_openai_sdk_stream_accumulates_to_the_same_call(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Convert 120 GBP to USD."}],
        "tools": [CONVERT],
        "tool_choice": "required",
        "temperature": 0,
        "seed": 3,
        "max_tokens": 96,
    }
    whole = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as s:
        final = s.get_final_completion()
    a, b = whole.choices[0], final.choices[0]
    assert a.finish_reason == b.finish_reason == "tool_calls"
    assert a.message.tool_calls and b.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in a.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in b.message.tool_calls
    ]


def test_langchain_bind_tools(server: ServerProcess) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return f"sunny in {city}"

    llm = chat_openai(server)
    bound = llm.bind_tools([get_weather], tool_choice="required")
    question = HumanMessage("What's the weather in Vienna?")
    reply = bound.invoke([question])
    assert isinstance(reply, AIMessage) and reply.tool_calls
    call = reply.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    # Streamed: the chunks add up to the same call.
    total: Any = None
    for chunk in bound.stream([question]):
        total = chunk if total is None else total + chunk
    assert total is not None and [(c["name"], c["args"]) for c in total.tool_calls] == [
        (call["name"], call["args"])
    ]
    # The tool's result goes back, and the model carries on from it.
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    follow = llm.bind_tools([get_weather]).invoke([question, reply, result])
    assert isinstance(follow, AIMessage)
    assert follow.content or follow.tool_calls


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(server: ServerProcess, method: str) -> None:
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """Someone mentioned in the text."""

        name: str
        age: int = Field(ge=0, le=150)
        city: str

    llm = chat_openai(server)
    # By a named tool (function_calling) or by response_format (json_schema).
    structured = llm.with_structured_output(Person, method=method)
    person = structured.invoke("Maria is 34 years old and lives in Porto.")
    assert isinstance(person, Person)
