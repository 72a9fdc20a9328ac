"""Slow and hostile clients are cut off, and do not stop anyone else being served.

Raw sockets play the clients: one sends its headers a byte at a time, one never
finishes its body, one sends a huge head, one opens a stream and never reads it.
Each test orders events: the server closes the connection while the client is still
trickling (its request can never complete), or the engine reports the unread stream
aborted while the test only waited. ``client_timeout_s`` is short here so the tests
do not wait long; no assertion depends on how long anything took.
"""

from __future__ import annotations

import contextlib
import select
import socket
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.sse import DONE, events
from tests.waiting import HANG_S, wait_until
from tokenmill.server.listener import MAX_HEAD_BYTES

CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
HOSTILE = 500


def connect(srv: ServerProcess, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connect: the window the server may fill
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", srv.port))
    return sock


def closed_by_server(sock: socket.socket, timeout: float = 0.0) -> bytes | None:
    """Everything the server sent, if it has closed the connection; else None."""
    got = b""
    while select.select([sock], [], [], timeout)[0]:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    return None


def trickle_until_closed(sock: socket.socket, data: bytes) -> tuple[int, bytes]:
    """Send ``data`` a byte at a time until the server closes: (bytes sent, reply)."""
    for sent, byte in enumerate(data):
        try:
            sock.send(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            reply = closed_by_server(sock)
            return sent, reply or b""
        reply = closed_by_server(sock, timeout=0.05)
        if reply is not None:
            return sent + 1, reply
    raise AssertionError("the server never cut the connection off")


@pytest.fixture
def guarded(start_server: Callable[..., ServerProcess], driver: EngineDriver) -> ServerProcess:
    config = scripted_deployment(driver, max_num_seqs=4, n_ctx=100_000)
    return start_server(config=config, env={"TOKENMILL_CLIENT_TIMEOUT_S": "1"})


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_head_sent_a_byte_at_a_time_is_cut_off_with_408(guarded: ServerProcess) -> None:
    # A head that could never end: a header value growing forever, below the size cap.
    endless = CHAT + b"x-slow: " + b"a" * (MAX_HEAD_BYTES // 2)
    with connect(guarded) as sock:
        sent, reply = trickle_until_closed(sock, endless)
    assert sent < len(endless)  # cut off mid-head
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    # And a connection that sends nothing at all is closed as well.
    with connect(guarded) as sock:
        reply2 = wait_until(lambda: closed_by_server(sock, 0.05), "the idle connection closed")
    assert reply2.startswith(b"HTTP/1.1 408 "), reply2


def test_a_body_that_never_ends_is_cut_off(guarded: ServerProcess) -> None:
    with connect(guarded) as sock:
        sock.sendall(CHAT + b"content-length: 1000\r\n\r\n" + b'{"messages": [')
        reply = wait_until(lambda: closed_by_server(sock, 0.05), "the server to close")
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    # The route waiting for the body saw the client leave: no server error logged.
    guarded.stop()
    assert "no whole request within" in guarded.log()
    assert "Traceback" not in guarded.log(), guarded.log()


def test_a_head_over_the_limit_gets_431(guarded: ServerProcess) -> None:
    with connect(guarded) as sock:
        head = CHAT + b"x-big: " + b"a" * (MAX_HEAD_BYTES + 1) + b"\r\n\r\n"
        # Closed before it all went? The reply is still there to read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head)
        reply = wait_until(lambda: closed_by_server(sock, 0.05), "the server to close")
    assert reply.startswith(b"HTTP/1.1 431 "), reply


def test_a_stream_nobody_reads_is_aborted_and_billed(
    guarded: ServerProcess, driver: EngineDriver
) -> None:
    body = b'{"messages": [{"role": "user", "content": "go"}], "stream": true, "max_tokens": 90000}'
    with connect(guarded, rcvbuf=4096) as sock:
        sock.sendall(CHAT + b"content-length: %d\r\n\r\n" % len(body) + body)
        started = driver.wait("started")
        rid = started["id"]
        # Far more than the socket buffers hold: the server's writes block, unread.
        # (The replica process produces them all anyway; they wait in the gateway.)
        driver.emit(rid, 80_000)
        # Only the gateway can end this request: the client neither reads nor leaves,
        # and it is 10,000 tokens short of max_tokens.
        aborted = driver.wait("aborted", rid)
        assert 0 < aborted["tokens"] <= 80_000, aborted
        # The client, reading at last, finds a stream cut short: no [DONE].
        got = b""
        while True:
            try:
                chunk = sock.recv(1 << 20)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
        assert b"data: [DONE]" not in got
    with httpx.Client(base_url=guarded.url, timeout=HANG_S) as client:
        resp = wait_until(lambda: _settled(client, rid), f"the receipt of {rid}")
    assert resp["completion_tokens"] == aborted["tokens"], resp


def _settled(client: httpx.Client, rid: str) -> dict[str, object] | None:
    resp = client.get(f"/v1/usage/{rid}")
    return resp.json() if resp.status_code == 200 else None


@pytest.fixture
def patient(start_server: Callable[..., ServerProcess], driver: EngineDriver) -> ServerProcess:
    # Timeouts far away: the hostile connections stay open while the test runs.
    config = scripted_deployment(driver, max_num_seqs=4)
    return start_server(config=config, env={"TOKENMILL_CLIENT_TIMEOUT_S": str(HANG_S * 10)})


def open_hostile(srv: ServerProcess, socks: list[socket.socket]) -> None:
    for i in range(HOSTILE):
        sock = connect(srv)
        socks.append(sock)
        if i % 2:  # an unfinished head
            sock.sendall(CHAT + b"x-slow: a")
        else:  # a head, and a body that never ends
            sock.sendall(CHAT + b"content-length: 100000\r\n\r\n" + b"{" * 1000)


def test_500_hostile_connections_do_not_stop_normal_requests(
    patient: ServerProcess, driver: EngineDriver
) -> None:
    pid = patient.proc.pid
    before = rss_kib(pid)
    hostile: list[socket.socket] = []
    try:
        open_hostile(patient, hostile)
        with httpx.Client(base_url=patient.url, timeout=HANG_S) as client:
            assert client.get("/health").status_code == 200
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                rid = resp.headers["x-request-id"]
                driver.emit(rid, 3)
                driver.finish(rid)
                assert list(events(resp))[-1] == DONE
        # Served while every hostile connection was still open (none was answered).
        assert all(closed_by_server(s) is None for s in hostile)
        after = rss_kib(pid)
    finally:
        for sock in hostile:
            sock.close()
    print(f"gateway RSS: {before} KiB, with {HOSTILE} hostile connections {after} KiB")
    # What each may cost: its head (at most MAX_HEAD_BYTES) and one read buffer.
    assert after - before < HOSTILE * 2 * MAX_HEAD_BYTES // 1024, (before, after)
