"""Structured outputs over HTTP against the real model: ``response_format``
(``json_object``, ``json_schema``), GBNF ``grammar`` and vLLM's ``guided_*`` fields.

The oracle for a constrained answer is a validator: the ``openai`` SDK's own
``parse()`` (the Pydantic model), ``jsonschema`` for raw schemas, a regular
expression for grammars. Greedy decoding makes answers repeatable, so a free stream
sharing the batch with constrained ones is checked against itself alone.
"""

from __future__ import annotations

import enum
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import ServerProcess
from tests.server.test_bad_input import assert_error
from tests.sse import text, to_done


@pytest.fixture(scope="module")
def server(stable_server: ServerProcess) -> ServerProcess:
    """Streams batched beside constrained ones are compared with their answers alone
    token for token: the KV-stream-a-slot server (conftest.stable_server)."""
    return stable_server


SHORT = Field(max_length=24)


class Person(BaseModel):
    name: str = SHORT
    age: int = Field(ge=0, le=120)


class Colour(BaseModel):
    colour: Literal["red", "green", "blue"]


class Flags(BaseModel):
    is_open: bool
    is_public: bool


class Tags(BaseModel):
    tags: list[str] = Field(max_length=3)


class Address(BaseModel):
    street: str = SHORT
    city: str = SHORT


class Resident(BaseModel):
    name: str = SHORT
    address: Address


class Pet(BaseModel):
    name: str = SHORT
    nickname: str | None = Field(max_length=24)


class Size(enum.Enum):
    SMALL = "small"
    MEDIUM = "medium"
    LARGE = "large"


class Shirt(BaseModel):
    size: Size


class Item(BaseModel):
    name: str = SHORT
    quantity: int = Field(ge=1, le=9)


class Basket(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=2)


class Review(BaseModel):
    rating: int = Field(ge=1, le=5)
    summary: str = SHORT


class Price(BaseModel):
    amount: float = Field(ge=0, le=1000)
    currency: Literal["EUR", "USD"]


class Company(BaseModel):
    name: str = SHORT
    ceo: Person
    founded: int = Field(ge=1800, le=2030)


class Answer(BaseModel):
    value: int | str = Field(union_mode="left_to_right")


class Version(BaseModel):
    kind: Literal["version"]
    major: int = Field(ge=0, le=99)


class Scores(BaseModel):
    scores: list[int] = Field(min_length=1, max_length=3)


class Day(BaseModel):
    date: str = Field(pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")


class Task(BaseModel):
    done: bool
    priority: Literal["low", "high"]


class Team(BaseModel):
    name: str = SHORT
    members: list[Person] = Field(min_length=1, max_length=2)


class Book(BaseModel):
    title: str = SHORT
    author: str = SHORT
    year: int = Field(ge=1400, le=2030)
    pages: int = Field(ge=1, le=5000)
    in_print: bool
    genre: Literal["novel", "poetry", "essay"]
    isbn: str | None = Field(max_length=17)
    rating: float = Field(ge=0, le=5)


# Twenty schemas: nested objects, arrays, enums, bounded numbers, optional fields.
CASES: list[tuple[type[BaseModel], str]] = [
    (Person, "Describe a person."),
    (Colour, "Pick a colour of the sky."),
    (Flags, "Is the shop open and public?"),
    (Tags, "Give tags for a blog post about cats."),
    (Address, "Give an address in Paris."),
    (Resident, "Describe someone who lives in London."),
    (Pet, "Describe a dog."),
    (Shirt, "What shirt size fits a child?"),
    (Item, "One item on a shopping list."),
    (Basket, "A basket of fruit."),
    (Review, "Review a film you liked."),
    (Price, "The price of a coffee."),
    (Company, "Describe a company."),
    (Answer, "What is two plus two?"),
    (Version, "Which version is current?"),
    (Scores, "Scores of a game."),
    (Day, "What date is new year's day 2025?"),
    (Task, "A task for today."),
    (Team, "A small team."),
    (Book, "Describe a book."),
]
IDS = [model.__name__ for model, _ in CASES]
ASK = [{"role": "user", "content": "Tell me about your favourite animal."}]


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def chat(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


@pytest.mark.parametrize(("model", "ask"), CASES, ids=IDS)
def test_parse_gives_a_valid_object(
    client: openai.OpenAI, model: type[BaseModel], ask: str
) -> None:
    args: dict[str, Any] = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": ask}],
        "response_format": model,
        "temperature": 0,
        "max_tokens": 300,
    }
    first = client.chat.completions.parse(**args).choices[0]
    assert first.finish_reason == "stop"
    assert isinstance(first.message.parsed, model)
    # Streamed: a valid object too. (Not compared with the first: that one computed
    # the prompt in one batch, this one finds it in the prefix cache, and the last
    # bits of a logit can then differ, enough to flip a near tie under greedy.)
    with client.chat.completions.stream(**args) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "stop"
    assert isinstance(streamed.message.parsed, model)
    assert streamed.message.content is not None
    assert model.model_validate_json(streamed.message.content) == streamed.message.parsed


def test_json_object_always_parses(http: httpx.Client) -> None:
    for seed in range(4):
        body = chat(
            http,
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        choice = body["choices"][0]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:  # cut by max_tokens: a prefix of an object, never a false stop
            assert choice["finish_reason"] == "length"
            assert choice["message"]["content"].startswith("{")
            assert body["usage"]["completion_tokens"] == 200


CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "country": {"type": "string"},
        "population": {"type": "integer", "minimum": 0},
        "area_km2": {"type": "number"},
    },
    "required": ["name", "country", "population", "area_km2"],
    "additionalProperties": False,
}


