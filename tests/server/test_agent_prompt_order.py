"""A captured agent request rendered both ways, ``prompt_order = "stable_first"`` (the
default) and ``"as_sent"``: the same text, and only the documented moves within the
system turn (tokenmill.chat.layout, docs/agent-apis.md).

The requests in ``agent_requests/`` are the real CLIs' (tests/server/
test_agent_sessions.py's second session, in ``project-b``, a git repository: Claude
Code 2.1.197's first ``POST /v1/messages``, Codex 0.171.0's first ``POST
/v1/responses``), their temporary paths written as ``/home/user/...``. One server
holds two scripted deployments that differ in ``prompt_order`` only; the scripted
engine reports the turns it was given (its ``started`` event's ``messages``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.server.test_agent_clis import SCRIPTED_CTX

REQUESTS = Path(__file__).parent / "agent_requests"
CLAUDE_CODE = REQUESTS / "claude-code-2.1.197.json"
CODEX = REQUESTS / "codex-0.171.0.json"
ORDERS = ("stable_first", "as_sent")


@pytest.fixture
def both(start_server: Callable[..., ServerProcess], driver: EngineDriver) -> ServerProcess:
    """A server with a scripted deployment of each ``prompt_order``, named after it."""
    config = "".join(
        scripted_deployment(driver, id=order, n_ctx=SCRIPTED_CTX, prompt_order=order)
        for order in ORDERS
    )
    return start_server(config=config)


def rendered(
    srv: ServerProcess, driver: EngineDriver, path: str, body: dict[str, Any]
) -> dict[str, list[dict[str, str]]]:
    """The turns the engine is given for ``body`` on each deployment."""
    turns = {}
    for order in ORDERS:
        seen = driver.seen("started")
        with httpx.Client(base_url=srv.url, timeout=60.0) as client:
            request = client.build_request(
                "POST", path, json={**body, "model": order, "stream": True}
            )
            response = client.send(request, stream=True)
            started = driver.wait("started", count=seen + 1)
            driver.say(started["id"], json.dumps({"response": "Done."}))
            driver.finish(started["id"])
            response.read()
            assert response.status_code == 200, response.text
        turns[order] = started["messages"]
    return turns


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def section(text: str, start: str, end: str | None) -> str:
    """``text`` from ``start`` to ``end`` (or its end)."""
    at = text.index(start)
    return text[at : text.index(end, at) if end is not None else len(text)]


def test_claude_codes_request_moves_only_its_session_lines_to_the_end_of_the_system_turn(
    both: ServerProcess, driver: EngineDriver
) -> None:
    body = json.loads(CLAUDE_CODE.read_text())
    turns = rendered(both, driver, "/v1/messages", body)
    sent, stable = turns["as_sent"], turns["stable_first"]
    # The messages keep their order and their text; only the system turn changes.
    assert [t["role"] for t in sent] == [t["role"] for t in stable]
    assert sent[0]["role"] == "system" and sent[1:] == stable[1:]
    before, after = sent[0]["content"], stable[0]["content"]
    assert sorted(paragraphs(before)) == sorted(paragraphs(after))  # the same text
    # What moves (docs/agent-apis.md): the # Memory and # Environment sections (block
    # 3), the git status (block 3's end), in order, then the billing header (block 1),
    # which changes with every first message.
    moved = [
        section(before, "# Memory\n", "# Environment\n"),
        section(before, "# Environment\n", "# Context management\n"),
        section(before, "gitStatus: ", "\n\nYou can call the following tools"),
        section(before, "x-anthropic-billing-header:", "\n\n"),
    ]
    tail = [p for m in moved for p in paragraphs(m)]
    assert paragraphs(after) == [p for p in paragraphs(before) if p not in tail] + tail
    # So the tools' description comes before every line of the session's own.
    assert after.index("You can call the following tools") < after.index("# Environment")
    assert before.index("# Environment") < before.index("You can call the following tools")


def test_codexs_request_is_rendered_as_sent(both: ServerProcess, driver: EngineDriver) -> None:
    # Codex writes its session's lines (<environment_context>) in a user message after
    # its instructions: nothing of a Responses request moves.
    body = json.loads(CODEX.read_text())
    turns = rendered(both, driver, "/v1/responses", body)
    assert turns["stable_first"] == turns["as_sent"]
    context = [t for t in turns["as_sent"] if "<environment_context>" in t["content"]]
    assert [t["role"] for t in context] == ["user"]


def test_system_blocks_after_the_last_cache_breakpoint_go_after_the_tools(
    both: ServerProcess, driver: EngineDriver
) -> None:
    # The client marks where its stable prefix ends; what follows it changes.
    body = {
        "max_tokens": 100,
        "system": [
            {"type": "text", "text": "You answer questions about the weather."},
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "The time is 12:04."},
        ],
        "tools": [{"name": "forecast", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": "Rain tomorrow?"}],
    }
    turns = rendered(both, driver, "/v1/messages", body)
    sent, stable = turns["as_sent"][0]["content"], turns["stable_first"][0]["content"]
    assert sent.startswith("You answer questions about the weather.\n\nBe brief.\n\nThe time")
    assert stable.startswith("You answer questions about the weather.\n\nBe brief.\n\nYou can")
    assert stable.endswith("\n\nThe time is 12:04.")
    assert sorted(paragraphs(sent)) == sorted(paragraphs(stable))
    assert turns["as_sent"][1:] == turns["stable_first"][1:]
