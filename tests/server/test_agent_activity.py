"""A cold first request that needs no raised client timeouts (issue 49): the real CLIs
against a scripted deployment that holds the first token (tests/driver.py) past their
idle timeouts.

Both CLIs give up on a stream that is quiet for 5 minutes, and count no keep-alive
ping: Claude Code (2.1.197) resets its watchdog on every event but ``ping`` (and its
``CLAUDE_STREAM_IDLE_TIMEOUT_MS`` can only raise the 300 s), Codex (0.171.0) on every
SSE event, which an SSE comment (``: ping``) is not (its provider's
``stream_idle_timeout_ms`` lowers it). So a quiet stream sends what each counts every
``stream_activity_s`` (tokenmill.server.sse.with_ticks): ``response.in_progress``
again, and an empty text block then empty text deltas.

* Codex, its idle timeout lowered to 8 s, the activity interval to 0.5 s: with the
  activity events its first request is held well past 8 s and is answered on the
  same stream; without them, Codex gives up on the stream and sends the request again.
* Claude Code at its defaults and the activity interval lowered: the empty text block
  and deltas before a tool call are read as the message they are (the tool loop ends
  as without them).
* Claude Code at its defaults and the server's (``long_prefill``, 6 minutes: make
  agents-32k): its first request held past its 300 s is answered on the same stream,
  where with pings alone it gave up at 300 s and sent the request again unstreamed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.recording_proxy import Exchange, RecordingProxy
from tests.server.test_agent_clis import (
    ANSWER,
    COMMAND,
    SCRIPTED_CTX,
    ScriptedModel,
    claude_env,
    cli,
    codex_env,
    run_cli,
)

# Codex's idle timeout in these tests (its default is 300 s), and the server's
# activity interval: 16 intervals go by in one timeout.
CODEX_IDLE_MS = 8_000
ACTIVITY_S = 0.5
# Activity events the first request is held for: past Codex's lowered timeout.
HELD_FOR = 2 * round(CODEX_IDLE_MS / 1000 / ACTIVITY_S)
# The server's default activity interval (config/settings.py), against Claude Code's
# 300 s: three intervals are past it.
DEFAULT_ACTIVITY_S = 120.0
CLAUDE_IDLE_S = 300.0


class HeldModel(ScriptedModel):
    """The scripted model, but the first request gets nothing until ``release()``
    says so."""

    def __init__(
        self, driver: EngineDriver, tool: str, argument: str, release: Callable[[], bool]
    ) -> None:
        super().__init__(driver, tool, argument)
        self.release = release

    def step(self) -> None:
        if not self.prompts and self.driver.seen("started") and not self.release():
            return
        super().step()


@pytest.fixture
def serve(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> Iterator[Callable[[float], RecordingProxy]]:
    """A scripted deployment's server with ``stream_activity_s`` (0: none), behind a
    recording proxy."""
    proxies: list[RecordingProxy] = []

    def start(activity_s: float) -> RecordingProxy:
        env = {"TOKENMILL_STREAM_ACTIVITY_S": str(activity_s)}
        srv = start_server(config=scripted_deployment(driver, n_ctx=SCRIPTED_CTX), env=env)
        proxies.append(RecordingProxy(srv.url))
        return proxies[-1]

    yield start
    for proxy in proxies:
        proxy.close()


def sent(proxy: RecordingProxy, path: str, marker: str) -> int:
    """How often ``marker`` went back on the first request to ``path`` so far."""
    posts = proxy.posts(path)
    return posts[0].text.count(marker) if posts else 0


def assert_one_stream(exchanges: list[Exchange], answer_marker: str) -> None:
    """The first request was answered on its own stream: no second try of it."""
    first = exchanges[0]
    assert first.status == 200 and first.done, first.text
    assert answer_marker in first.text
    assert first.headers["content-type"].startswith("text/event-stream")


def codex(home: Path, proxy: RecordingProxy) -> tuple[list[str], dict[str, str]]:
    argv = [str(cli("codex")), "exec", "--skip-git-repo-check"]
    argv += ["--dangerously-bypass-approvals-and-sandbox", f"Run the shell command `{COMMAND}`"]
    provider = f"stream_idle_timeout_ms = {CODEX_IDLE_MS}\n"
    return argv, codex_env(home, proxy.url, "scripted", provider)


def test_codex_waits_through_a_long_first_token_on_activity_events(
    serve: Callable[[float], RecordingProxy], driver: EngineDriver, tmp_path: Path
) -> None:
    proxy = serve(ACTIVITY_S)
    argv, env = codex(tmp_path / "home", proxy)
    marker = '"type":"response.in_progress"'  # once at the start, then each activity

    def held_long_enough() -> bool:
        return sent(proxy, "/v1/responses", marker) > HELD_FOR

    model = HeldModel(driver, "exec_command", "cmd", held_long_enough)
    done = run_cli(argv, env, tmp_path, model.step)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stdout.strip().splitlines()[-1] == ANSWER
    responses = proxy.posts("/v1/responses")
    assert_one_stream(responses, '"type":"response.output_item.done"')
    # Two requests, each sent once: the call, then its result (no second try).
    assert len(responses) == 2 == driver.seen("started")
    assert "idle timeout" not in done.stderr


def test_codex_gives_up_on_a_stream_of_pings_alone(
    serve: Callable[[float], RecordingProxy], driver: EngineDriver, tmp_path: Path
) -> None:
    # The same hold without activity events: Codex's timeout fires and it sends the
    # request again (its retries then answered), which is what the events prevent.
    proxy = serve(0)
    argv, env = codex(tmp_path / "home", proxy)
    model = HeldModel(driver, "exec_command", "cmd", lambda: driver.seen("started") >= 2)
    run_cli(argv, env, tmp_path, model.step)  # (its retry then answered)
    first, *_ = responses = proxy.posts("/v1/responses")
    assert not first.done  # the CLI left it before its answer came
    assert len(responses) >= 3  # the first try, its second, and the call's result


def claude(home: Path, proxy: RecordingProxy) -> tuple[list[str], dict[str, str]]:
    argv = [str(cli("claude")), "-p", f"Run the shell command `{COMMAND}`"]
    argv += ["--allowedTools", "Bash"]
    return argv, claude_env(home, proxy.url, "scripted")


def test_claude_code_reads_the_activity_events_before_a_call(
    serve: Callable[[float], RecordingProxy], driver: EngineDriver, tmp_path: Path
) -> None:
    proxy = serve(ACTIVITY_S)
    home = tmp_path / "home"
    home.mkdir()
    argv, env = claude(home, proxy)
    marker = '"delta":{"type":"text_delta","text":""}'

    def held() -> bool:
        return sent(proxy, "/v1/messages", marker) >= 4

    model = HeldModel(driver, "Bash", "command", held)
    done = run_cli(argv, env, tmp_path, model.step)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stdout.strip() == ANSWER
    messages = proxy.posts("/v1/messages")
    assert_one_stream(messages, '"stop_reason":"tool_use"')
    # The call came after an empty text block; the CLI sent the call back.
    blocks = [e["content_block"] for e in messages[0].events() if "content_block" in e]
    assert blocks[0] == {"type": "text", "text": ""} and blocks[1]["type"] == "tool_use"
    (answered,) = [m for m in messages[1].body["messages"] if m["role"] == "assistant"]
    assert [b["type"] for b in answered["content"]][-1] == "tool_use"


@pytest.mark.long_prefill
@pytest.mark.timeout(4 * DEFAULT_ACTIVITY_S + CLAUDE_IDLE_S)
def test_claude_code_at_its_defaults_waits_past_its_idle_timeout(
    start_server: Callable[..., ServerProcess], driver: EngineDriver, tmp_path: Path
) -> None:
    srv = start_server(config=scripted_deployment(driver, n_ctx=SCRIPTED_CTX))
    proxy = RecordingProxy(srv.url)
    try:
        home = tmp_path / "home"
        home.mkdir()
        argv, env = claude(home, proxy)
        # The block's start, then a delta every interval: past 300 s after the third.
        marker = '"type":"content_block_start"'

        def past_the_timeout() -> bool:
            return sent(proxy, "/v1/messages", "text_delta") >= 2 and bool(
                sent(proxy, "/v1/messages", marker)
            )

        model = HeldModel(driver, "Bash", "command", past_the_timeout)
        timeout = 3 * DEFAULT_ACTIVITY_S + CLAUDE_IDLE_S
        done = run_cli(argv, env, tmp_path, model.step, timeout_s=timeout)
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert done.stdout.strip() == ANSWER
        messages = proxy.posts("/v1/messages")
        assert_one_stream(messages, '"stop_reason":"tool_use"')
        assert len(messages) == 2 == driver.seen("started")  # no retry, no fallback
    finally:
        proxy.close()
