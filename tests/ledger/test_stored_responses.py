"""Stored responses are durable: a conversation continues on another gateway sharing
the PostgreSQL ledger, a response survives its gateway's restart, and an account
never sees another's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from tests.conftest import ServerProcess, launch
from tests.ledger.helpers import CONFIG, ENV, admin, new_account, new_key

MODEL = "smollm2"


def client(server: ServerProcess, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)


def test_a_conversation_continues_on_a_second_gateway(
    start_server: Callable[..., ServerProcess], pg_url: str
) -> None:
    a = start_server(config=CONFIG, env=ENV, args=["--ledger", pg_url])
    b = start_server(config=CONFIG, env=ENV, args=["--ledger", pg_url])
    with admin(a.url) as adm:
        _, alice = new_key(adm, new_account(adm, "alice", 10**9))
        _, bob = new_key(adm, new_account(adm, "bob", 10**9))
    with client(a, alice) as on_a, client(b, alice) as on_b, client(b, bob) as bob_on_b:
        first = on_a.responses.create(
            model=MODEL,
            instructions="You are terse.",
            input="My name is Ada. Say hello.",
            max_output_tokens=8,
            temperature=0,
        )
        second = on_b.responses.create(
            model=MODEL,
            previous_response_id=first.id,
            input="What is my name?",
            max_output_tokens=8,
            temperature=0,
        )
        assert second.previous_response_id == first.id
        items = on_b.responses.input_items.list(second.id, order="asc").data
        texts = [getattr(i, "content", None) for i in items]
        assert [i.type for i in items] == ["message", "message", "message"]
        assert texts[0][0].text == "My name is Ada. Say hello."  # type: ignore[index]
        assert texts[1][0].text == first.output_text  # type: ignore[index]
        assert on_a.responses.retrieve(second.id).output_text == second.output_text
        # Another account's response is not there for bob, on any gateway.
        with pytest.raises(openai.NotFoundError):
            bob_on_b.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            bob_on_b.responses.create(
                model=MODEL, previous_response_id=first.id, input="Hi.", max_output_tokens=4
            )
        with pytest.raises(openai.NotFoundError):
            bob_on_b.responses.delete(first.id)
        assert on_b.responses.retrieve(first.id).id == first.id


def test_a_stored_response_survives_a_restart(tmp_path: Path) -> None:
    server = launch(tmp_path)
    try:
        with client(server) as c:
            stored = c.responses.create(
                model=MODEL, input="Name a colour.", max_output_tokens=6, temperature=0
            )
    finally:
        server.stop()
    again = launch(tmp_path)  # the same data folder: the same SQLite ledger
    try:
        with client(again) as c:
            assert c.responses.retrieve(stored.id).model_dump() == stored.model_dump()
            after = c.responses.create(
                model=MODEL,
                previous_response_id=stored.id,
                input="Another one.",
                max_output_tokens=6,
                temperature=0,
            )
            assert after.status in ("completed", "incomplete")
    finally:
        again.stop()
