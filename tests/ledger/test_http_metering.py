"""Auth, credit and exact settlement through a real metered gateway over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, launch
from tests.ledger.helpers import (
    ADMIN_KEY,
    CONFIG,
    ENV,
    account,
    admin,
    chat,
    expected_charge,
    new_account,
    new_key,
    receipt,
)
from tests.sse import events, to_done
from tests.sse import usage as sse_usage

# Far more tokens than a client needs to read three events (the window holds 2,048).
MANY_TOKENS = 1500


@pytest.fixture(scope="module")
def metered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = launch(tmp_path_factory.mktemp("metered"), config=CONFIG, env=ENV)
    yield srv
    srv.stop()


@pytest.fixture
def adm(metered: ServerProcess) -> Iterator[httpx.Client]:
    with admin(metered.url) as client:
        yield client


def client_for(srv: ServerProcess, key: str) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {key}"}, timeout=60)


def test_auth_is_required(metered: ServerProcess, adm: httpx.Client) -> None:
    assert httpx.get(f"{metered.url}/health").status_code == 200
    missing = httpx.get(f"{metered.url}/v1/models")
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    assert "x-request-id" in missing.headers
    bad = httpx.get(f"{metered.url}/v1/models", headers={"authorization": "Bearer tm-nope"})
    assert bad.status_code == 401
    assert httpx.get(f"{metered.url}/admin/accounts/anonymous").status_code == 401
    acc = new_account(adm, "auth", 0)
    _, key = new_key(adm, acc)
    with client_for(metered, key) as user:
        assert user.get("/v1/models").status_code == 200
        forbidden = user.get(f"/admin/accounts/{acc}")
        assert forbidden.status_code == 403
        assert forbidden.json()["error"]["type"] == "permission_error"
        assert user.post("/admin/keys", json={"account": acc}).status_code == 403


def test_no_credit_is_402_before_any_token(metered: ServerProcess, adm: httpx.Client) -> None:
    acc = new_account(adm, "broke", 10)
    _, key = new_key(adm, acc)
    with client_for(metered, key) as user:
        for stream in (False, True):
            resp = user.post("/v1/chat/completions", json=chat(50, stream=stream))
            assert resp.status_code == 402, resp.text
            err = resp.json()["error"]
            assert err["code"] == "insufficient_credit" and "10 available" in err["message"]
            assert user.get(f"/v1/usage/{resp.headers['x-request-id']}").status_code == 404
    state = account(adm, acc)
    assert (state["balance"], state["held"]) == (10, 0)


def test_request_over_the_key_tpm_is_400_not_429(metered: ServerProcess, adm: httpx.Client) -> None:
    # A request larger than the key's whole minute could never pass by waiting: a
    # 429 with Retry-After would have clients retry it forever.
    acc = new_account(adm, "small-tpm", 10**6)
    _, key = new_key(adm, acc, tpm=60)
    with client_for(metered, key) as user:
        for stream in (False, True):
            resp = user.post("/v1/chat/completions", json=chat(100, stream=stream))
            assert resp.status_code == 400, resp.text
            assert "retry-after" not in resp.headers
            err = resp.json()["error"]
            assert err["type"] == "invalid_request_error"
            assert (err["code"], err["param"]) == ("request_too_large", "max_tokens")
            assert "60 tokens per minute" in err["message"]
        # The refused requests took nothing from the window: a small one passes.
        assert user.post("/v1/chat/completions", json=chat(8)).status_code == 200
    state = account(adm, acc)
    assert state["held"] == 0


def test_revoked_key_is_refused_at_once(metered: ServerProcess, adm: httpx.Client) -> None:
    acc = new_account(adm, "revoked", 10**6)
    key_id, key = new_key(adm, acc)
    with client_for(metered, key) as user:
        assert user.post("/v1/chat/completions", json=chat(2)).status_code == 200
        assert adm.delete(f"/admin/keys/{key_id}").json()["revoked"] is not None
        resp = user.post("/v1/chat/completions", json=chat(2))
        assert resp.status_code == 401
        assert user.get("/v1/models").status_code == 401


def test_non_streamed_settles_exactly(metered: ServerProcess, adm: httpx.Client) -> None:
    acc = new_account(adm, "plain", 10**6)
    _, key = new_key(adm, acc)
    with client_for(metered, key) as user:
        resp = user.post("/v1/chat/completions", json=chat(12))
        assert resp.status_code == 200
        usage = resp.json()["usage"]
        r = receipt(user, resp.headers["x-request-id"])
    assert (r["prompt_tokens"], r["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert r["charged"] == expected_charge(r) > 0 and r["charged"] <= r["held"]
    state = account(adm, acc)
    assert (state["balance"], state["held"]) == (10**6 - r["charged"], 0)


def test_constrained_stream_settles_exactly(metered: ServerProcess, adm: httpx.Client) -> None:
    # Constrained tokens are tokens: the grammar ends the answer early (stop), the
    # schema the gateway adds to the prompt is counted, and all of it is charged.
    acc = new_account(adm, "constrained", 10**6)
    _, key = new_key(adm, acc)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    rf = {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}
    with client_for(metered, key) as user:
        plain = user.post("/v1/chat/completions", json=chat(40))
        resp = user.post("/v1/chat/completions", json={**chat(40), "response_format": rf})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        r = receipt(user, resp.headers["x-request-id"])
    assert json.loads(body["choices"][0]["message"]["content"])["ok"] in (True, False)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]
    assert (r["prompt_tokens"], r["completion_tokens"]) == (
        body["usage"]["prompt_tokens"],
        body["usage"]["completion_tokens"],
    )
    assert r["charged"] == expected_charge(r) > 0
    assert account(adm, acc)["held"] == 0


def test_streamed_settles_exactly(metered: ServerProcess, adm: httpx.Client) -> None:
    acc = new_account(adm, "stream", 10**6)
    _, key = new_key(adm, acc)
    usage = None
    with (
        client_for(metered, key) as user,
        user.stream("POST", "/v1/chat/completions", json=chat(12, stream=True)) as resp,
    ):
        assert resp.status_code == 200
        rid = resp.headers["x-request-id"]
        for event in to_done(resp):
            assert "error" not in event, event
            usage = sse_usage(event) or usage
    assert usage is not None
    with client_for(metered, key) as user:
        r = receipt(user, rid)
    assert r["completion_tokens"] == usage["completion_tokens"] > 0
    assert r["charged"] == expected_charge(r)
    assert account(adm, acc)["balance"] == 10**6 - r["charged"]


def test_disconnect_settles_for_tokens_produced(metered: ServerProcess, adm: httpx.Client) -> None:
    acc = new_account(adm, "gone", 10**6)
    _, key = new_key(adm, acc)
    # Without an end-of-sequence the answer runs to max_tokens, which the client
    # leaving after three events cuts short, however slowly it reads them.
    body = chat(MANY_TOKENS, stream=True) | {"ignore_eos": True}
    with client_for(metered, key) as user:
        with user.stream("POST", "/v1/chat/completions", json=body) as resp:
            rid = resp.headers["x-request-id"]
            stream = events(resp)
            seen = [next(stream) for _ in range(3)]
            assert all(isinstance(e, dict) and "error" not in e for e in seen), seen
        # Left mid-stream.
        r = receipt(user, rid)
    assert r["finish_reason"] == "abort"
    assert 2 <= r["completion_tokens"] < MANY_TOKENS
    assert r["charged"] == expected_charge(r) < r["held"]
    state = account(adm, acc)
    assert (state["balance"], state["held"]) == (10**6 - r["charged"], 0)


def test_usage_is_private_to_its_key(metered: ServerProcess, adm: httpx.Client) -> None:
    acc = new_account(adm, "private", 10**6)
    _, key = new_key(adm, acc)
    _, other = new_key(adm, acc)
    with client_for(metered, key) as user:
        rid = user.post("/v1/chat/completions", json=chat(2)).headers["x-request-id"]
        mine = receipt(user, rid)
    with client_for(metered, other) as stranger:
        assert stranger.get(f"/v1/usage/{rid}").status_code == 404
    assert adm.get(f"/v1/usage/{rid}").json() == mine
    listing = adm.get(f"/admin/accounts/{acc}/usage").json()["data"]
    assert [r["request_id"] for r in listing] == [rid]


def test_cli_drives_the_admin_api(metered: ServerProcess, adm: httpx.Client) -> None:
    def cli(*args: str) -> dict[str, object]:
        out = subprocess.run(
            [sys.executable, "-m", "tokenmill", *args, "--url", metered.url],
            capture_output=True,
            text=True,
            env={"TOKENMILL_ADMIN_KEY": ADMIN_KEY, "PATH": "/usr/bin:/bin"},
            check=True,
        )
        data: dict[str, object] = json.loads(out.stdout)
        return data

    acc = cli("accounts", "create", "cli-made")
    assert cli("credits", "add", str(acc["id"]), "2500")["balance"] == 2500
    key = cli("keys", "create", str(acc["id"]), "--rpm", "5")
    assert str(key["key"]).startswith("tm-") and key["rpm"] == 5
    assert cli("keys", "revoke", str(key["id"]))["revoked"] is not None
    assert cli("usage", str(acc["id"]))["data"] == []
    assert account(adm, str(acc["id"]))["balance"] == 2500


def test_key_plaintext_is_nowhere(metered: ServerProcess, adm: httpx.Client) -> None:
    acc = new_account(adm, "secret", 10**6)
    key_id, key = new_key(adm, acc)
    with client_for(metered, key) as user:
        assert user.post("/v1/chat/completions", json=chat(2)).status_code == 200
    adm.delete(f"/admin/keys/{key_id}")
    data = metered.data_dir
    files = [p for p in data.iterdir() if p.name.startswith("ledger.sqlite3")]
    assert files, list(data.iterdir())
    secret = key.encode()
    for path in [*files, Path(metered.log_path)]:
        assert secret not in path.read_bytes(), path
        assert key.removeprefix("tm-").encode() not in path.read_bytes(), path
