"""``echo`` on text completions, over HTTP with the openai SDK.

The oracle for a prompt token's log probability is a generation: the prompt cut just
before that token, with ``logit_bias`` forcing it as the first completion token.
Reported log probabilities are the model's own, before logit_bias moves them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess
from tests.server.test_bad_input import assert_error

PROMPT = "The three primary colours are"
# Prompt rows computed in one batch and one at a time differ in the last bits.
TOLERANCE = 1e-3


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


def complete(client: openai.OpenAI, stream: bool, **extra: Any) -> tuple[str, Any, Any]:
    """(text, logprobs as one dict of lists, usage) of one greedy completion."""
    args: dict[str, Any] = {"model": "smollm2", "max_tokens": 6, "temperature": 0, **extra}
    if not stream:
        r = client.completions.create(**args)
        lp = r.choices[0].logprobs
        return r.choices[0].text, None if lp is None else lp.model_dump(), r.usage
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **args)
    )
    choices = [c.choices[0] for c in chunks if c.choices]
    merged: dict[str, list[Any]] = {}
    for choice in choices:
        if choice.logprobs is not None:
            for key, values in choice.logprobs.model_dump().items():
                merged.setdefault(key, []).extend(values)
    return "".join(c.text for c in choices), merged or None, chunks[-1].usage


def tokens_of(http: httpx.Client, prompt: str) -> list[int]:
    r = http.post("/tokenize", json={"model": "smollm2", "prompt": prompt})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI, stream: bool) -> None:
    plain, _, usage = complete(client, stream, prompt=PROMPT)
    echoed, logprobs, echo_usage = complete(client, stream, prompt=PROMPT, echo=True)
    assert echoed == PROMPT + plain and logprobs is None
    assert echo_usage.completion_tokens == usage.completion_tokens
    assert echo_usage.prompt_tokens == usage.prompt_tokens


def test_the_echoed_prompt_comes_first_in_a_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, stream=True
    )
    first = next(iter(stream))
    assert first.choices[0].text == PROMPT
    stream.close()


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_gives_the_prompt_tokens_theirs(
    client: openai.OpenAI, http: httpx.Client, stream: bool
) -> None:
    ids = tokens_of(http, PROMPT)
    # Cached first: a cached prefix must not cost the echo its log probabilities.
    complete(client, False, prompt=PROMPT)
    text, lp, usage = complete(client, stream, prompt=PROMPT, echo=True, logprobs=2)
    _, plain, _ = complete(client, stream, prompt=PROMPT, logprobs=2)
    n = len(ids)
    assert usage.prompt_tokens_details.cached_tokens == 0

    assert "".join(lp["tokens"][:n]) == PROMPT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # The completion's tokens are the plain completion's, offset past the prompt.
    assert lp["tokens"][n:] == plain["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(plain["token_logprobs"], abs=TOLERANCE)
    assert lp["text_offset"][n:] == [len(PROMPT) + o for o in plain["text_offset"]]
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"] == offsets
    assert text == "".join(lp["tokens"])

    for k in range(1, n):
        forced = client.completions.create(
            model="smollm2",
            prompt=ids[:k],
            max_tokens=1,
            temperature=0,
            logprobs=2,
            logit_bias={str(ids[k]): 100},
        )
        assert forced.choices[0].logprobs is not None
        (expected,) = forced.choices[0].logprobs.token_logprobs or []
        got = lp["token_logprobs"][k]
        assert math.isclose(got, expected, abs_tol=TOLERANCE), (k, got, expected)
        top = lp["top_logprobs"][k]
        assert len(top) in (2, 3) and lp["tokens"][k] in top
        assert max(top.values()) >= got


def test_a_prompt_of_token_ids_is_echoed_as_its_text(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    text, _, _ = complete(client, False, prompt=tokens_of(http, PROMPT), echo=True)
    assert text.startswith(PROMPT)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/deployments/smollm2/predict"])
def test_echo_is_refused_where_it_is_not_implemented(http: httpx.Client, path: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "echo": True}
    assert_error(http.post(path, json=body), 400, "echo")