def test_numbers_are_bounded_so_the_object_closes(http: httpx.Client) -> None:
    # Greedy SmolLM2 wrote "population": 3211123200000000000... until max_tokens on
    # three of these four before numbers were bounded (issue 29).
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    for city in ("Tokyo", "Paris", "Cairo", "Lima"):
        body = chat(
            http,
            messages=[{"role": "user", "content": f"Describe {city}."}],
            response_format=response_format,
            temperature=0,
            max_tokens=300,
        )
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", (city, choice["message"]["content"])
        answer = json.loads(choice["message"]["content"], parse_int=str, parse_float=str)
        digits = re.fullmatch(r"-?(\d+)(?:\.(\d+))?", answer["area_km2"])
        assert digits is not None, answer
        assert len(digits[1]) <= 19 and len(digits[2] or "") <= 10, answer
        population = int(answer["population"])
        assert 0 <= population <= 2**63 - 1, answer
        jsonschema.validate(json.loads(choice["message"]["content"]), CITY)


def test_max_tokens_cutting_the_json_is_length(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    body = chat(
        http,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        max_tokens=5,
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert choice["message"]["content"].startswith('{"story": "')


def test_gbnf_grammar_is_obeyed(http: httpx.Client) -> None:
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    for field in ("grammar", "guided_grammar"):
        body = chat(http, **{field: grammar}, max_tokens=20)
        assert re.fullmatch(r"The answer is (yes|no)\.", body["choices"][0]["message"]["content"])
        assert body["choices"][0]["finish_reason"] == "stop"


def test_regex_choice_and_guided_json(http: httpx.Client) -> None:
    body = chat(http, guided_regex=r"[0-9]{3}-[0-9]{4}", max_tokens=20)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", body["choices"][0]["message"]["content"])
    body = chat(http, guided_choice=["cat", "dog", "bird"], max_tokens=20)
    assert body["choices"][0]["message"]["content"] in {"cat", "dog", "bird"}
    schema = closed({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    for field in ("guided_json", "json_schema"):
        body = chat(http, **{field: schema}, max_tokens=30)
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
    body = chat(http, structured_outputs={"choice": ["up", "down"]}, max_tokens=10)
    assert body["choices"][0]["message"]["content"] in {"up", "down"}


def test_completions_and_predict_take_response_format(http: httpx.Client) -> None:
    schema = closed(
        {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        }
    )
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    r = http.post(
        "/v1/completions",
        json={
            "prompt": "The capital of France:",
            "response_format": rf,
            "temperature": 0,
            "max_tokens": 60,
        },
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)
    r = http.post(
        "/v1/deployments/smollm2/predictWithResponseStream",
        json={"messages": ASK, "response_format": rf, "temperature": 0, "max_tokens": 60},
    )
    assert r.status_code == 200, r.text
    streamed = "".join(text(e) for e in to_done(r))
    jsonschema.validate(json.loads(streamed), schema)


def test_the_schema_goes_into_the_prompt_unless_the_messages_carry_it(
    http: httpx.Client,
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    bare = chat(http, max_tokens=1)["usage"]["prompt_tokens"]
    told = chat(http, response_format=rf, max_tokens=1)["usage"]["prompt_tokens"]
    assert told > bare  # the schema was added, and is billed as prompt tokens
    carried = [{"role": "user", "content": f"Answer with this schema: {json.dumps(schema)}"}]
    r = http.post(
        "/v1/chat/completions", json={"messages": carried, "max_tokens": 1, "response_format": rf}
    )
    r0 = http.post("/v1/chat/completions", json={"messages": carried, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == r0.json()["usage"]["prompt_tokens"]


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` allowing no properties but its own (else a model may go on adding
    some until max_tokens)."""
    if schema.get("type") == "object":
        return {**schema, "additionalProperties": False}
    return schema


SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"k": {"type": "integer", "minimum": i, "maximum": i + 5}},
        "required": ["k"],
    }
    for i in range(4)
] + [
    {
        "type": "object",
        "properties": {"word": {"type": "string", "enum": ["alpha", "beta", "gamma"]}},
        "required": ["word"],
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "p": {
                "type": "object",
                "properties": {"q": {"type": "null"}},
                "required": ["q"],
                "additionalProperties": False,
            }
        },
        "required": ["p"],
    },
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}, "required": ["s"]},
]
FREE_PROMPTS = [f"Count from {i} to {i + 5}." for i in range(8)]


def test_constrained_and_free_streams_share_the_batch(http: httpx.Client) -> None:
    def constrained(schema: dict[str, Any]) -> str:
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        return stream_text(http, ASK, response_format=rf, max_tokens=60)

    def free(prompt: str) -> str:
        return stream_text(http, [{"role": "user", "content": prompt}], max_tokens=24)

    alone = [free(p) for p in FREE_PROMPTS]
    with ThreadPoolExecutor(16) as pool:
        constrained_runs = [pool.submit(constrained, closed(s)) for s in SCHEMAS]
        free_runs = [pool.submit(free, p) for p in FREE_PROMPTS]
        results = [f.result() for f in constrained_runs]
        together = [f.result() for f in free_runs]
    for schema, answer in zip(SCHEMAS, results, strict=True):
        jsonschema.validate(json.loads(answer), schema)
    assert together == alone


def stream_text(http: httpx.Client, messages: list[dict[str, str]], **body: Any) -> str:
    body = {"messages": messages, "temperature": 0, "stream": True, **body}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        return "".join(text(e) for e in to_done(r))


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("response_format", {"type": "json_schema"}, "json_schema"),
        ("response_format", {"type": "xml"}, "type"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}},
            "cannot be compiled",
        ),
        ("grammar", "root ::= undefined_rule", "GBNF"),
        ("guided_regex", "a(b", "regular expression"),
        ("guided_choice", [], "guided_choice"),
        ("guided_json", "not json", "JSON object"),
        ("guided_json", "[1]", "JSON object"),
        ("structured_outputs", {"regex": "a", "choice": ["b"]}, "one of"),
    ],
)
def test_a_bad_constraint_is_400_naming_its_field(
    http: httpx.Client, field: str, value: Any, words: str
) -> None:
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, field: value})
    err = assert_error(r, 400)
    assert err["param"].split(".")[0] == field, err  # response_format.type names its part
    assert words in err["message"], err


def test_two_constraints_are_400(http: httpx.Client) -> None:
    r = http.post(
        "/v1/chat/completions",
        json={
            "messages": ASK,
            "response_format": {"type": "json_object"},
            "guided_regex": "a+",
        },
    )
    err = assert_error(r, 400, None)
    assert "send one of them" in err["message"]


def test_text_format_and_empty_grammar_are_no_constraint(http: httpx.Client) -> None:
    free = chat(http, max_tokens=8)["choices"][0]["message"]["content"]
    body = chat(http, response_format={"type": "text"}, grammar="", max_tokens=8)
    assert body["choices"][0]["message"]["content"] == free
