"""Schemathesis over every route of a live gateway, from the gateway's own /openapi.json.

Each operation gets schema-valid and schema-invalid requests; every response must be
no 5xx, have a documented status, content type and headers, and a body that matches
its schema (event streams event by event). Invalid requests must be refused with a
4xx. The stateful run then follows the document's links: account → key, credits and
usage; a generation → its usage record.

Generations are held to ``FUZZ_MAX_TOKENS`` tokens so that the whole run takes a
couple of minutes on two cores; the number of cases is printed for the record.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, given
from schemathesis import Case, GenerationMode, Response
from schemathesis.checks import CheckFunction, not_a_server_error
from schemathesis.core.errors import InvalidSchema
from schemathesis.core.result import Err, Ok
from schemathesis.schemas import APIOperation, BaseSchema
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import ServerProcess, launch
from tokenmill.server.openai.embeddings import MAX_INPUTS as MAX_EMBEDDING_INPUTS

ADMIN_KEY = "admin-key-for-the-fuzzer"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
# Enough for a token or two of each generation, and for one case to never hang.
FUZZ_MAX_TOKENS = 2
CALL_TIMEOUT_S = 30.0
# Cases per operation and mode; with 17 operations, about 500 requests in all.
POSITIVE_EXAMPLES = 20
NEGATIVE_EXAMPLES = 10
STATEFUL_EXAMPLES = 15
GENERATION_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/predict",
    "/v1/responses",
    "/v1/messages",
)
# The output limit's name where it is not max_tokens.
LIMIT_FIELDS = {"/v1/responses": "max_output_tokens", "/v1/messages": "max_tokens"}
# Embedding requests are held to a few short inputs, for the same reason.
EMBEDDINGS_PATH = "/v1/embeddings"
FUZZ_INPUTS = 2
FUZZ_INPUT_LENGTH = 32
DEPLOYMENT = "smollm2"

# Schemathesis's generics, over whatever kind of schema was loaded.
Operation = APIOperation[Any, Any, Any, Any]
AnyCase = Case[Operation]

CHECKS: list[CheckFunction] = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


def _settings(max_examples: int) -> hypothesis.settings:
    return hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        # Requests to a real server are slow by Hypothesis's standards, on purpose.
        suppress_health_check=list(HealthCheck),
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
    )


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = launch(tmp_path_factory.mktemp("fuzz"), env={"TOKENMILL_ADMIN_KEY": ADMIN_KEY})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def user_key(gateway: ServerProcess) -> str:
    """An account's API key: the admin key manages accounts, and generates nothing."""
    with _admin(gateway) as admin:
        account = admin.post("/admin/accounts", json={"name": "fuzzer", "balance": 10**12})
        key = admin.post("/admin/keys", json={"account": account.json()["id"]})
        plaintext: str = key.json()["key"]
        return plaintext


def auth_for(path: str, user_key: str) -> dict[str, str]:
    """The admin key for the admin API, the account's key for the rest."""
    key = ADMIN_KEY if path.startswith("/admin/") else user_key
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def api(gateway: ServerProcess) -> BaseSchema:
    # An explicit config: no schemathesis.toml of the machine's changes what runs.
    config = schemathesis.Config()
    return schemathesis.openapi.from_url(f"{gateway.url}/openapi.json", config=config)


def shape_generation(case: AnyCase) -> None:
    """Keep a generation short, and send most of them to the model that is served.

    Any positive ``max_tokens`` is valid and an invalid one stays invalid under ``min``
    (0, -1, ``true``); any model name or deployment id is valid. So a case stays as
    valid, or as invalid, as it was generated.
    """
    if not case.path.endswith(GENERATION_PATHS):
        return
    if isinstance(case.path_parameters.get("deployment_id"), str):
        case.path_parameters["deployment_id"] = _mostly_served(
            case.path_parameters["deployment_id"]
        )
    body = case.body
    if not isinstance(body, dict):
        return
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(limit := body.get(field), int):
            body[field] = min(limit, FUZZ_MAX_TOKENS)
    limit_field = LIMIT_FIELDS.get(case.path, "max_tokens")
    # Messages' max_tokens is required: a case without it stays without it (a 400).
    if body.get(limit_field) is None and case.path != "/v1/messages":
        body[limit_field] = FUZZ_MAX_TOKENS
    if isinstance(model := body.get("model"), str):
        body["model"] = _mostly_served(model)


