"""``POST /v1/embeddings`` over HTTP, with the official ``openai`` SDK where it fits.

One metered gateway holds SmolLM2 in a replica process (the default) and in the
gateway's own process, and an upstream deployment, which cannot embed. The oracles:
``/tokenize`` for token counts, the ledger's receipt for what was charged, and the
vectors themselves (unit length, identical for the same text however it is sent,
closer for similar texts than for unrelated ones).
"""

from __future__ import annotations

import base64
import math
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import ServerProcess, launch
from tests.ledger.helpers import (
    ADMIN_KEY,
    PRICE,
    account,
    admin,
    charge_for,
    new_account,
    new_key,
    receipt,
    user,
)
from tests.server.test_bad_input import assert_error

NOWHERE = "http://127.0.0.1:9/v1"
CONFIG = f"""
[[deployments]]
id = "smollm2"
max_num_seqs = 2
n_ctx = 256
n_threads = 1

[deployments.price]
prompt_per_mtok = {PRICE.prompt_per_mtok}
completion_per_mtok = {PRICE.completion_per_mtok}

[[deployments]]
id = "inproc"
placement = "local"
max_num_seqs = 1
n_ctx = 256
n_threads = 1

[[deployments]]
id = "remote"
engine = "upstream"
url = "{NOWHERE}"
"""
MODELS = ["smollm2", "inproc"]
DIMENSIONS = 576  # SmolLM2-135M's hidden size
CAT = "The cat sat on the mat."
CAT_AGAIN = "A cat was sitting on a mat."
TAXES = "Quarterly corporate tax filings are due in April."


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {"TOKENMILL_ADMIN_KEY": ADMIN_KEY}
    srv = launch(tmp_path_factory.mktemp("embeddings"), config=CONFIG, env=env)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def adm(gw: ServerProcess) -> Iterator[httpx.Client]:
    with admin(gw.url) as client:
        yield client


@pytest.fixture(scope="module")
def key(adm: httpx.Client) -> str:
    _, secret = new_key(adm, new_account(adm, "embedder", 10_000_000))
    return secret


@pytest.fixture
def http(gw: ServerProcess, key: str) -> Iterator[httpx.Client]:
    with user(gw.url, key) as c:
        yield c


@pytest.fixture
def client(gw: ServerProcess, key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0, timeout=120) as c:
        yield c


def token_count(http: httpx.Client, model: str, text: str) -> int:
    r = http.post("/tokenize", json={"model": model, "prompt": text})
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def tokens_of(http: httpx.Client, text: str) -> list[int]:
    r = http.post("/tokenize", json={"model": "smollm2", "prompt": text})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def cosine(a: list[float], b: list[float]) -> float:
    return float(np.dot(a, b))  # unit vectors: the dot product is the cosine


@pytest.mark.parametrize("model", MODELS)
def test_same_text_same_unit_vector_and_similar_texts_are_closer(
    client: openai.OpenAI, http: httpx.Client, model: str
) -> None:
    # The SDK asks for base64 by default and decodes it; then floats, one input.
    batch = client.embeddings.create(model=model, input=[CAT, CAT_AGAIN, TAXES])
    alone = client.embeddings.create(model=model, input=CAT, encoding_format="float")
    assert batch.object == "list" and batch.model == model
    assert [d.index for d in batch.data] == [0, 1, 2]
    cat, cat_again, taxes = (d.embedding for d in batch.data)
    for vector in (cat, cat_again, taxes):
        assert len(vector) == DIMENSIONS
        assert math.isclose(float(np.linalg.norm(vector)), 1.0, abs_tol=1e-5)
    # Bit for bit: alone or among others, as base64 or as numbers.
    assert alone.data[0].embedding == cat
    assert cosine(cat, cat_again) > cosine(cat, taxes)
    assert cosine(cat, cat_again) > cosine(cat_again, taxes)

    expected = sum(token_count(http, model, t) for t in (CAT, CAT_AGAIN, TAXES))
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == expected
    assert alone.usage.prompt_tokens == token_count(http, model, CAT)


