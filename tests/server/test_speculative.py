"""Speculative decoding on the real model (``speculative = "ngram"``), through HTTP: one
gateway, the same model twice, with and without drafts, one slot each so every answer
is computed alone (the same batch shapes on both sides).

Copy-heavy prompts, where prompt lookup drafts most tokens: greedy answers are the
same with and without drafts, drafts were verified and kept (the replica's counters),
``max_tokens`` and stop strings end the answer exactly where they do without drafts,
usage and the bill count exactly the tokens streamed, a constrained answer is still
valid JSON of its schema, and a conversation's next turn finds its whole history
cached (the slot's cells after rejected drafts hold exactly what was kept).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, launch
from tests.sse import events, text
from tests.waiting import HANG_S, wait_until

SOURCE = (
    "def total(items):\n"
    "    result = 0\n"
    "    for item in items:\n"
    "        result = result + item.price * item.quantity\n"
    "    return result\n"
)
COPY = "Here is a Python function.\n\n" + SOURCE + "\nThe same function, copied exactly:\n\n"
JSON_REPAIR = (
    'Broken: {"name": "Ada", "langs": ["en", "fr"], "age": 36,}\n'
    'Fixed: {"name": "Ada", "langs": ["en", "fr"], "age": 36}\n'
    'Broken: {"name": "Grace", "langs": ["en"], "age": 85,}\n'
    "Fixed:"
)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    table = (
        'n_threads = 1\nmax_num_seqs = 1\nn_ctx = 1024\nkv_host_bytes = 0\nkv_layout = "per_slot"\n'
    )
    # Every draft found is verified ("always"): whether drafting pays on this CPU's
    # step costs is the rule's business (tests/engines/test_speculative.py), not this
    # test's, which checks what drafts do to answers, bills and the cache.
    srv = launch(
        tmp_path_factory.mktemp("speculative"),
        config=(
            f'[[deployments]]\nid = "plain"\n{table}'
            f'[[deployments]]\nid = "drafting"\nspeculative = "ngram"\n'
            f'speculative_rule = "always"\n{table}'
        ),
    )
    yield srv
    srv.stop()


def complete(gw: ServerProcess, model: str, prompt: str, **more: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 96, "temperature": 0, **more}
    r = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    return dict(r.json())


def counters(gw: ServerProcess) -> dict[str, int]:
    d = httpx.get(f"{gw.url}/v1/deployments/drafting", timeout=HANG_S).json()
    kv = d["replicas"][0]["kv"]
    return {"drafted": kv["spec_drafted"], "accepted": kv["spec_accepted"]}


@pytest.mark.parametrize("prompt", [COPY, JSON_REPAIR], ids=["code", "json"])
def test_greedy_answers_are_the_same_with_drafts_and_drafts_are_kept(
    gw: ServerProcess, prompt: str
) -> None:
    before = counters(gw)
    plain = complete(gw, "plain", prompt)
    drafted = complete(gw, "drafting", prompt)
    assert drafted["choices"][0]["text"] == plain["choices"][0]["text"]
    assert drafted["usage"] == plain["usage"]

    # (The replica's counters come with its status, pushed every 0.25 s.)
    def kept() -> dict[str, int] | None:
        now = counters(gw)
        return now if now["accepted"] > before["accepted"] else None

    after = wait_until(kept, "drafted tokens kept")
    assert after["drafted"] >= after["accepted"]


def test_max_tokens_and_stop_strings_end_the_answer_where_they_do_without_drafts(
    gw: ServerProcess,
) -> None:
    for more in ({"max_tokens": 7}, {"max_tokens": 23}, {"stop": ["quantity"]}):
        plain = complete(gw, "plain", COPY, **more)
        drafted = complete(gw, "drafting", COPY, **more)
        assert drafted["choices"][0] == plain["choices"][0], more
        assert drafted["usage"] == plain["usage"], more
        if "max_tokens" in more:
            assert drafted["usage"]["completion_tokens"] == more["max_tokens"]


def test_a_streamed_answer_bills_exactly_the_tokens_streamed(gw: ServerProcess) -> None:
    body = {
        "model": "drafting",
        "prompt": COPY,
        "max_tokens": 64,
        "temperature": 0,
        "ignore_eos": True,  # all 64 tokens, wherever the model would end
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_S) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        got = [e for e in events(r) if isinstance(e, dict)]
        rid = r.headers["x-request-id"]
    streamed = "".join(text(e) for e in got)
    usage = next(e["usage"] for e in got if e.get("usage"))
    plain = complete(gw, "plain", COPY, max_tokens=64, ignore_eos=True)
    assert streamed == plain["choices"][0]["text"]
    receipt = httpx.get(f"{gw.url}/v1/usage/{rid}", timeout=HANG_S).json()
    assert receipt["completion_tokens"] == usage["completion_tokens"] == 64


def test_a_constrained_answer_is_valid_json_of_its_schema(gw: ServerProcess) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    body = {
        "model": "drafting",
        "messages": [{"role": "user", "content": JSON_REPAIR}],
        "max_tokens": 64,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    }
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    parsed = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(parsed) == {"name", "age"} and isinstance(parsed["age"], int)


def test_the_next_turn_finds_the_whole_drafted_answer_cached(gw: ServerProcess) -> None:
    first = complete(gw, "drafting", COPY)
    following = COPY + first["choices"][0]["text"] + "\nNow rename it:"
    second = complete(gw, "drafting", following, max_tokens=4)
    held = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1
    # Everything written to the slot's cells, the last answer token aside (sampled,
    # never decoded): rejected drafts left nothing behind to shift the rest.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= held, second["usage"]
    # And what that cached history computes is what computing it anew does.
    assert (
        second["choices"][0]["text"]
        == complete(gw, "plain", following, max_tokens=4)["choices"][0]["text"]
    )


def test_a_request_asks_for_drafts_where_the_deployment_has_none(gw: ServerProcess) -> None:
    def kept_on_plain() -> int | None:
        d = httpx.get(f"{gw.url}/v1/deployments/plain", timeout=HANG_S).json()
        return int(d["replicas"][0]["kv"]["spec_accepted"]) or None

    on = complete(gw, "plain", COPY, speculative=True)
    assert on["choices"][0]["text"] == complete(gw, "plain", COPY)["choices"][0]["text"]
    assert wait_until(kept_on_plain, "the plain deployment to have drafted for it") > 0
    bad = httpx.post(
        f"{gw.url}/v1/completions",
        json={"model": "plain", "prompt": "Hi", "max_tokens": 1, "speculative": "yes"},
        timeout=HANG_S,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative", bad.text
