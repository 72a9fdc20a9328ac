"""Every bad input gets a clear OpenAI-format error, never a 500, and the server keeps serving."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    assert r.headers.get("x-request-id")
    return dict(err)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": HI, "max_tokens": -1}, "max_tokens"),
        (CHAT, {"messages": HI, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": HI, "max_tokens": "ten"}, "max_tokens"),
        (CHAT, {"messages": HI, "temperature": "hot"}, "temperature"),
        (CHAT, {"messages": HI, "temperature": 7}, "temperature"),
        (CHAT, {"messages": HI, "top_p": 0}, "top_p"),
        (CHAT, {"messages": HI, "n": 0}, "n"),
        (CHAT, {"messages": HI, "stop": 5}, "stop"),
        (CHAT, {"max_tokens": 5}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (CHAT, {"messages": HI, "stream": "yes"}, "stream"),
        # Found by the fuzzer: a content part that is not text was a 500.
        (CHAT, {"messages": [{"role": "user", "content": [IMAGE]}]}, "messages.0.content.0.type"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages.0.content.0.text",
        ),
        (COMPLETIONS, {"max_tokens": 5}, "prompt"),
        (COMPLETIONS, {"prompt": [[1, 2], []]}, "prompt"),
        (COMPLETIONS, {"prompt": "x", "seed": 1.5}, "seed"),
    ],
)
def test_invalid_values_name_the_parameter(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    err = assert_error(http.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "raw",
    [b"{bad json", b"", b"[1, 2]", b"null", b'{"messages": [{"role": "user", "content": "hi"}]'],
)
def test_malformed_json(http: httpx.Client, raw: bytes) -> None:
    assert_error(http.post(CHAT, content=raw, headers={"content-type": "application/json"}), 400)


def test_unknown_model_is_404(http: httpx.Client) -> None:
    err = assert_error(http.post(CHAT, json={"model": "gpt-9", "messages": HI}), 404, "model")
    assert "gpt-9" in err["message"] and err["code"] == "model_not_found"


def test_context_overflow_states_both_numbers(http: httpx.Client) -> None:
    err = assert_error(
        http.post(COMPLETIONS, json={"prompt": "hello there", "max_tokens": 100_000}), 400
    )
    assert err["code"] == "context_length_exceeded"
    assert "8192" in err["message"] and "100000" in err["message"].replace(",", "")
    long_prompt = "word " * 9000
    err = assert_error(http.post(COMPLETIONS, json={"prompt": long_prompt, "max_tokens": 5}), 400)
    assert err["code"] == "context_length_exceeded"


def test_body_over_limit_is_413(start_server: Callable[..., ServerProcess]) -> None:
    srv = start_server(env={"TOKENMILL_MAX_BODY_BYTES": "4096"})
    big = {"messages": [{"role": "user", "content": "x" * 10_000}]}
    r = httpx.post(srv.url + CHAT, json=big, timeout=30)
    assert_error(r, 413)
    ok = httpx.post(srv.url + CHAT, json={"messages": HI, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_unknown_fields_are_ignored(http: httpx.Client) -> None:
    # A field tokenmill has never heard of; the ones it knows and lacks are refused
    # (test_refused_fields).
    r = http.post(CHAT, json={"messages": HI, "max_tokens": 2, "foo": 1})
    assert r.status_code == 200


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing"), 404)
    r = http.get(CHAT)
    assert r.status_code == 405 and "error" in r.json()


def test_bad_template_is_400(http: httpx.Client) -> None:
    err = assert_error(
        http.post(CHAT, json={"messages": HI, "chat_template": "{% for %}", "max_tokens": 2}),
        400,
        "chat_template",
    )
    assert "template" in err["message"]


def test_request_id_is_echoed(http: httpx.Client) -> None:
    r = http.post(CHAT, json={"messages": HI, "max_tokens": 1}, headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    assert http.post(CHAT, json={"messages": HI, "max_tokens": 1}).headers["x-request-id"]


def test_server_still_serves_after_bad_input(http: httpx.Client) -> None:
    for raw in (b"{", b"\xff\xfe", b'{"messages": 1}'):
        assert http.post(CHAT, content=raw).status_code == 400
    assert http.post(CHAT, json={"messages": HI, "max_tokens": 2}).status_code == 200


def test_integral_floats_are_integers(http: httpx.Client) -> None:
    # Found by the fuzzer: JSON Schema's "integer" includes 2.0, which was a 400.
    r = http.post(CHAT, json={"messages": HI, "max_tokens": 2.0, "seed": 7.0, "n": 1.0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2
    assert_error(http.post(CHAT, json={"messages": HI, "max_tokens": 2.5}), 400, "max_tokens")
    assert_error(http.post(CHAT, json={"messages": HI, "max_tokens": True}), 400, "max_tokens")
