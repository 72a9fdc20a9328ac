"""Replicas that wedge or restart, and upstream deployments that count with a tokenizer.

- A replica process that stops answering (SIGSTOP) is found by the health probe,
  killed and restarted; its streams end with an error event and ``[DONE]``.
- While the only replica restarts, its slots leave the admission pool: requests wait
  in the queue for it and succeed; one that waits out ``queue_timeout_s`` with no
  replica back gets 503 with ``Retry-After``. These run a scripted deployment whose
  restart the test holds (:meth:`tests.driver.EngineDriver.hold_starts`), so the
  replica is down exactly as long as the test needs.
- An upstream that reports no usage is billed with the deployment's tokenizer.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, free_port, launch
from tests.driver import EngineDriver, scripted_deployment
from tests.gateway.no_usage_upstream import TEXT
from tests.gateway.test_deployments import COUNTING, process_gone, signal_mid_stream
from tests.sse import events
from tests.waiting import HANG_S, wait_until

ROOT = Path(__file__).resolve().parents[2]

# The probe's limit must stay above any real decode step on a loaded machine (the
# replica is niced: beside two busy loops a step of it can take a second or more),
# else a slow step reads as a hang; only the SIGSTOP below may reach it.
PROBE_TIMEOUT_S = 5.0
PROBED = f"""
[[deployments]]
id = "probed"
max_num_seqs = 2
n_ctx = 512
n_threads = 1
health_check_interval_s = 0.25
health_check_timeout_s = {PROBE_TIMEOUT_S}
replica_nice = 7
"""
# Niceness adds up: the replica runs 7 above whatever the test run itself has.
REPLICA_NICE = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)


def thread_nice(pid: int) -> dict[int, int]:
    """The niceness of every thread of ``pid`` (field 19 of each task's stat)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        out[int(task.name)] = int(fields[16])
    return out


def replica(c: httpx.Client, dep: str) -> dict[str, Any]:
    r = c.get(f"/v1/deployments/{dep}")
    assert r.status_code == 200, r.text
    return dict(r.json()["replicas"][0])


def wait_state(c: httpx.Client, dep: str, ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    def matching() -> dict[str, Any] | None:
        rep = replica(c, dep)
        return rep if ok(rep) else None

    return wait_until(matching, f"{dep}'s replica to reach the expected state")


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = launch(tmp_path_factory.mktemp("probed"), config=PROBED)
    yield srv
    srv.stop()


def test_replica_threads_run_below_the_gateway(probed: ServerProcess) -> None:
    with httpx.Client(base_url=probed.url, timeout=60) as c:
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert c.post("/v1/deployments/probed/predict", json=body).status_code == 200
        pid = replica(c, "probed")["pid"]
    # Every thread, the decode thread and llama.cpp's included (they exist once a
    # request has run), inherits the replica's niceness; the gateway keeps its own.
    threads = thread_nice(pid)
    assert len(threads) >= 2 and set(threads.values()) == {REPLICA_NICE}
    assert os.getpriority(os.PRIO_PROCESS, probed.proc.pid) == os.getpriority(os.PRIO_PROCESS, 0)


def test_a_wedged_replica_is_killed_and_restarted(probed: ServerProcess) -> None:
    with httpx.Client(base_url=probed.url, timeout=HANG_S) as c:
        before = replica(c, "probed")
        pid = before["pid"]
        body = {"model": "probed", "prompt": COUNTING, "max_tokens": 400, "stream": True}
        body |= {"temperature": 0, "ignore_eos": True}
        # Alive but answering nothing: what a hung native call looks like.
        tail = signal_mid_stream(c, body, pid, signal.SIGSTOP)
        # The probe's verdict came before the stream's end: the gateway judged the
        # replica silent past the probe's timeout (by its own clock, however long the
        # machine took to get there), killed it, and the kill ended the stream.
        verdict = re.search(
            rf"replica process {pid} is wedged \(silent for ([0-9.]+)s", probed.log()
        )
        assert verdict is not None, probed.log()
        assert float(verdict[1]) >= PROBE_TIMEOUT_S
        assert tail[-1] == "[DONE]"
        errors = [e for e in tail if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_error", tail
        after = wait_state(c, "probed", lambda rep: rep["state"] == "ready")
        assert after["pid"] not in (None, pid)
        assert set(thread_nice(after["pid"]).values()) == {REPLICA_NICE}
        assert after["restarts"] == before["restarts"] + 1
        # Killed, not left stopped.
        wait_until(lambda: process_gone(pid), f"process {pid} to exit")
        r2 = c.post("/v1/completions", json={"model": "probed", "prompt": "Hi", "max_tokens": 4})
        assert r2.status_code == 200, r2.text
    # In the log, in this order: the verdict, the death by SIGKILL, the new process.
    log = probed.log()
    order = [
        log.index(f"replica process {pid} is wedged"),
        log.index(f"replica process {pid} died (exit -9)"),
        log.index(f"replica process {after['pid']} ready"),
    ]
    assert order == sorted(order), log


def kill_with_the_restart_held(driver: EngineDriver, c: httpx.Client) -> int:
    """SIGKILL the scripted deployment's only replica with the driver holding starts.

    Returns the dead process's pid once its successor said hello: the gateway has seen
    the death, and the replica stays restarting until ``driver.release_starts()``.
    """
    before = wait_state(c, "scripted", lambda rep: rep["state"] == "ready")
    assert before["pid"] == driver.wait("hello")["pid"]
    driver.hold_starts()
    os.kill(before["pid"], signal.SIGKILL)
    driver.wait("hello", count=2)
    assert replica(c, "scripted")["state"] == "restarting"
    return int(before["pid"])


def completion(rid: str) -> dict[str, Any]:
    """A request for 2 tokens, and the headers naming it ``rid`` for the driver."""
    return {
        "url": "/v1/completions",
        "json": {"model": "scripted", "prompt": "Say hi", "max_tokens": 2},
        "headers": {"x-request-id": rid},
    }


def test_requests_wait_for_a_restarting_replica(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    # The queue timeout only stops a hang: the request is seen waiting in the queue
    # while the restart is held, and served once the test lets the replica come back.
    config = scripted_deployment(driver, max_num_seqs=1, queue_timeout_s=HANG_S)
    srv = start_server(config=config)
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c, ThreadPoolExecutor(1) as pool:
        dead = kill_with_the_restart_held(driver, c)
        # No replica now: the request waits for the restart instead of failing.
        waiting = pool.submit(c.post, **completion("patient"))
        wait_until(
            lambda: c.get("/v1/deployments/scripted").json()["queued"] == 1,
            "the request to wait in the queue",
        )
        assert driver.seen("started", "patient") == 0
        driver.release_starts()
        driver.emit("patient", 2)  # once the new process started it
        r = waiting.result(timeout=HANG_S)
        after = replica(c, "scripted")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " w1 w2"
    assert after["state"] == "ready" and after["restarts"] == 1
    assert after["pid"] == driver.wait("hello", count=2)["pid"] != dead


def test_no_replica_back_within_the_queue_timeout_is_503(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    # The restart is held until the answer came: the 0.2 s in the queue run out with
    # no replica back, however slow the machine.
    config = scripted_deployment(driver, max_num_seqs=1, queue_timeout_s=0.2)
    srv = start_server(config=config)
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        dead = kill_with_the_restart_held(driver, c)
        r = c.post(**completion("early"))
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "server_error"
        assert "no replica was ready to serve within 0.2s" in err["message"]
        assert replica(c, "scripted")["state"] == "restarting"  # still held
        # Let the restart finish: service comes back.
        driver.release_starts()
        back = wait_state(c, "scripted", lambda rep: rep["state"] == "ready")
        assert back["pid"] == driver.wait("hello", count=2)["pid"] != dead
        assert back["restarts"] == 1
        with ThreadPoolExecutor(1) as pool:
            later = pool.submit(c.post, **completion("later"))
            driver.emit("later", 2)
            r = later.result(timeout=HANG_S)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert driver.seen("started", "early") == 0  # the refused request never ran


# -- upstream token counting -------------------------------------------------------------


@pytest.fixture(scope="module")
def no_usage_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("upstream") / "upstream.log"
    cmd = [sys.executable, "-m", "uvicorn", "tests.gateway.no_usage_upstream:app"]
    cmd += ["--port", str(port), "--log-level", "warning"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"

    def listening() -> bool:
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(httpx.TransportError):
            httpx.get(url, timeout=HANG_S)
            return True
        return False

    try:
        wait_until(listening, "the fake upstream to listen")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def counting_gw(
    tmp_path_factory: pytest.TempPathFactory, no_usage_upstream: str
) -> Iterator[ServerProcess]:
    config = f"""
[[deployments]]
id = "local"
max_num_seqs = 1
n_ctx = 512
n_threads = 1

[[deployments]]
id = "counted"
engine = "upstream"
url = "{no_usage_upstream}"
tokenizer = "embedded"

[[deployments]]
id = "estimated"
engine = "upstream"
url = "{no_usage_upstream}"
"""
    srv = launch(tmp_path_factory.mktemp("counting"), config=config)
    yield srv
    srv.stop()


def test_upstream_without_usage_is_counted_with_the_tokenizer(counting_gw: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Tell me about foxes, briefly."}]
    with httpx.Client(base_url=counting_gw.url, timeout=60.0) as c:
        # The oracle: the same model's own engine counting the same prompt and text.
        local = c.post(
            "/v1/chat/completions", json={"model": "local", "messages": messages, "max_tokens": 1}
        ).json()["usage"]
        text_tokens = c.post(
            "/v1/completions", json={"model": "local", "prompt": TEXT, "max_tokens": 1}
        ).json()["usage"]["prompt_tokens"]

        body = {"model": "counted", "messages": messages, "max_tokens": 200}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == TEXT
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == local["prompt_tokens"]
        # Chunks hold several tokens each: counting chunks would bill 14, not 31.
        assert usage["completion_tokens"] == text_tokens > len(TEXT) // 10 + 1

        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with c.stream("POST", "/v1/chat/completions", json=body) as s:
            last = [e for e in events(s) if isinstance(e, dict)][-1]
        assert last["usage"]["completion_tokens"] == text_tokens
        assert last["usage"]["prompt_tokens"] == local["prompt_tokens"]

        # Without a tokenizer the gateway can only estimate (~4 characters a token).
        est = c.post("/v1/chat/completions", json={**body, "model": "estimated", "stream": False})
        assert est.status_code == 200, est.text
        assert est.json()["usage"]["prompt_tokens"] != local["prompt_tokens"]