def shape_embeddings(case: AnyCase) -> None:
    """Keep an embedding request small: its inputs are its cost, as tokens are a
    generation's. Only a valid ``input`` is cut (to ``FUZZ_INPUTS`` inputs of at most
    ``FUZZ_INPUT_LENGTH`` characters or ids), so it stays valid; an invalid one is
    left as it is."""
    body = case.body
    if not case.path.endswith(EMBEDDINGS_PATH) or not isinstance(body, dict):
        return
    value: Any = body.get("input")

    def ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(type(t) is int and t >= 0 for t in v)

    def text(v: Any) -> bool:
        return isinstance(v, str) and bool(v)

    if text(value) or ids(value):
        body["input"] = value[:FUZZ_INPUT_LENGTH]
    elif (
        isinstance(value, list)
        and 0 < len(value) <= MAX_EMBEDDING_INPUTS
        and (all(text(v) for v in value) or all(ids(v) for v in value))
    ):
        body["input"] = [v[:FUZZ_INPUT_LENGTH] for v in value[:FUZZ_INPUTS]]
    if isinstance(model := body.get("model"), str):
        body["model"] = _mostly_served(model)


def _mostly_served(name: str) -> str:
    # Nearly every generated name is unknown, a 404 (test_bad_input covers those):
    # three in four go to the served model instead, deterministically.
    return name if len(name) % 4 == 0 else DEPLOYMENT


def loaded(result: Ok[Operation] | Err[InvalidSchema]) -> Operation:
    """An operation of the document; one the loader could not read fails the test."""
    assert isinstance(result, Ok), f"/openapi.json has an unreadable operation: {result.err()}"
    return result.ok()


def run_operation(
    operation: Operation,
    mode: GenerationMode,
    examples: int,
    statuses: Counter[int],
    user_key: str,
) -> None:
    auth = auth_for(operation.path, user_key)
    strategy = operation.as_strategy(generation_mode=mode, headers=auth)

    @_settings(examples)
    @given(case=strategy)
    def fuzz(case: AnyCase) -> None:
        shape_generation(case)
        shape_embeddings(case)
        response = case.call_and_validate(headers=auth, checks=CHECKS, timeout=CALL_TIMEOUT_S)
        statuses[response.status_code] += 1

    try:
        fuzz()
    except hypothesis.errors.Unsatisfiable:
        # An operation without parameters or body (GET /health) has no invalid input.
        assert mode == GenerationMode.NEGATIVE


