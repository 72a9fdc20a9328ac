"""A field that would change the answer and that tokenmill does not implement is a 400
naming it, on every generation endpoint; neutral values and no-op fields are served."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess
from tests.server.test_bad_input import assert_error
from tokenmill.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PredictRequest,
)
from tokenmill.server.refused import NO_OPS, REFUSED

HI = [{"role": "user", "content": "hi"}]
# The request model of each endpoint: the fields it implements are not refused there.
IMPLEMENTED = {
    "/v1/chat/completions": ChatCompletionRequest.IMPLEMENTED,
    "/v1/completions": CompletionRequest.IMPLEMENTED,
    "/v1/deployments/smollm2/predict": PredictRequest.IMPLEMENTED,
    "/v1/deployments/smollm2/predictWithResponseStream": PredictRequest.IMPLEMENTED,
}
ENDPOINTS = [
    ("/v1/chat/completions", {"messages": HI}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/deployments/smollm2/predict", {"prompt": "hi"}),
    ("/v1/deployments/smollm2/predictWithResponseStream", {"messages": HI}),
]
# What a caller would really send; any other refused field gets an object it cannot mean.
ASKS: dict[str, Any] = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "required",
    "suffix": "the end",
    "use_beam_search": True,
    "typical_p": 0.5,
    "skip_special_tokens": False,
    "modalities": ["text", "audio"],
}


@pytest.mark.parametrize(("path", "base"), ENDPOINTS)
@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_field_is_400_naming_it(
    http: httpx.Client, path: str, base: dict[str, Any], field: str
) -> None:
    implemented = field in IMPLEMENTED[path]
    invalid = 5 if field == "tool_choice" else {"asked": 1}  # an object: tool_choice.type
    value = invalid if implemented else ASKS.get(field, {"asked": 1})
    err = assert_error(http.post(path, json={**base, "max_tokens": 1, field: value}), 400, field)
    assert err["type"] == "invalid_request_error"
    if implemented:
        return  # implemented there (echo, tools): an object is just not a valid value
    assert err["code"] == "unsupported_parameter"
    assert "does not support" in err["message"]


@pytest.mark.parametrize(("path", "base"), ENDPOINTS)
def test_neutral_values_and_no_ops_are_served(
    http: httpx.Client, path: str, base: dict[str, Any]
) -> None:
    neutral = {name: spec.neutral[0] for name, spec in REFUSED.items() if spec.neutral}
    no_ops = dict.fromkeys(NO_OPS, "anything") | {"metadata": {"k": "v"}, "store": True}
    no_ops["parallel_tool_calls"] = True  # a boolean where tools are implemented
    body = {**base, "max_tokens": 1, **neutral, **no_ops, "user": "u-1", "nonsense": 1}
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text


def test_json_true_is_not_a_neutral_one(http: httpx.Client) -> None:
    # best_of 1 is neutral; JSON's true is not the number 1.
    body = {"prompt": "hi", "max_tokens": 1, "best_of": True}
    assert_error(http.post("/v1/completions", json=body), 400, "best_of")
    assert http.post("/v1/completions", json={**body, "best_of": 1}).status_code == 200


def test_the_openai_sdk_sees_the_refused_parameter(server: ServerProcess) -> None:
    with (
        openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client,
        pytest.raises(openai.BadRequestError) as caught,
    ):
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "hi"}],  # typed as the SDK's params
            max_tokens=4,
            reasoning_effort="high",
        )
    assert caught.value.param == "reasoning_effort"
    assert caught.value.code == "unsupported_parameter"


def test_schema_offers_only_neutral_values(http: httpx.Client) -> None:
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    props = schemas["CompletionRequest"]["properties"]
    assert {"type": "array", "maxItems": 0, "minItems": 0} in props["tools"]["anyOf"]
    for model in ("ChatCompletionRequest", "CompletionRequest", "PredictRequest"):
        assert set(REFUSED) <= set(schemas[model]["properties"])
