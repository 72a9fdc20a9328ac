"""What agent clients send, served with the semantics their APIs define (issue #36):
mid-conversation system messages, thinking and effort on a model that does not
reason, Responses namespace tools and reasoning, hosted tools left out by default,
context edits, max_tokens past the window, and a call cut by max_output_tokens.

The scripted engine plays the model (:mod:`tests.driver`): what the model saw is the
``started`` event's prompt (turns as ``role: content`` lines, a word a token), and
what it says is the test's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.waiting import HANG_S
from tokenmill.chat.hosted import OMITTED_HEADER
from tokenmill.server.messages.context import PLACEHOLDER

FN = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
SPAWN = {
    "type": "function",
    "name": "spawn_agent",
    "description": "Start a sub-agent.",
    "parameters": {"type": "object", "properties": {"task": {"type": "string"}}},
}
NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [SPAWN],
}
TOOL = {"name": "read", "input_schema": {"type": "object"}}
CTX = 2000  # the scripted deployment's context, in words


@pytest.fixture
def scripted(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> Iterator[tuple[httpx.Client, EngineDriver]]:
    srv = start_server(config=scripted_deployment(driver, n_ctx=CTX))
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as client:
        yield client, driver


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> Future[httpx.Response]:
    """POST in the background: the test plays the model meanwhile."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(client.post, path, json={"model": "scripted", **body})
    pool.shutdown(wait=False)
    return future


def test_claude_codes_fields_on_a_model_that_does_not_reason(
    scripted: tuple[httpx.Client, EngineDriver],
) -> None:
    client, driver = scripted
    body = {
        "max_tokens": 32_000,  # past the window: served up to it
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "Answer in French."},
        ],
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "u-1"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    answer = post(client, "/v1/messages", body)
    started = driver.wait("started")
    # The system messages in their places, after the user's turn.
    assert started["prompt"].splitlines() == [
        "system: Be brief.",
        "user: hi",
        "system: Answer in French.",
    ]
    assert started["max_tokens"] == CTX - started["prompt_tokens"]
    driver.emit(started["id"], CTX)  # to the window
    r = answer.result(HANG_S)
    assert r.status_code == 200, r.text
    message = r.json()
    assert message["stop_reason"] == "model_context_window_exceeded"
    assert [b["type"] for b in message["content"]] == ["text"]  # no thinking blocks
    assert message["context_management"] == {"applied_edits": []}
    assert message["usage"]["output_tokens"] == started["max_tokens"]
    # One request, opened once: no refusal counted for it on the way to the window.
    lines = client.get("/metrics").text.splitlines()
    assert not [x for x in lines if x.startswith("tokenmill_request_errors_total{")]
    ended = [x for x in lines if x.startswith("tokenmill_request_success_total{")]
    assert [x.rsplit(" ", 1)[1] for x in ended] == ["1.0"], ended