def test_every_route_conforms_to_the_served_schema(
    api: BaseSchema, user_key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    operations = [loaded(result) for result in api.get_all_operations()]
    labels = {op.label for op in operations}
    # Every route of the API is in the document (the playground and /metrics are not).
    assert "POST /v1/chat/completions" in labels and "GET /v1/usage/{request_id}" in labels
    assert len(operations) >= 17, sorted(labels)

    statuses: Counter[int] = Counter()
    started = time.monotonic()
    for operation in operations:
        run_operation(operation, GenerationMode.POSITIVE, POSITIVE_EXAMPLES, statuses, user_key)
        run_operation(operation, GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES, statuses, user_key)
    elapsed = time.monotonic() - started
    cases = statuses.total()
    with capsys.disabled():
        by_status = ", ".join(f"{n} x {status}" for status, n in sorted(statuses.items()))
        print(
            f"\nschemathesis {schemathesis.__version__}: {cases} cases over "
            f"{len(operations)} operations in {elapsed:.0f} s ({by_status})"
        )
    assert cases >= len(operations) * 5
    assert statuses[200] >= len(operations), "too few requests got through to be a test"


def test_linked_calls_conform_to_the_served_schema(
    api: BaseSchema, user_key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    steps: list[str] = []
    # Valid calls only: an invalid one would be made valid again by the key sent with it.
    api.config.generation.update(modes=[GenerationMode.POSITIVE])

    class Scenarios(api.as_state_machine()):  # type: ignore[misc]
        """Chains of calls along the document's links, with the admin key."""

        def get_call_kwargs(self, case: AnyCase) -> dict[str, Any]:
            return {"headers": auth_for(case.path, user_key), "timeout": CALL_TIMEOUT_S}

        def before_call(self, case: AnyCase) -> None:
            shape_generation(case)
            shape_embeddings(case)

        def after_call(self, response: Response, case: AnyCase) -> None:
            super().after_call(response, case)
            steps.append(f"{case.operation.label} {response.status_code}")

        def validate_response(
            self,
            response: Response,
            case: AnyCase,
            additional_checks: list[CheckFunction] | None = None,
            **kwargs: Any,
        ) -> None:
            case.validate_response(
                response, checks=CHECKS, transport_kwargs=kwargs, recorder=self.recorder
            )

    started = time.monotonic()
    Scenarios.run(settings=_settings(STATEFUL_EXAMPLES))
    elapsed = time.monotonic() - started
    with capsys.disabled():
        print(f"\nschemathesis stateful: {len(steps)} calls in {elapsed:.0f} s")
    # The links were followed: keys were made for accounts the run created.
    assert any(step.startswith("POST /admin/keys 200") for step in steps), steps


# -- what the fuzzer found, pinned down ----------------------------------------------


def _admin(gateway: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=gateway.url, headers=AUTH, timeout=CALL_TIMEOUT_S)


def test_amounts_past_the_ledgers_integers_are_400(gateway: ServerProcess) -> None:
    # A balance past 64 bits overflowed the ledger's column: a 500.
    with _admin(gateway) as admin:
        r = admin.post("/admin/accounts", json={"name": "big", "balance": 2**70})
        assert r.status_code == 400 and r.json()["error"]["param"] == "balance", r.text
        account = admin.post("/admin/accounts", json={"name": "small"}).json()["id"]
        r = admin.post(f"/admin/accounts/{account}/credits", json={"amount": -(2**70)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "amount", r.text
        r = admin.post("/admin/keys", json={"account": account, "tpm": 2**64})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tpm", r.text


def test_admin_numbers_are_numbers(gateway: ServerProcess) -> None:
    # Found by the stateful run: "tpm": true made a key limited to 1 token a minute.
    with _admin(gateway) as admin:
        account = admin.post("/admin/accounts", json={"name": "strict", "balance": 5.0})
        assert account.status_code == 200 and account.json()["balance"] == 5, account.text
        for bad in ({"tpm": True}, {"rpm": "10"}, {"tpm": 1.5}):
            body = {"account": account.json()["id"], **bad}
            r = admin.post("/admin/keys", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), r.text


def test_a_hosted_tools_name_of_any_characters_is_named_in_the_header(
    gateway: ServerProcess, user_key: str
) -> None:
    # A tool named past Latin-1 made the x-tokenmill-omitted-tools header a 500.
    body = {
        "model": DEPLOYMENT,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"type": "web_search_20250305", "name": "søk, 搜索"}],
    }
    headers = {"Authorization": f"Bearer {user_key}"}
    with httpx.Client(base_url=gateway.url, timeout=CALL_TIMEOUT_S) as c:
        r = c.post("/v1/messages", json=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["x-tokenmill-omitted-tools"] == "s%C3%B8k%2C%20%E6%90%9C%E7%B4%A2"


def test_known_kinds_of_the_catch_all_unions_match_the_document_once(api: BaseSchema) -> None:
    # Each union's refused or omitted member took any "type": by the served document
    # every text block, custom tool or context edit matched two members of a oneOf,
    # which made them invalid (and a fuzzed null "valid" data it had to refuse).
    operations = {op.path: op for op in map(loaded, api.get_all_operations())}
    messages = {
        "model": DEPLOYMENT,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "tools": [{"type": "custom", "name": "f", "input_schema": {"type": "object"}}],
        "context_management": {
            "edits": [{"type": "clear_tool_uses_20250919", "clear_tool_inputs": None}]
        },
    }
    responses = {
        "model": DEPLOYMENT,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
        ],
        "tools": [{"type": "function", "name": "f"}],
    }
    for path, body in (("/v1/messages", messages), ("/v1/responses", responses)):
        (schema,) = operations[path].body
        assert schema.is_valid(body), path
        unknown = {**body, "tools": [{"type": "web_search"}]}
        assert schema.is_valid(unknown), path  # refused or left out by the server, not here
