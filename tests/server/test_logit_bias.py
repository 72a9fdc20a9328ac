"""logit_bias through llama.cpp's logit-bias sampler, over HTTP with the openai SDK."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import ServerProcess
from tests.server.test_bad_input import assert_error
from tokenmill.engines.llamacpp.vocab import GgufTokenizer

ASK = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def tokenizer() -> Iterator[GgufTokenizer]:
    tok = GgufTokenizer("embedded")
    yield tok
    tok.close()


def token_id(tokenizer: GgufTokenizer, text: str) -> int:
    ids = tokenizer.vocab.tokenize(text, special=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


def test_bias_100_forces_the_token(client: openai.OpenAI, tokenizer: GgufTokenizer) -> None:
    zebra = token_id(tokenizer, " zebra")
    r = client.chat.completions.create(
        model="smollm2",
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=3,
        temperature=1.0,
        seed=3,
        logit_bias={str(zebra): 100},
    )
    assert r.choices[0].message.content == " zebra" * 3
    assert r.usage is not None and r.usage.completion_tokens == 3
    stream = client.completions.create(
        model="smollm2",
        prompt="My favourite animal is the",
        max_tokens=2,
        stream=True,
        logit_bias={str(zebra): 100},
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == " zebra" * 2


def test_bias_minus_100_bans_the_token(client: openai.OpenAI, tokenizer: GgufTokenizer) -> None:
    prompt = "The capital of France is"
    first = client.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0)
    greedy = first.choices[0].text
    banned = token_id(tokenizer, greedy)
    r = client.completions.create(
        model="smollm2",
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        logit_bias={str(banned): -100},
    )
    assert r.choices[0].text != greedy
    assert r.usage is not None and r.usage.completion_tokens == 1


def test_bad_biases_name_logit_bias(http: httpx.Client, tokenizer: GgufTokenizer) -> None:
    base = {"prompt": "hi", "max_tokens": 1}
    for bias in ({"5": 101}, {"x": 1}, {"-1": 1}, dict.fromkeys(map(str, range(301)), 1)):
        assert_error(http.post("/v1/completions", json={**base, "logit_bias": bias}), 400)
    # Past this model's vocabulary: the replica process refuses it before generating.
    beyond = str(tokenizer.vocab.n_tokens)
    err = assert_error(
        http.post("/v1/completions", json={**base, "logit_bias": {beyond: 1}}), 400, "logit_bias"
    )
    assert str(tokenizer.vocab.n_tokens - 1) in err["message"]
