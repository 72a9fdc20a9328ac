"""The audit log through a real gateway over HTTP, on SQLite and on PostgreSQL: the
admin API's changes and a batch cancelled by its owner are listed by
``GET /admin/audit`` (paged, filtered) and logged as ``tokenmill.audit`` lines; the
changes the gateway refused are not."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.ledger.helpers import ADMIN_KEY, ENV, admin, new_account, new_key
from tests.waiting import wait_until


@pytest.fixture(params=["sqlite", "postgresql"])
def gateway(
    request: pytest.FixtureRequest,
    start_server: Callable[..., ServerProcess],
    driver: EngineDriver,
) -> ServerProcess:
    args = [] if request.param == "sqlite" else ["--ledger", request.getfixturevalue("pg_url")]
    return start_server(config=scripted_deployment(driver), env=ENV, args=args)


def audit_lines(srv: ServerProcess) -> list[dict[str, Any]]:
    return [
        json.loads(line.split("tokenmill.audit: ", 1)[1])
        for line in srv.log().splitlines()
        if "tokenmill.audit: " in line
    ]


def listed(adm: httpx.Client, **query: Any) -> list[dict[str, Any]]:
    resp = adm.get("/admin/audit", params=query)
    assert resp.status_code == 200, resp.text
    data: list[dict[str, Any]] = resp.json()["data"]
    return data


def test_admin_changes_are_listed_and_logged_and_refused_ones_are_not(
    gateway: ServerProcess,
) -> None:
    with admin(gateway.url) as adm:
        acc = new_account(adm, "audited", 1000)
        assert adm.post(f"/admin/accounts/{acc}/credits", json={"amount": 500}).status_code == 200
        overdraw = adm.post(f"/admin/accounts/{acc}/credits", json={"amount": -(10**6)})
        assert overdraw.status_code == 400, overdraw.text
        assert adm.patch(f"/admin/accounts/{acc}", json={"weight": 2.0}).status_code == 200
        assert adm.patch("/admin/accounts/acct_nobody", json={"weight": 2.0}).status_code == 404
        assert adm.post("/admin/keys", json={"account": "acct_nobody"}).status_code == 404
        key_id, _ = new_key(adm, acc, rpm=5)
        assert adm.patch(f"/admin/keys/{key_id}", json={"priority": "batch"}).status_code == 200
        revoked = adm.delete(f"/admin/keys/{key_id}", headers={"x-request-id": "revoke-1"})
        assert revoked.status_code == 200, revoked.text

        found = listed(adm)
        assert [e["action"] for e in found] == [
            "key.revoked",
            "key.updated",
            "key.created",
            "account.updated",
            "account.credited",
            "account.created",
        ]
        assert {e["actor"] for e in found} == {"admin"}
        assert found[0]["request_id"] == "revoke-1" and found[0]["target_id"] == key_id
        assert found[0]["before"]["revoked"] is None
        assert found[0]["after"]["revoked"] == revoked.json()["revoked"]
        assert found[4]["before"]["balance"] == 1000 and found[4]["after"]["balance"] == 1500
        assert found[3]["after"]["weight"] == 2.0 and found[3]["before"]["weight"] == 1.0

        # Pages of two, newest first, each page's last_id the next one's cursor.
        pages: list[dict[str, Any]] = []
        after = None
        while True:
            resp = adm.get(
                "/admin/audit", params={"limit": 2, **({"after": after} if after else {})}
            )
            body = resp.json()
            pages += body["data"]
            if not body["has_more"]:
                break
            after = body["last_id"]
        assert pages == found
        listed_for_account = listed(adm, target=acc)
        assert [e["action"] for e in listed_for_account] == [
            "account.updated",
            "account.credited",
            "account.created",
        ]
        assert [e["target_id"] for e in listed(adm, action="key.revoked")] == [key_id]
        assert listed(adm, actor="system") == []
        for param, value in (("limit", 0), ("after", 2**70), ("since", -1), ("until", "nan")):
            bad = adm.get("/admin/audit", params={param: value})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text

    # What was listed was logged, one JSON line an entry, in the order committed.
    def all_logged() -> list[dict[str, Any]] | None:
        got = audit_lines(gateway)
        return got if len(got) == len(found) else None

    lines = wait_until(all_logged, "the audit log lines")
    assert [{k: v for k, v in line.items() if k != "event"} for line in lines] == found[::-1]

    # The same list from the shell.
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill", "audit", "--target", acc, "--url", gateway.url],
        capture_output=True,
        text=True,
        env={"TOKENMILL_ADMIN_KEY": ADMIN_KEY, "PATH": "/usr/bin:/bin"},
        check=True,
    )
    assert json.loads(out.stdout)["data"] == listed_for_account


def test_a_batch_its_owner_cancels_is_audited_under_its_key(gateway: ServerProcess) -> None:
    with admin(gateway.url) as adm:
        acc = new_account(adm, "batcher", 10**6)
        key_id, key = new_key(adm, acc)
    client = openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)
    line = {
        "custom_id": "c0",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "scripted", "prompt": "a b", "max_tokens": 4},
    }
    upload = io.BytesIO((json.dumps(line) + "\n").encode())
    f = client.files.create(file=("in.jsonl", upload), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
    )
    cancelled = client.batches.cancel(batch.id, extra_headers={"x-request-id": "cancel-1"})
    assert cancelled.status == "cancelling"
    with httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {key}"}) as user:
        assert user.get("/admin/audit").status_code == 403
    with admin(gateway.url) as adm:
        [entry] = listed(adm, target_type="batch")
    assert (entry["action"], entry["actor"], entry["request_id"]) == (
        "batch.cancelled",
        f"key:{key_id}",
        "cancel-1",
    )
    assert entry["target_id"] == batch.id and entry["before"]["status"] == "in_progress"
