"""The web playground at /, in real headless Chromium against a real gateway."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import Page, Route

from tests.conftest import ServerProcess
from tests.waiting import wait_until

# Records the output text's length on every animation frame: what a person sees.
SAMPLER = """() => {
  window.__lengths = [];
  const tick = () => {
    const el = document.querySelector('#transcript .msg:nth-child(2) .text');
    if (el) window.__lengths.push(el.textContent.length);
    requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
}"""


def in_flight(http: httpx.Client) -> int:
    return int(http.get("/v1/deployments/smollm2").json()["in_flight"])


def send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def wait_done(page: Page) -> None:
    page.wait_for_selector("#send:not([disabled])")


def output_lengths(page: Page) -> list[int]:
    lengths: list[int] = page.evaluate("window.__lengths")
    return sorted({n for n in lengths if n > 0})


def test_stream_grows_in_steps_and_non_stream_appears_at_once(page: Page) -> None:
    page.select_option("#endpoint", "completion")
    page.fill("#max_tokens", "24")
    page.fill("#temperature", "0")
    page.evaluate(SAMPLER)
    send(page, "Once upon a time, in a small village by the sea,")
    wait_done(page)
    page.wait_for_timeout(200)
    steps = output_lengths(page)
    assert len(steps) >= 3, f"streamed text did not grow in steps: {steps}"
    stats = page.inner_text("#stats")
    assert "TTFT" in stats and "tokens/s" in stats
    assert page.inner_text("[data-stat=completion_tokens]") == "completion 24 tokens"
    assert page.inner_text("[data-stat=prompt_tokens]").startswith("prompt ")

    page.click("#new-chat")
    page.uncheck("#stream")
    page.evaluate(SAMPLER)
    send(page, "Once upon a time, in a small village by the sea,")
    wait_done(page)
    page.wait_for_timeout(200)
    steps = output_lengths(page)
    assert len(steps) == 1, f"non-streamed text should appear at once: {steps}"
    assert page.inner_text("[data-stat=completion_tokens]") == "completion 24 tokens"


def test_stop_aborts_and_frees_the_slot(page: Page, http: httpx.Client) -> None:
    # The answer must still be running when Stop is pressed, however slow the
    # machine: the page's request is sent on with ignore_eos, so it cannot end before
    # its 1500 tokens (the receipt below shows it ended at Stop, not by itself).
    def ignore_eos(route: Route) -> None:
        body = json.loads(route.request.post_data or "{}")
        route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))

    page.route("**/v1/completions", ignore_eos)
    page.select_option("#endpoint", "completion")
    page.fill("#max_tokens", "1500")
    page.fill("#temperature", "0")
    send(page, "Once upon a time, in a small village by the sea,")
    page.wait_for_function(
        "document.querySelector('#transcript .msg:nth-child(2) .text').textContent.length > 0"
    )
    assert in_flight(http) == 1
    page.click("#stop-btn")
    wait_done(page)
    wait_until(lambda: in_flight(http) == 0, "the stopped request's slot to come back")
    assert page.inner_text("[data-stat=stopped]") == "stopped"
    assert page.is_hidden("#error")
    # The slot is really free: the next request runs to completion.
    page.fill("#max_tokens", "3")
    send(page, "Hello")
    wait_done(page)
    assert page.inner_text("[data-stat=completion_tokens]") == "completion 3 tokens"


def test_errors_are_shown_as_sentences(page: Page) -> None:
    page.fill("#temperature", "3")
    send(page, "Hi")
    page.wait_for_selector("#error:not([hidden])")
    text = page.inner_text("#error")
    assert text.startswith("Invalid value for 'temperature'"), text
    assert text.endswith(".") and "{" not in text

    page.click("#reset")
    assert page.input_value("#temperature") == "0.7"
    # A deployment that no longer exists (the list was loaded before it went away).
    page.evaluate(
        """() => { const o = document.createElement('option'); o.value = o.textContent = 'gpt-9';
        document.getElementById('model').append(o); }"""
    )
    page.select_option("#model", "gpt-9")
    send(page, "Hi")
    page.wait_for_function("document.getElementById('error').textContent.includes('gpt-9')")
    assert page.inner_text("#error") == (
        "The model 'gpt-9' does not exist. Available models: smollm2."
    )


def test_multi_turn_chat_sends_the_history(page: Page) -> None:
    bodies: list[dict[str, Any]] = []
    page.on(
        "request",
        lambda r: (
            bodies.append(json.loads(r.post_data or "{}"))
            if r.url.endswith("/v1/chat/completions")
            else None
        ),
    )
    page.fill("#max_tokens", "4")
    page.fill("#seed", "7")
    page.fill("#stop", "zzz\nqqq")
    send(page, "My name is Ada.")
    wait_done(page)
    send(page, "What is my name?")
    wait_done(page)
    assert [m["role"] for m in bodies[1]["messages"]] == ["user", "assistant", "user"]
    assert bodies[1]["messages"][0]["content"] == "My name is Ada."
    assert bodies[1]["stream"] is True
    assert bodies[1]["stream_options"] == {"include_usage": True}
    assert bodies[1]["seed"] == 7 and bodies[1]["stop"] == ["zzz", "qqq"]
    assert page.locator("#transcript .msg.assistant").count() == 2


def test_screenshot_and_copy_as_curl(page: Page, tmp_path: Path) -> None:
    page.fill("#max_tokens", "12")
    page.fill("#api-key", "sk-test-not-checked")
    send(page, "Tell me about cats.")
    wait_done(page)
    page.uncheck("#stream")
    page.fill("#prompt", "And dogs?")
    page.click("#copy-curl")
    cmd = page.inner_text("#curl")
    assert "$TOKENMILL_API_KEY" in cmd and "sk-test" not in cmd
    shot = tmp_path / "playground.png"
    page.screenshot(path=str(shot), full_page=True)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # The copied command is a working request (auth is off on this server).
    out = subprocess.run(
        ["bash", "-c", cmd],
        capture_output=True,
        text=True,
        timeout=120,
        env={"TOKENMILL_API_KEY": "unused", "PATH": "/usr/bin:/bin"},
    )
    body = json.loads(out.stdout)
    assert body["object"] == "chat.completion", out.stdout
    assert body["usage"]["completion_tokens"] >= 1


def test_playground_does_not_shadow_the_api(server: ServerProcess, http: httpx.Client) -> None:
    page = http.get("/")
    assert page.status_code == 200 and "tokenmill playground" in page.text
    js = http.get("/playground/app.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert http.get("/v1/models").json()["object"] == "list"
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/docs").status_code == 200
    assert "tokenmill_generation_tokens_total" in http.get("/metrics").text
    missing = http.get("/playground/nope.js")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_url"
