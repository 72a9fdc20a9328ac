"""Bad input to the Responses and Messages APIs: a 400 naming the field, in each API's
own error format; stored responses that are not there are 404s; Anthropic's clients
authenticate with x-api-key."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
HI = [{"role": "user", "content": "hi"}]
FN = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
TOOL = {"name": "weather", "input_schema": {"type": "object"}}
ADMIN_KEY = "admin-key-for-agent-apis"


def openai_error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert r.headers.get("x-request-id")
    return dict(err)


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind
    message: str = body["error"]["message"]
    return message


def r(**fields: Any) -> dict[str, Any]:
    """A Responses request: ``input: "hi"`` and ``fields``."""
    return {"input": "hi", **fields}


def m(**fields: Any) -> dict[str, Any]:
    """A Messages request: ``max_tokens: 5``, one user message, and ``fields``."""
    return {"max_tokens": 5, "messages": HI, **fields}


U, V = "unsupported_parameter", "invalid_value"
IMAGE_PART = {"type": "input_image", "image_url": "x"}
ORPHAN_OUTPUT = {"type": "function_call_output", "call_id": "call_x", "output": "1"}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({}, "input", V),
        (r(max_output_tokens=0), "max_output_tokens", V),
        (r(temperature=3), "temperature", V),
        (r(input=[{"role": "wizard", "content": "x"}]), "input.0.role", V),
        (r(background=True), "background", U),
        (r(reasoning={"effort": "enormous"}), "reasoning.effort", V),
        (r(conversation="conv_1"), "conversation", U),
        (r(include=["message.output_text.logprobs"]), "include", U),
        (r(truncation="auto"), "truncation", U),
        (r(input=[{"type": "item_reference", "id": "msg_1"}]), "input.0.type", U),
        (r(input=[{"role": "user", "content": [IMAGE_PART]}]), "input.0.content.0.type", U),
        (r(text={"format": {"type": "json_schema"}}), "text.format", V),
        (r(tools=[{**FN, "name": "no spaces"}]), "tools.0.name", V),
        (r(input=[ORPHAN_OUTPUT]), "input", None),
    ],
)
def test_responses_bad_input_names_the_field(
    http: httpx.Client, body: dict[str, Any], param: str, code: str | None
) -> None:
    err = openai_error(http.post(RESPONSES, json=body), 400, param)
    if code is not None:
        assert err["code"] == code


def test_responses_unknown_previous_response_is_404(http: httpx.Client) -> None:
    r = http.post(RESPONSES, json={"input": "hi", "previous_response_id": "resp_nope"})
    err = openai_error(r, 404, "previous_response_id")
    assert err["code"] == "response_not_found"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/responses/resp_nope"),
        ("DELETE", "/v1/responses/resp_nope"),
        ("GET", "/v1/responses/resp_nope/input_items"),
    ],
)
def test_responses_not_stored_are_404(http: httpx.Client, method: str, path: str) -> None:
    err = openai_error(http.request(method, path), 404, None)
    assert err["code"] == "response_not_found"


def user(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(blocks)}]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": HI}, "max_tokens"),
        (m(max_tokens=0), "max_tokens"),
        (m(messages=[]), "messages"),
        (m(temperature=1.5), "temperature"),
        (m(messages=[{"role": "system", "content": "x"}]), "messages.0.role"),
        (m(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking.type"),
        (m(output_config={"effort": "enormous"}), "output_config.effort"),
        (m(context_management={"edits": [{"type": "compact_20260112"}]}), "edits.0.type"),
        (m(tool_choice={"type": "tool"}), "tool_choice"),
        (m(mcp_servers=[{"url": "x"}]), "mcp_servers"),
        (m(messages=user({"type": "image", "source": {}})), "messages.0.content.0.type"),
        (m(messages=user({"type": "tool_result", "tool_use_id": "x"})), "messages.0.content"),
        (m(messages=[*HI, {"role": "assistant", "content": "The"}]), "messages.1.role"),
        (m(tools=[{**TOOL, "name": "no spaces"}]), "tools.0.name"),
    ],
)
def test_messages_bad_input_is_anthropics_400_naming_the_field(
    http: httpx.Client, body: dict[str, Any], needle: str
) -> None:
    message = anthropic_error(http.post(MESSAGES, json=body), 400, "invalid_request_error")
    assert f"'{needle}'" in message or needle in message, message


def test_messages_errors_are_anthropics_everywhere(http: httpx.Client) -> None:
    r = http.post(MESSAGES, json={"model": "claude-nope", "max_tokens": 5, "messages": HI})
    assert "claude-nope" in anthropic_error(r, 404, "not_found_error")
    r = http.post(MESSAGES, content=b"{not json")
    anthropic_error(r, 400, "invalid_request_error")
    r = http.post("/v1/messages/count_tokens", json={"messages": []})
    anthropic_error(r, 400, "invalid_request_error")
    r = http.get(MESSAGES)  # a method the route does not take
    anthropic_error(r, 405, "invalid_request_error")


def test_sdks_raise_their_own_errors(server: ServerProcess) -> None:
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as bad:
            client.messages.create(model="smollm2", max_tokens=0, messages=[])
        assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as oai:
        with pytest.raises(openai.BadRequestError) as refused:
            oai.responses.create(model="smollm2", input="hi", background=True)
        assert refused.value.param == "background"
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve("resp_nope")


@pytest.fixture
def keyed(start_server: Callable[..., ServerProcess]) -> Iterator[tuple[ServerProcess, str]]:
    srv = start_server(env={"TOKENMILL_ADMIN_KEY": ADMIN_KEY})
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=srv.url, headers=admin, timeout=60) as client:
        account = client.post("/admin/accounts", json={"name": "a", "balance": 10**9}).json()
        key = client.post("/admin/keys", json={"account": account["id"]}).json()["key"]
    yield srv, key


def test_x_api_key_authenticates_and_errors_stay_anthropics(
    keyed: tuple[ServerProcess, str],
) -> None:
    srv, key = keyed
    body = {"messages": HI, "max_tokens": 0}
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        r = client.post(MESSAGES, json=body)
        assert "x-api-key" in anthropic_error(r, 401, "authentication_error")
        r = client.post(MESSAGES, json=body, headers={"x-api-key": "tm-wrong"})
        anthropic_error(r, 401, "authentication_error")
        # The key is accepted: the request gets as far as its bad max_tokens.
        r = client.post(MESSAGES, json=body, headers={"x-api-key": key})
        anthropic_error(r, 400, "invalid_request_error")
        r = client.get("/v1/responses/resp_nope", headers={"x-api-key": key})
        openai_error(r, 404, None)


def test_hosted_tools_are_refused_where_the_deployment_says(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> None:
    # hosted_tools = "refuse": the 400 naming the tool (the default leaves them out:
    # tests/server/test_agent_clis.py). Refused before the engine sees anything.
    srv = start_server(config=scripted_deployment(driver, hosted_tools="refuse"))
    fields = {"model": "scripted", "max_output_tokens": 5}
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        for tool in ({"type": "web_search"}, {"type": "file_search"}):
            response = client.post(RESPONSES, json=r(tools=[FN, tool], **fields))
            err = openai_error(response, 400, "tools.1.type")
            assert err["code"] == U
            assert tool["type"] in err["message"]
        server_tool = {"type": "web_search_20250305", "name": "web_search"}
        body = m(model="scripted", tools=[server_tool])
        message = anthropic_error(client.post(MESSAGES, json=body), 400, "invalid_request_error")
        assert "tools.0.type" in message and "web_search" in message
    with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0) as oai:
        with pytest.raises(openai.BadRequestError) as refused:
            oai.responses.create(model="scripted", input="hi", tools=[{"type": "web_search"}])
        assert refused.value.param == "tools.0.type"
    assert driver.seen("started") == 0