def test_a_thinking_budget_is_refused_naming_the_model(
    scripted: tuple[httpx.Client, EngineDriver],
) -> None:
    client, driver = scripted
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = {
            "model": "scripted",
            "max_tokens": 100,
            "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        }
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "thinking.type" in message and "'scripted'" in message and "reason" in message
    assert driver.seen("started") == 0


def test_a_prompt_that_fills_the_window_is_refused_naming_messages(
    scripted: tuple[httpx.Client, EngineDriver],
) -> None:
    client, _ = scripted
    words = " ".join(["word"] * CTX)
    body = {"model": "scripted", "max_tokens": 5, "messages": [{"role": "user", "content": words}]}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("messages:")


def turns_with_tools(n: int) -> list[dict[str, Any]]:
    """``n`` exchanges of a ``read`` call and its result, each assistant turn with a
    thinking block (as a reasoning model's history has), then a question."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "read them"}]
    for i in range(n):
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "tool_use", "id": f"t{i}", "name": "read", "input": {"n": i}},
                ],
            }
        )
        text = f"result number {i}: " + " ".join(["line"] * 30)
        result = {"type": "tool_result", "tool_use_id": f"t{i}", "content": text}
        messages.append({"role": "user", "content": [result]})
    messages.append({"role": "user", "content": "and?"})
    return messages


def test_context_edits_clear_old_tool_results_and_thinking(
    scripted: tuple[httpx.Client, EngineDriver],
) -> None:
    client, driver = scripted
    edits = [
        {
            "type": "clear_tool_uses_20250919",
            "trigger": {"type": "tool_uses", "value": 2},
            "keep": {"type": "tool_uses", "value": 1},
        },
        {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
    ]
    management = {"edits": edits}
    body = {"messages": turns_with_tools(3), "tools": [TOOL], "context_management": management}
    counted = client.post("/v1/messages/count_tokens", json={"model": "scripted", **body})
    assert counted.status_code == 200, counted.text
    count = counted.json()
    original = count["context_management"]["original_input_tokens"]
    assert original > count["input_tokens"]
    answer = post(client, "/v1/messages", {"max_tokens": 5, **body})
    started = driver.wait("started")
    prompt = started["prompt"]
    assert prompt.count(PLACEHOLDER) == 2
    assert "result number 2" in prompt and "result number 0" not in prompt
    assert "hmm" not in prompt  # thinking never reaches the model
    assert started["prompt_tokens"] == count["input_tokens"]
    driver.say(started["id"], json.dumps({"response": "done"}))
    driver.finish(started["id"])
    r = answer.result(HANG_S)
    assert r.status_code == 200, r.text
    assert r.json()["context_management"] == {
        "applied_edits": [
            {
                "type": "clear_tool_uses_20250919",
                "cleared_tool_uses": 2,
                "cleared_input_tokens": original - count["input_tokens"],
            },
            {
                "type": "clear_thinking_20251015",
                "cleared_thinking_turns": 2,
                "cleared_input_tokens": 0,
            },
        ]
    }


def test_codex_fields_namespace_tools_and_hosted_tools_left_out(
    scripted: tuple[httpx.Client, EngineDriver],
) -> None:
    client, driver = scripted
    body = {
        "input": "spawn one",
        "tools": [FN, NAMESPACE, {"type": "web_search", "external_web_access": False}],
        "reasoning": {"summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "store": False,
        "client_metadata": {"session_id": "s"},
    }
    answer = post(client, "/v1/responses", body)
    started = driver.wait("started")
    assert "spawn_agent" in started["prompt"] and "web_search" not in started["prompt"]
    call = {"name": "spawn_agent", "arguments": {"task": "x"}}
    driver.say(started["id"], json.dumps({"tool_calls": [call]}))
    driver.finish(started["id"])
    r = answer.result(HANG_S)
    assert r.status_code == 200, r.text
    assert r.headers[OMITTED_HEADER] == "web_search"
    response = r.json()
    assert response["status"] == "completed"
    [item] = response["output"]
    assert item["type"] == "function_call" and item["status"] == "completed"
    assert (item["namespace"], item["name"]) == ("multi_agent_v1", "spawn_agent")
    assert json.loads(item["arguments"]) == {"task": "x"}
    assert response["reasoning"] == {"summary": "auto"}  # as asked, to no effect
    assert [t["type"] for t in response["tools"]] == ["function", "namespace"]


def test_a_function_call_cut_by_max_output_tokens_is_incomplete(
    scripted: tuple[httpx.Client, EngineDriver],
) -> None:
    client, driver = scripted
    body = {"input": "weather?", "tools": [FN], "max_output_tokens": 5, "stream": True}
    answer = post(client, "/v1/responses", body)
    started = driver.wait("started")
    # Cut after five words: the call's name is whole, its arguments are not.
    call = '{"tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}]}'
    driver.say(started["id"], call)
    r = answer.result(HANG_S)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [("function_call", "incomplete")]
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["output"][0]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_count_tokens_counts_a_prompt_longer_than_the_context(http: httpx.Client) -> None:
    # Far past the embedded model's default context (2,048 tokens, or its trained 8,192).
    text = " ".join(f"word{i}" for i in range(12_000))
    body = {"model": "smollm2", "messages": [{"role": "user", "content": text}]}
    r = http.post("/v1/messages/count_tokens", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["input_tokens"] > 12_000
    r = http.post("/v1/messages", json={**body, "max_tokens": 5})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("messages:")