def test_token_ids_embed_as_their_text(client: openai.OpenAI, http: httpx.Client) -> None:
    text = client.embeddings.create(model="smollm2", input=[CAT, TAXES], encoding_format="float")
    ids = [tokens_of(http, CAT), tokens_of(http, TAXES)]
    one = client.embeddings.create(model="smollm2", input=ids[0], encoding_format="float")
    both = client.embeddings.create(model="smollm2", input=ids, encoding_format="float")
    assert one.data[0].embedding == text.data[0].embedding
    assert [d.embedding for d in both.data] == [d.embedding for d in text.data]
    assert both.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_base64_is_little_endian_float32_of_the_same_vector(http: httpx.Client) -> None:
    body: dict[str, Any] = {"model": "smollm2", "input": CAT}
    floats = http.post("/v1/embeddings", json=body)
    packed = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"})
    assert floats.status_code == packed.status_code == 200, (floats.text, packed.text)
    raw = base64.b64decode(packed.json()["data"][0]["embedding"])
    decoded = np.frombuffer(raw, dtype="<f4").tolist()
    assert decoded == floats.json()["data"][0]["embedding"]
    # The model's own length may be asked for; it changes nothing.
    same = http.post("/v1/embeddings", json={**body, "dimensions": DIMENSIONS})
    assert same.status_code == 200, same.text
    assert same.json()["data"] == floats.json()["data"]


def test_embeddings_are_billed_as_prompt_tokens(http: httpx.Client, adm: httpx.Client) -> None:
    acc = new_account(adm, "billed", 1_000_000)
    _, secret = new_key(adm, acc)
    r = http.post(
        "/v1/embeddings",
        json={"model": "smollm2", "input": [CAT, TAXES]},
        headers={"authorization": f"Bearer {secret}"},
    )
    assert r.status_code == 200, r.text
    tokens = r.json()["usage"]["prompt_tokens"]
    assert tokens == token_count(http, "smollm2", CAT) + token_count(http, "smollm2", TAXES)
    got = receipt(adm, r.headers["x-request-id"])
    charge = charge_for(tokens, 0)
    assert charge > 0
    assert (got["prompt_tokens"], got["completion_tokens"]) == (tokens, 0)
    assert got["charged"] == charge
    state = account(adm, acc)
    assert (state["balance"], state["held"]) == (1_000_000 - charge, 0)


def test_no_credit_is_402(gw: ServerProcess, adm: httpx.Client) -> None:
    acc = new_account(adm, "broke", 1)
    _, secret = new_key(adm, acc)
    with openai.OpenAI(base_url=gw.base_url, api_key=secret, max_retries=0) as broke:
        with pytest.raises(openai.APIStatusError) as caught:
            broke.embeddings.create(model="smollm2", input=TAXES * 4)
    assert caught.value.status_code == 402
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "insufficient_credit"
    assert account(adm, acc)["balance"] == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [CAT, ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": 5}, "input"),
        ({"input": [10**7]}, "input"),  # no such token id
        ({"input": "word " * 400}, "input"),  # longer than the 256-token window
        ({"input": CAT, "encoding_format": "int8"}, "encoding_format"),
        ({"input": CAT, "dimensions": 64}, "dimensions"),
        ({"input": CAT, "dimensions": 0}, "dimensions"),
        ({"input": CAT, "model": "remote"}, "model"),  # an upstream cannot embed
    ],
)
def test_bad_input_is_400_naming_the_parameter(
    http: httpx.Client, body: dict[str, Any], param: str
) -> None:
    err = assert_error(http.post("/v1/embeddings", json={"model": "smollm2", **body}), 400, param)
    assert err["type"] == "invalid_request_error"


def test_too_long_says_both_numbers(http: httpx.Client) -> None:
    text = "word " * 400
    n = token_count(http, "smollm2", text)
    r = http.post("/v1/embeddings", json={"model": "smollm2", "input": [CAT, text]})
    err = assert_error(r, 400, "input")
    assert err["code"] == "context_length_exceeded"
    assert "256" in err["message"] and str(n) in err["message"] and "input.1" in err["message"]


def test_embeddings_and_a_stream_share_the_replica(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    """While a completion streams on the replica, embeddings are computed between its
    steps: both finish, and the vectors are those computed alone."""
    alone = client.embeddings.create(model="smollm2", input=[CAT, TAXES], encoding_format="float")
    streamed: list[str] = []
    started = threading.Event()

    def stream() -> None:
        chunks = client.completions.create(
            model="smollm2", prompt="Once upon a time", max_tokens=24, stream=True
        )
        for chunk in chunks:
            started.set()
            streamed.append(chunk.choices[0].text if chunk.choices else "")

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert started.wait(120), "the stream never started"
        during = client.embeddings.create(
            model="smollm2", input=[CAT, TAXES] * 3, encoding_format="float"
        )
    finally:
        thread.join(120)
    assert not thread.is_alive()
    assert "".join(streamed)
    assert [d.embedding for d in during.data] == [d.embedding for d in alone.data] * 3
