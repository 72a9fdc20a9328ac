"""Rate-limit headers through the official SDKs, from two gateways sharing one
PostgreSQL ledger: what a key may still do this minute, counted across both, on
every response (a 429 too), in OpenAI's ``x-ratelimit-*`` and Anthropic's
``anthropic-ratelimit-*``.

The gateways' ledger reads a clock the test sets (tests/clockfile.py): the window
never ends mid-test, and the test steps into the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.clockfile import ClockFile
from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.ledger.helpers import ENV, admin, new_account, new_key, receipt
from tokenmill.ledger.ratelimits import RATE_WINDOW_S
from tokenmill.server.ratelimits import go_duration

# The start of a rate window (a minute of 2023); the test's clock stands 15.25 s in.
WINDOW_START = 28_333_333 * RATE_WINDOW_S
IN_WINDOW = 15.25
PROMPT = "a b c d"  # four tokens: the scripted engine counts words
MAX_TOKENS = 6


def limits(headers: Mapping[str, str], prefix: str) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.startswith(prefix)}


def openai_limits(headers: Mapping[str, str]) -> dict[str, str]:
    return limits(headers, "x-ratelimit-")


def expected_openai(rpm: int, requests: int, tpm: int, tokens: int, reset: str) -> dict[str, str]:
    return {
        "x-ratelimit-limit-requests": str(rpm),
        "x-ratelimit-remaining-requests": str(rpm - requests),
        "x-ratelimit-reset-requests": reset if requests else "0s",
        "x-ratelimit-limit-tokens": str(tpm),
        "x-ratelimit-remaining-tokens": str(tpm - tokens),
        "x-ratelimit-reset-tokens": reset if tokens else "0s",
    }


@pytest.fixture
def clock(tmp_path: Path) -> ClockFile:
    return ClockFile(tmp_path / "clock", WINDOW_START + IN_WINDOW)


@pytest.fixture
def gateways(
    start_server: Callable[..., ServerProcess],
    driver: EngineDriver,
    pg_url: str,
    clock: ClockFile,
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    config = scripted_deployment(driver, max_num_seqs=4)
    env = {**ENV, **clock.env}
    a = start_server(config=config, env=env, args=["--ledger", pg_url])
    b = start_server(config=config, env=env, args=["--ledger", pg_url])
    yield a, b


def stream_open(client: openai.OpenAI, rid: str) -> Any:
    """A streamed completion whose head has arrived (the request is held and running)."""
    return client.completions.with_raw_response.create(
        model="scripted",
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        stream=True,
        extra_headers={"x-request-id": rid},
    )


def drain(raw: Any) -> None:
    for _ in raw.parse():
        pass


def test_openai_headers_count_across_two_gateways_and_reset_with_the_window(
    gateways: tuple[ServerProcess, ServerProcess], driver: EngineDriver, clock: ClockFile
) -> None:
    a, b = gateways
    with admin(a.url) as adm:
        acc = new_account(adm, "paced", 0)
        _, key = new_key(adm, acc, rpm=3, tpm=40)
        _, free_key = new_key(adm, acc)
    oa = openai.OpenAI(base_url=a.base_url, api_key=key, max_retries=0)
    ob = openai.OpenAI(base_url=b.base_url, api_key=key, max_retries=0)
    reset = go_duration(RATE_WINDOW_S - IN_WINDOW)
    assert reset == "44.75s"
    held = len(PROMPT.split()) + MAX_TOKENS  # prompt + max_tokens, counted while it runs

    r1 = stream_open(oa, "rl-1")
    assert openai_limits(r1.headers) == expected_openai(3, 1, 40, held, reset)
    r2 = stream_open(ob, "rl-2")  # the other gateway counts the first one's request
    assert openai_limits(r2.headers) == expected_openai(3, 2, 40, 2 * held, reset)
    driver.emit("rl-1", 2)
    driver.finish("rl-1")
    driver.finish("rl-2")
    drain(r1)
    drain(r2)
    with admin(b.url) as adm:
        receipt(adm, "rl-1")
        receipt(adm, "rl-2")
    # Settled: each keeps its prompt and what it generated (2 and 0 tokens).
    used = 2 * len(PROMPT.split()) + 2
    models = ob.models.with_raw_response.list()  # a route that counts nothing has them too
    assert openai_limits(models.headers) == expected_openai(3, 2, 40, used, reset)

    r3 = stream_open(oa, "rl-3")
    assert openai_limits(r3.headers) == expected_openai(3, 3, 40, used + held, reset)
    with pytest.raises(openai.RateLimitError) as refused:
        ob.completions.create(model="scripted", prompt=PROMPT, max_tokens=MAX_TOKENS)
    assert refused.value.code == "rate_limit_exceeded"
    assert refused.value.response.headers["retry-after"] == "45"
    assert openai_limits(refused.value.response.headers) == expected_openai(
        3, 3, 40, used + held, reset
    )
    driver.finish("rl-3")
    drain(r3)

    # A key without limits gets no such headers.
    free = openai.OpenAI(base_url=a.base_url, api_key=free_key, max_retries=0)
    assert openai_limits(free.models.with_raw_response.list().headers) == {}

    # The next window starts from nothing, on either gateway.
    clock.set(WINDOW_START + RATE_WINDOW_S + 30)
    for client in (oa, ob):
        fresh = client.models.with_raw_response.list()
        assert openai_limits(fresh.headers) == expected_openai(3, 0, 40, 0, "0s")


def test_anthropic_headers_on_the_messages_routes(
    gateways: tuple[ServerProcess, ServerProcess], driver: EngineDriver
) -> None:
    a, b = gateways
    with admin(a.url) as adm:
        acc = new_account(adm, "paced-anthropic", 0)
        _, key = new_key(adm, acc, rpm=2, tpm=50)
    ca = anthropic.Anthropic(base_url=a.url, api_key=key, max_retries=0)
    cb = anthropic.Anthropic(base_url=b.url, api_key=key, max_retries=0)
    window_end = datetime.fromtimestamp(WINDOW_START + RATE_WINDOW_S, UTC)
    reset = window_end.strftime("%Y-%m-%dT%H:%M:%SZ")

    raw = ca.messages.with_raw_response.create(
        model="scripted",
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": PROMPT}],
        stream=True,
        extra_headers={"x-request-id": "rl-m1"},
    )
    held = int(driver.started("rl-m1")["prompt_tokens"]) + MAX_TOKENS
    token_headers = {
        f"anthropic-ratelimit-{kind}-{field}": value
        for kind in ("tokens", "input-tokens", "output-tokens")
        for field, value in (("limit", "50"), ("remaining", str(50 - held)), ("reset", reset))
    }
    assert limits(raw.headers, "anthropic-ratelimit-") == {
        "anthropic-ratelimit-requests-limit": "2",
        "anthropic-ratelimit-requests-remaining": "1",
        "anthropic-ratelimit-requests-reset": reset,
        **token_headers,
    }
    assert openai_limits(raw.headers) == {}
    driver.finish("rl-m1")
    for _ in raw.parse():
        pass

    second = cb.messages.with_raw_response.create(
        model="scripted",
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": PROMPT}],
        stream=True,
        extra_headers={"x-request-id": "rl-m2"},
    )
    assert second.headers["anthropic-ratelimit-requests-remaining"] == "0"
    with pytest.raises(anthropic.RateLimitError) as refused:
        ca.messages.create(
            model="scripted", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": "x"}]
        )
    headers = refused.value.response.headers
    assert refused.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert headers["retry-after"] == "45"
    assert headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert headers["anthropic-ratelimit-requests-reset"] == reset
    driver.finish("rl-m2")
    for _ in second.parse():
        pass


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.02, "20ms"),
        (0.9994, "999ms"),
        (1, "1s"),
        (59.5, "59.5s"),
        (60, "1m0s"),
        (360, "6m0s"),
        (90.25, "1m30.25s"),
        (3600, "1h0m0s"),
        (86_400 * 7, "168h0m0s"),
    ],
)
def test_durations_read_as_openai_writes_them(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text
