"""`tokenmill complete` and a scripted `tokenmill chat` session in a real terminal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

import pexpect  # type: ignore[import-untyped]

from tests.client.conftest import LONG_PROMPT
from tests.conftest import ServerProcess, free_port
from tests.driver import EngineDriver, scripted_deployment
from tokenmill import Client
from tokenmill.client.cli import PROMPT

ENV = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}


def tokenmill(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=180,
        env=ENV,
    )


def test_complete_streams_to_stdout(server: ServerProcess) -> None:
    with Client(server.url) as client:
        expected = client.complete("The sky is", max_tokens=8, temperature=0).text
    args = ["--url", server.url, "--max-tokens", "8", "--temperature", "0"]
    proc = tokenmill("complete", "The sky is", *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + ("" if expected.endswith("\n") else "\n")
    assert proc.stderr == ""
    # '-' reads the prompt from stdin.
    proc = tokenmill("complete", "-", *args, stdin="The sky is")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == expected.rstrip("\n")


def test_complete_errors_exit_non_zero_with_the_message(server: ServerProcess) -> None:
    proc = tokenmill("complete", "Hi", "--url", server.url, "--model", "nope")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith("tokenmill: error: ")
    assert "nope" in proc.stderr and "status 404" in proc.stderr and "req-" in proc.stderr
    proc = tokenmill("complete", "Hi", "--url", f"http://127.0.0.1:{free_port()}")
    assert proc.returncode == 1
    assert "cannot reach" in proc.stderr
    assert "Traceback" not in proc.stderr


def _default_sigint() -> None:
    # A terminal gives its foreground program Ctrl-C's default action. A test run that
    # was started in the background without job control (nohup cmd &, some CI runners)
    # ignores SIGINT, and an ignored disposition is inherited: the chat would never see
    # Ctrl-C (seen: a 240 s hang in two such runs).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spawn(*args: str) -> pexpect.spawn:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "tokenmill", "chat", *args],
        env=ENV,
        encoding="utf-8",
        timeout=240,
        dimensions=(40, 200),
        preexec_fn=_default_sigint,
    )
    child.expect_exact("Ctrl-D leaves.")
    child.expect_exact(PROMPT)
    return child


def _clean(text: str) -> str:
    return text.replace("\r\n", "\n").strip()


def test_chat_session_interrupt_and_leave(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> None:
    # A scripted deployment: the answer streams exactly what the test emits and never
    # ends by itself, so Ctrl-C lands mid-stream however slow the machine.
    srv = start_server(config=scripted_deployment(driver))
    child = _spawn("--url", srv.url, "--max-tokens", "256")
    try:
        # Turn 1: Ctrl-C while the answer streams stops it and stays in the chat.
        child.sendline(LONG_PROMPT)
        child.expect_exact(LONG_PROMPT + "\r\n")  # the terminal's echo of the line
        first = driver.wait("started")["id"]
        driver.emit(first, 3)
        child.expect_exact(" w1 w2 w3")
        child.sendintr()
        child.expect_exact("[interrupted]")
        aborted = driver.wait("aborted", first)  # generation stopped in the engine
        assert aborted["tokens"] == 3
        child.expect_exact(PROMPT)

        # Turn 2 follows on and is answered in full.
        child.sendline("Thanks!")
        child.expect_exact("Thanks!\r\n")
        second = driver.wait("started", count=2)
        assert "Thanks!" in second["prompt"]
        driver.emit(second["id"], 2)
        driver.finish(second["id"])
        child.expect_exact(PROMPT)
        assert " w1 w2" in child.before
        assert "[interrupted]" not in child.before and "error" not in child.before

        # Ctrl-C at the prompt just gives a fresh prompt; Ctrl-D leaves with status 0.
        child.sendintr()
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_chat_reports_errors_and_stays(server: ServerProcess) -> None:
    child = _spawn("--url", server.url, "--model", "nope", "--system", "Be brief.")
    try:
        child.sendline("Hi")
        child.expect(r"tokenmill: error: .*nope.*status 404")
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
