"""Tool calling through real clients: the openai SDK's stream helper, LangChain's
bind_tools and with_structured_output."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.conftest import ServerProcess
from tests.server.test_tools import CONVERT


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
