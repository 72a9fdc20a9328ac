"""API keys: every wrong way to present one is refused, and none leaks into the log.

One gateway with an admin key and a scripted deployment (no model to load; each
generation is finished by the test). The mechanism of constant-time comparison is
checked in-process: the admin key is compared as two SHA-256 digests with
``hmac.compare_digest``, and API keys are stored and found by their digest only.
"""

from __future__ import annotations

import hmac
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.sse import DONE, events
from tokenmill.ledger import hash_key, ledger_from_url
from tokenmill.server import auth
from tokenmill.server.auth import Auth, KeyCache

ADMIN_KEY = "admin-key-for-the-key-tests"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def gateway(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> Iterator[ServerProcess]:
    # The default log level: what an operator's log holds.
    yield start_server(
        config=scripted_deployment(driver, max_num_seqs=4),
        env={"TOKENMILL_ADMIN_KEY": ADMIN_KEY},
    )


def new_key(client: httpx.Client, name: str) -> tuple[str, str, str]:
    """A funded account and a key for it: (account id, key id, key)."""
    resp = client.post("/admin/accounts", json={"name": name, "balance": 10**9}, headers=ADMIN)
    assert resp.status_code == 200, resp.text
    account = resp.json()["id"]
    resp = client.post("/admin/keys", json={"account": account}, headers=ADMIN)
    assert resp.status_code == 200, resp.text
    return account, resp.json()["id"], resp.json()["key"]


def chat(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "stream": True}


def refused(resp: httpx.Response, status: int, code: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    if code is not None:
        assert error["code"] == code, error


def test_every_wrong_key_is_refused_and_no_key_or_prompt_is_logged(
    gateway: ServerProcess, driver: EngineDriver
) -> None:
    secret_prompt = f"the-prompt-text-{uuid.uuid4().hex}"
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        account, key_id, key = new_key(client, "alice")
        other_account, _, other_key = new_key(client, "bob")

        # The right key generates (finished by the test through the driver).
        with client.stream(
            "POST", "/v1/chat/completions", json=chat(secret_prompt), headers=bearer(key)
        ) as resp:
            assert resp.status_code == 200
            rid = resp.headers["x-request-id"]
            assert driver.started(rid)["prompt"].endswith(secret_prompt)
            driver.emit(rid, 2)
            driver.finish(rid)
            assert list(events(resp))[-1] == DONE

        # No key, a malformed header, a wrong key (short and long): 401.
        refused(client.get("/v1/models"), 401, "missing_api_key")
        refused(client.get("/v1/models", headers={"authorization": key}), 401)
        refused(client.get("/v1/models", headers=bearer("x")), 401, "invalid_api_key")
        refused(client.get("/v1/models", headers=bearer(key + "0")), 401, "invalid_api_key")
        refused(client.get("/v1/models", headers=bearer(ADMIN_KEY[:-1])), 401)

        # A key in the URL is refused, even beside a right header: it has leaked.
        for name in ("api_key", "key", "access_token"):
            resp = client.get("/v1/models", params={name: key}, headers=bearer(key))
            refused(resp, 401, "api_key_in_query")
        resp = client.get(f"/admin/accounts/{account}", params={"api_key": ADMIN_KEY})
        refused(resp, 401, "api_key_in_query")
        assert client.get("/v1/models", headers=bearer(key)).status_code == 200

        # Another account's key (any API key) on the admin routes: 403.
        refused(client.get(f"/admin/accounts/{account}", headers=bearer(other_key)), 403)
        refused(client.get(f"/admin/accounts/{other_account}", headers=bearer(key)), 403)
        resp = client.post(
            "/admin/accounts/" + account + "/credits", json={"amount": 5}, headers=bearer(key)
        )
        refused(resp, 403)
        refused(client.post("/admin/keys", json={"account": account}, headers=bearer(key)), 403)

        # The admin key bills no account: it may read, never generate.
        resp = client.post("/v1/chat/completions", json=chat("hello"), headers=ADMIN)
        refused(resp, 403, "forbidden")
        resp = client.post(
            "/v1/deployments/scripted/predict", json={"prompt": "hello"}, headers=ADMIN
        )
        refused(resp, 403, "forbidden")
        assert client.get("/v1/models", headers=ADMIN).status_code == 200
        assert client.get(f"/v1/usage/{rid}", headers=ADMIN).status_code == 200
        # ... and another account's key cannot read alice's receipt.
        refused(client.get(f"/v1/usage/{rid}", headers=bearer(other_key)), 404)

        # A revoked key stops working at once on this gateway.
        assert client.get("/v1/models", headers=bearer(key)).status_code == 200
        assert client.delete(f"/admin/keys/{key_id}", headers=ADMIN).status_code == 200
        refused(client.get("/v1/models", headers=bearer(key)), 401, "invalid_api_key")
        refused(client.post("/v1/chat/completions", json=chat("x"), headers=bearer(key)), 401)
        assert driver.seen("started") == 1  # nothing refused ever reached the engine

    gateway.stop()
    log = gateway.log()
    assert '"event": "request"' in log  # the request log line is there, without secrets
    for secret in (key, other_key, ADMIN_KEY, secret_prompt, hash_key(key)):
        assert secret not in log


# -- the mechanism of comparison -----------------------------------------------------


async def test_the_admin_key_is_compared_as_digests_in_constant_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)  # the module auth calls
    ledger = ledger_from_url(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    await ledger.open()
    try:
        reached: list[dict[str, Any]] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            reached.append(scope["state"]["caller"])

        guard = Auth(app, admin_key=ADMIN_KEY, keys=KeyCache(ledger))

        async def status_of(key: str) -> int:
            sent: list[dict[str, Any]] = []

            async def send(message: Any) -> None:
                sent.append(message)

            async def receive() -> Any:
                return {"type": "http.request", "body": b"", "more_body": False}

            scope = {
                "type": "http",
                "path": "/admin/accounts",
                "query_string": b"",
                "headers": [(b"authorization", f"Bearer {key}".encode())],
            }
            reached.clear()
            await guard(scope, receive, send)
            return 200 if reached else int(sent[0]["status"])

        presented = ["a", ADMIN_KEY[:-1], ADMIN_KEY + "x", "k" * 500, ADMIN_KEY]
        statuses = [await status_of(k) for k in presented]
        assert statuses == [401, 401, 401, 401, 200]
        # Every presented key went through compare_digest as a 32-byte digest against
        # the admin key's digest: the same work whatever its length or prefix.
        expected = auth.digest(ADMIN_KEY)
        assert [b for _, b in compared] == [expected] * len(presented)
        assert [a for a, _ in compared] == [auth.digest(k) for k in presented]
        assert all(len(a) == len(b) == 32 for a, b in compared)
    finally:
        await ledger.close()


async def test_api_keys_are_stored_and_found_by_digest_only(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    ledger = ledger_from_url(f"sqlite:///{path}")
    await ledger.open()
    try:
        account = await ledger.create_account("carol", 10)
        info, plaintext = await ledger.create_key(account.id)
        found = await ledger.resolve_key(plaintext)
        assert found is not None and found.id == info.id
        assert await ledger.resolve_key(plaintext[:-1]) is None
    finally:
        await ledger.close()
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT * FROM api_keys").fetchall()
    stored = " ".join(str(v) for row in rows for v in row)
    assert plaintext not in stored and hash_key(plaintext) in stored


def test_tokenize_and_detokenize_take_a_key_like_v1(gateway: ServerProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        _, _, key = new_key(client, "carol")
        calls = (
            ("POST", "/tokenize", {"prompt": "hi"}),
            ("POST", "/detokenize", {"tokens": [1]}),
            ("GET", "/tokenizer_info", None),
        )
        for method, path, body in calls:
            refused(client.request(method, path, json=body), 401, "missing_api_key")
            resp = client.request(method, path, json=body, headers=bearer("x"))
            refused(resp, 401, "invalid_api_key")
            # Past the key check: the (single) scripted deployment has no tokenizer.
            resp = client.request(method, path, json=body, headers=bearer(key))
            refused(resp, 400)
            assert resp.json()["error"]["param"] == "model"
