"""The Batch API through the openai SDK against a gateway serving the real model:
files and batches as OpenAI's, every line billed at the batch discount and found by
its receipt, bad input refused before anything runs, accounts kept apart."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pytest

from tests.conftest import ServerProcess
from tests.ledger.helpers import CONFIG, ENV, account, admin, new_account, new_key
from tests.waiting import HANG_S, wait_until

CHAT: Literal["/v1/chat/completions"] = "/v1/chat/completions"
ENDED = ("completed", "failed", "expired", "cancelled")
# PRICE (1.5 and 3 micro-units a token) at the default batch discount of 0.5.
FILES_MAX = 64 * 1024


def discounted(r: dict[str, Any]) -> int:
    """Half of PRICE, written out: 0.75 a prompt token, 1.5 a completion token, the
    sum rounded up."""
    return -(-(3 * int(r["prompt_tokens"]) + 6 * int(r["completion_tokens"])) // 4)


def line(custom_id: str, content: str, max_tokens: int = 6, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {
            "model": "smollm2",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **body,
        },
    }


def jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from tests.conftest import launch

    env = {**ENV, "TOKENMILL_FILES_MAX_BYTES": str(FILES_MAX)}
    srv = launch(tmp_path_factory.mktemp("batches"), config=CONFIG, env=env)
    yield srv
    srv.stop()


def tenant(gateway: ServerProcess, name: str, credit: int) -> tuple[str, openai.OpenAI]:
    with admin(gateway.url) as adm:
        acct = new_account(adm, name, credit)
        _, key = new_key(adm, acct)
    return acct, openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


def run(client: openai.OpenAI, lines: list[Any], **kw: Any) -> Any:
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return client.batches.create(
        input_file_id=f.id, endpoint=kw.pop("endpoint", CHAT), completion_window="24h", **kw
    )


def ended(client: openai.OpenAI, batch_id: str) -> Any:
    return wait_until(
        lambda: (b := client.batches.retrieve(batch_id)).status in ENDED and b,
        f"batch {batch_id} to end",
    )


def read(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_a_batch_runs_every_line_once_at_the_discount(gateway: ServerProcess) -> None:
    credit = 10**6
    acct, client = tenant(gateway, "batcher", credit)
    questions = {f"q{i}": f"Name a colour, number {i}." for i in range(5)}
    batch = run(
        client,
        [line(cid, q) for cid, q in questions.items()],
        metadata={"job": "colours"},
    )
    assert batch.status == "in_progress" and batch.request_counts.total == 5
    assert batch.metadata == {"job": "colours"} and batch.endpoint == CHAT
    done = ended(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (5, 0)
    assert done.error_file_id is None and done.completed_at is not None
    out = read(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(questions)
    with admin(gateway.url) as adm:
        state = account(adm, acct)
        receipts = {
            r["request_id"]: r for r in adm.get(f"/admin/accounts/{acct}/usage").json()["data"]
        }
    total = 0
    for o in out:
        resp = o["response"]
        assert resp["status_code"] == 200 and o["error"] is None
        body = resp["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        # Each line's request id is a receipt, of the tokens its body reports, at half price.
        mine = httpx.get(
            f"{gateway.url}/v1/usage/{resp['request_id']}",
            headers={"authorization": f"Bearer {client.api_key}"},
            timeout=HANG_S,
        )
        assert (
            mine.status_code == 200
            and mine.json()["charged"] == receipts[resp["request_id"]]["charged"]
        )
        r = receipts[resp["request_id"]]
        assert r["completion_tokens"] == body["usage"]["completion_tokens"]
        assert r["prompt_tokens"] == body["usage"]["prompt_tokens"]
        assert r["charged"] == discounted(r) > 0
        total += r["charged"]
    assert len(receipts) == 5
    assert state["held"] == 0 and state["balance"] == credit - total
    # Listed, newest first, and its files are the account's.
    assert client.batches.list(limit=10).data[0].id == batch.id
    ids = {f.id for f in client.files.list()}
    assert {batch.input_file_id, done.output_file_id} <= ids


def test_lines_the_route_refuses_fail_on_their_own_and_cost_nothing(
    gateway: ServerProcess,
) -> None:
    credit = 10**6
    acct, client = tenant(gateway, "mixed", credit)
    batch = run(client, [line("fine", "Hi"), line("huge", "Hi", max_tokens=1_000_000)])
    done = ended(client, batch.id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    (err,) = read(client, done.error_file_id)
    assert err["custom_id"] == "huge" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["code"] == "context_length_exceeded"
    with admin(gateway.url) as adm:
        receipts = adm.get(f"/admin/accounts/{acct}/usage").json()["data"]
        state = account(adm, acct)
    assert len(receipts) == 1 and state["balance"] == credit - receipts[0]["charged"]


def test_bad_input_fails_validation_with_line_numbers_and_costs_nothing(
    gateway: ServerProcess,
) -> None:
    credit = 10**6
    acct, client = tenant(gateway, "careless", credit)
    bad = [
        line("ok", "Hi"),
        "{not json",
        {**line("m", "Hi"), "method": "GET"},
        {**line("u", "Hi"), "url": "/v1/completions"},
        line("ok", "again"),
        line("model", "Hi", model="no-such-model"),
        line("temp", "Hi", temperature="hot"),
        line("stream", "Hi", stream=True),
        {"method": "POST", "url": CHAT, "body": {}},
        [1, 2],
    ]
    batch = run(client, bad)
    assert batch.status == "failed" and batch.failed_at is not None
    errors = {(e.line, e.code) for e in batch.errors.data}
    assert errors == {
        (2, "invalid_json_line"),
        (3, "invalid_method"),
        (4, "invalid_url"),
        (5, "duplicate_custom_id"),
        (6, "model_not_found"),
        (7, "invalid_value"),
        (8, "invalid_request"),
        (9, "missing_required_parameter"),
        (10, "invalid_request"),
    }, batch.errors
    params = {e.line: e.param for e in batch.errors.data}
    assert params[6] == "body.model" and params[7] == "body.temperature"
    assert client.batches.retrieve(batch.id).status == "failed"
    with admin(gateway.url) as adm:
        assert adm.get(f"/admin/accounts/{acct}/usage").json()["data"] == []
        assert account(adm, acct)["balance"] == credit

    # What is refused before a batch exists: the API's own 400, 404 and 413.
    f = client.files.create(
        file=("in.jsonl", io.BytesIO(jsonl([line("a", "Hi")]))), purpose="batch"
    )
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="forever")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError, match="file_nope"):
        client.batches.create(input_file_id="file_nope", endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as too_big:
        client.files.create(file=("a.jsonl", io.BytesIO(b"x" * (FILES_MAX + 1))), purpose="batch")
    assert too_big.value.status_code == 413
    empty = client.files.create(file=("e.jsonl", io.BytesIO(b"\n")), purpose="batch")
    nothing = client.batches.create(input_file_id=empty.id, endpoint=CHAT, completion_window="24h")
    assert nothing.status == "failed" and nothing.errors is not None and nothing.errors.data
    assert nothing.errors.data[0].code == "empty_file"


def test_another_accounts_files_and_batches_do_not_exist(gateway: ServerProcess) -> None:
    _, alice = tenant(gateway, "alice", 10**6)
    _, bob = tenant(gateway, "bob", 10**6)
    batch = run(alice, [line("a", "Hi")])
    for call in (
        lambda: bob.batches.retrieve(batch.id),
        lambda: bob.batches.cancel(batch.id),
        lambda: bob.files.retrieve(batch.input_file_id),
        lambda: bob.files.content(batch.input_file_id),
        lambda: bob.files.delete(batch.input_file_id),
        lambda: bob.batches.create(
            input_file_id=batch.input_file_id, endpoint=CHAT, completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert bob.batches.list().data == [] and list(bob.files.list()) == []
    assert ended(alice, batch.id).status == "completed"
    assert alice.files.delete(batch.input_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(batch.input_file_id)


def test_lines_stop_when_credit_runs_out_never_overdrawn(gateway: ServerProcess) -> None:
    # Enough for about three lines' holds at the discount (32 completion tokens each).
    hold = -(-(3 * 60 + 6 * 32) // 4)
    credit = 3 * hold
    acct, client = tenant(gateway, "thrifty", credit)
    batch = run(client, [line(f"l{i}", f"Count to {i + 20}.", max_tokens=32) for i in range(12)])
    done = ended(client, batch.id)
    assert done.status == "completed"
    assert done.request_counts.completed >= 1 and done.request_counts.failed >= 1
    assert done.request_counts.completed + done.request_counts.failed == 12
    errors = read(client, done.error_file_id)
    codes = {(e["error"] or e["response"]["body"]["error"])["code"] for e in errors}
    assert codes <= {"insufficient_quota", "insufficient_credit"}, codes
    with admin(gateway.url) as adm:
        state = account(adm, acct)
        receipts = adm.get(f"/admin/accounts/{acct}/usage").json()["data"]
    assert len(receipts) == done.request_counts.completed
    assert state["held"] == 0 and 0 <= state["balance"] == credit - sum(
        r["charged"] for r in receipts
    )


def test_interactive_answers_beside_a_batch_are_the_answers_alone(gateway: ServerProcess) -> None:
    # Greedy answers do not depend on what runs beside them: the batch's sequences sit
    # out the steps that compute an interactive prompt, and pause between their own.
    _, client = tenant(gateway, "beside", 10**6)
    ask = [f"Name a fruit that starts with {c}." for c in "ABC"]

    def answers() -> list[str]:
        return [
            str(
                client.chat.completions.create(
                    model="smollm2",
                    messages=[{"role": "user", "content": q}],
                    max_tokens=12,
                    temperature=0,
                )
                .choices[0]
                .message.content
            )
            for q in ask
        ]

    alone = answers()
    batch = run(client, [line(f"b{i}", f"Tell a story about {i} cats.", 48) for i in range(8)])
    beside = answers()
    done = ended(client, batch.id)
    assert beside == alone
    assert done.status == "completed" and done.request_counts.completed == 8
