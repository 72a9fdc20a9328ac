"""Gateway cells on Ray Serve: ``tokenmill serve --ray-serve --cells 2``.

Two cells (each a whole gateway whose scripted deployment has one replica process)
run behind Serve's HTTP proxy on the session's Ray cluster and share one PostgreSQL
ledger. A direct gateway on the same ledger and driver is the reference: a stream
through Serve carries the same bytes as the same request served direct. Every step
is ordered by the driver's events. Twenty keys stream through both cells at once,
each trying more than its credit covers; a cell killed mid-stream is replaced, and its
hold is settled by the ledger's sweeper once its heartbeat is stale (on the tokens the
cell recorded as delivered), which takes that test about 30 s. Serve is heavy (seconds
to start, about a GB), so one application serves the whole module.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RayCluster, ServerProcess, launch
from tests.driver import EngineDriver, scripted_deployment
from tests.ledger.helpers import (
    ADMIN_KEY,
    account,
    admin,
    new_account,
    new_key,
    receipt,
    recorded_progress,
)
from tests.postgres import pg_schema
from tests.sse import DONE, events, text
from tests.waiting import HANG_S, wait_until
from tokenmill.config import ConfigError, Price, load_settings

PROMPT = "Tell a long story."  # 4 words: 4 prompt tokens for the scripted engine
PRICE = Price(prompt_per_mtok=1_000_000, completion_per_mtok=3_000_000)
ENV = {"TOKENMILL_ADMIN_KEY": ADMIN_KEY}


def body(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {
        "model": "scripted",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }


@pytest.fixture(scope="module")
def pg_schema_url(postgres: str) -> Iterator[str]:
    """A PostgreSQL schema of this module's own."""
    with pg_schema(postgres) as url:
        yield url


@pytest.fixture(scope="module")
def servers() -> Iterator[ExitStack]:
    """Stops the module's servers last: after the driver is gone (see ``driver``)."""
    with ExitStack() as stack:
        yield stack


@pytest.fixture(scope="module")
def drv(servers: ExitStack) -> Iterator[EngineDriver]:
    drv = EngineDriver()
    yield drv
    drv.close()


@pytest.fixture(scope="module")
def gateways(
    tmp_path_factory: pytest.TempPathFactory,
    ray_cluster: RayCluster,
    pg_schema_url: str,
    servers: ExitStack,
    drv: EngineDriver,
) -> tuple[ServerProcess, ServerProcess]:
    """Two cells behind Serve's proxy, and a direct gateway: one ledger, one driver."""
    config = (
        f"ray_address = {ray_cluster.address!r}\ndrain_s = 1\n"
        + scripted_deployment(drv, max_num_seqs=8)
        + f"[deployments.price]\nprompt_per_mtok = {PRICE.prompt_per_mtok}\n"
        f"completion_per_mtok = {PRICE.completion_per_mtok}\n"
        # Serve sends a cell at most this many requests at once: held requests beyond
        # it must go to the other cell, whatever Serve's router prefers under load.
        f"[serve]\nmax_ongoing_requests = {CELL_LIMIT}\n"
    )
    args = ["--ledger", pg_schema_url]
    tmp = tmp_path_factory.mktemp("cells")
    cells = launch(
        tmp / "serve", config=config, env=ENV, args=[*args, "--ray-serve", "--cells", "2"]
    )
    servers.callback(cells.stop)
    direct = launch(tmp / "direct", config=config, env=ENV, args=args)
    servers.callback(direct.stop)
    return cells, direct


@pytest.fixture(scope="module")
def key(gateways: tuple[ServerProcess, ServerProcess]) -> dict[str, str]:
    """An account's key, made through Serve's proxy: its bearer header."""
    with admin(gateways[0].url) as adm:
        acc = new_account(adm, "streams", 10**9)
        _, secret = new_key(adm, acc)
    return {"authorization": f"Bearer {secret}"}


CELL_LIMIT = 4


def raw_stream(
    srv: ServerProcess, drv: EngineDriver, rid: str, headers: dict[str, str]
) -> tuple[httpx.Headers, bytes]:
    with (
        httpx.Client(base_url=srv.url, timeout=HANG_S) as c,
        c.stream(
            "POST", "/v1/completions", json=body(3), headers={**headers, "x-request-id": rid}
        ) as r,
    ):
        assert r.status_code == 200
        drv.emit(rid, 3)
        return r.headers, r.read()


def test_a_stream_through_serve_is_the_direct_stream_byte_for_byte(
    gateways: tuple[ServerProcess, ServerProcess], drv: EngineDriver, key: dict[str, str]
) -> None:
    cells, direct = gateways
    # The same request once direct, then through Serve's proxy. Each needs its own id
    # (the shared ledger refuses an id used before): ids of one length, swapped below.
    direct_headers, direct_bytes = raw_stream(direct, drv, "bytes-d", key)
    serve_headers, serve_bytes = raw_stream(cells, drv, "bytes-s", key)
    # `created` is the wall-clock second the request began: with the id, the only
    # fields that may differ between two requests, wherever they are served.
    created = re.compile(rb'"created":\d+')
    assert created.sub(b'"created":0', serve_bytes.replace(b"bytes-s", b"bytes-d")) == created.sub(
        b'"created":0', direct_bytes
    )
    assert serve_bytes.count(b"bytes-s") == direct_bytes.count(b"bytes-d") > 0
    assert serve_bytes.endswith(b"data: [DONE]\n\n")
    for name in ("content-type", "cache-control", "x-accel-buffering"):
        assert serve_headers[name] == direct_headers[name], name

    # The same headers in the same order, each once (Serve's proxy adds x-request-id
    # itself: the cell drops its own copy); only date (the second) and the id differ.
    def same(headers: httpx.Headers, rid: bytes) -> list[tuple[bytes, bytes]]:
        return [(k, b"" if k == b"date" else v.replace(rid, b"id")) for k, v in headers.raw]

    assert same(serve_headers, b"bytes-s") == same(direct_headers, b"bytes-d")
    assert serve_headers.get_list("x-request-id") == ["bytes-s"]


def test_requests_held_at_once_land_on_both_cells_and_credit_stays_exact(
    gateways: tuple[ServerProcess, ServerProcess], drv: EngineDriver
) -> None:
    cells, _ = gateways
    with admin(cells.url) as adm:
        acc = new_account(adm, "split", 1_000_000)
        _, secret = new_key(adm, acc)
    headers = {"authorization": f"Bearer {secret}"}
    pids: dict[str, int] = {}
    with ExitStack() as stack:
        c = stack.enter_context(httpx.Client(base_url=cells.url, timeout=HANG_S))
        streams = {}
        # Each request stays open (its engine holds it): once a cell holds CELL_LIMIT,
        # Serve must route the next one to the other cell.
        while len(set(pids.values())) < 2:
            assert len(pids) <= CELL_LIMIT, f"a cell took more than its limit: {pids}"
            rid = f"split-{len(pids)}"
            r = stack.enter_context(
                c.stream(
                    "POST",
                    "/v1/completions",
                    json=body(5),
                    headers={**headers, "x-request-id": rid},
                )
            )
            streams[rid] = events(r)
            pids[rid] = drv.pid(rid)
        for i, rid in enumerate(pids):
            drv.emit(rid, 1 + i % 3)
            drv.finish(rid)
        tails = {rid: list(s) for rid, s in streams.items()}
    assert all(t[-1] == DONE for t in tails.values())
    # 4 prompt tokens x 1 + completion tokens x 3 each (PRICE): no rounding.
    charged = sum(4 + 3 * (1 + i % 3) for i in range(len(pids)))
    with admin(cells.url) as adm:
        for rid in pids:
            assert receipt(adm, rid)["charged"] == 4 + 3 * sum(1 for e in tails[rid] if text(e))
        state = account(adm, acc)
    assert state["held"] == 0
    assert state["balance"] == 1_000_000 - charged


def test_a_client_leaving_through_serve_stops_generation(
    gateways: tuple[ServerProcess, ServerProcess], drv: EngineDriver, key: dict[str, str]
) -> None:
    cells, _ = gateways
    with httpx.Client(base_url=cells.url, timeout=HANG_S) as c:
        with c.stream(
            "POST", "/v1/completions", json=body(50), headers={**key, "x-request-id": "gone"}
        ) as r:
            stream = events(r)
            drv.emit("gone", 2)
            assert [text(next(stream)) for _ in range(2)] == [" w1", " w2"]
        # The connection to the proxy closed: the proxy cancels the cell's request,
        # which aborts generation and settles what was produced.
        assert drv.wait("aborted", "gone")["tokens"] == 2
        with admin(cells.url) as adm:
            assert receipt(adm, "gone")["completion_tokens"] == 2


def test_errors_through_serve_are_the_gateways_own(
    gateways: tuple[ServerProcess, ServerProcess], drv: EngineDriver, key: dict[str, str]
) -> None:
    cells, _ = gateways
    with httpx.Client(base_url=cells.url, timeout=HANG_S) as c:
        r = c.post("/v1/completions", json=body(3))
        assert r.status_code == 401 and r.json()["error"]["type"]
        with c.stream(
            "POST", "/v1/completions", json=body(50), headers={**key, "x-request-id": "fails"}
        ) as r:
            stream = events(r)
            drv.emit("fails", 1)
            assert text(next(stream)) == " w1"
            drv.fail("fails", "scripted failure")
            tail = list(stream)
    assert tail[-1] == DONE
    errors = [e for e in tail if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_error", tail


def test_twenty_keys_streaming_at_once_over_both_cells_never_overdraw(
    gateways: tuple[ServerProcess, ServerProcess], drv: EngineDriver
) -> None:
    cells, _ = gateways
    # Each key can pay for two holds at once (19 each: 4 prompt + 5 completion tokens
    # at 1 and 3) and tries four streams, two at a time, of 3 to 5 tokens (13 to 19):
    # four cost at least 52, more than its 50, so every key is refused at least once.
    credit, tries, max_tokens = 50, 4, 5
    with admin(cells.url) as adm:
        accounts = [new_account(adm, f"many-{i}", credit) for i in range(20)]
        secrets = [new_key(adm, acc)[1] for acc in accounts]

    def attempt(key: int, n: int) -> tuple[int, str, int, bool]:
        """One stream: (key, request id, tokens the client got, whether it ran)."""
        rid = f"many-{key}-{n}"
        headers = {"authorization": f"Bearer {secrets[key]}", "x-request-id": rid}
        with (
            httpx.Client(base_url=cells.url, timeout=HANG_S) as c,
            c.stream("POST", "/v1/completions", json=body(max_tokens), headers=headers) as r,
        ):
            if r.status_code != 200:
                r.read()
                assert r.status_code == 402, r.text
                assert r.json()["error"]["code"] == "insufficient_credit"
                return key, rid, 0, False
            stream = events(r)
            drv.emit(rid, 3 + (key + n) % 3)
            drv.finish(rid)
            got = list(stream)
        assert got[-1] == DONE
        return key, rid, sum(1 for e in got if text(e)), True

    # Two at a time per key, 16 streams at once in all: both cells' 8 slots.
    jobs = [(key, n) for n in range(tries) for key in range(20)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda job: attempt(*job), jobs))
    ran = [(key, rid, tokens) for key, rid, tokens, ok in results if ok]
    refused = {key for key, _, _, ok in results if not ok}
    assert refused == set(range(20)), "every key tried more than its credit allows"
    with admin(cells.url) as adm:
        receipts = {rid: receipt(adm, rid) for _, rid, _ in ran}
        states = [account(adm, acc) for acc in accounts]
    # Which cell served each is Serve's router's choice (under heavy load it can send
    # them all to one cell): the ledger is exact either way.
    for _, rid, tokens in ran:
        assert receipts[rid]["completion_tokens"] == tokens
        assert receipts[rid]["charged"] == 4 + 3 * tokens  # 4 prompt x 1 + tokens x 3
    for key, state in enumerate(states):
        charged = sum(receipts[rid]["charged"] for k, rid, _ in ran if k == key)
        assert state["held"] == 0 and state["balance"] >= 0, state
        assert state["balance"] == credit - charged, state
    total = sum(receipts[rid]["charged"] for _, rid, _ in ran)
    assert total == sum(4 + 3 * tokens for _, _, tokens in ran)
    assert total == sum(credit - state["balance"] for state in states)


def parent_pid(pid: int) -> int:
    """A process's parent, from /proc (Linux)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def serving_cells(cells: ServerProcess, drv: EngineDriver, headers: dict[str, str]) -> set[int]:
    """The replica pids of the cells that take requests now: requests are held open
    (Serve routes each to the cell with fewer in flight) until two cells took one, or
    four went to one cell; then all are finished."""
    pids: dict[str, int] = {}
    with ExitStack() as stack:
        c = stack.enter_context(httpx.Client(base_url=cells.url, timeout=HANG_S))
        streams = []
        while len(set(pids.values())) < 2 and len(pids) < 4:
            rid = f"probe-{uuid.uuid4().hex[:8]}"
            r = stack.enter_context(
                c.stream(
                    "POST",
                    "/v1/completions",
                    json=body(1),
                    headers={**headers, "x-request-id": rid},
                )
            )
            assert r.status_code == 200
            streams.append(events(r))
            pids[rid] = drv.pid(rid)
        for rid in pids:
            drv.emit(rid, 1)
        assert all(list(s)[-1] == DONE for s in streams)
    return set(pids.values())


def test_a_cell_killed_mid_stream_is_replaced_and_its_hold_swept(
    gateways: tuple[ServerProcess, ServerProcess],
    drv: EngineDriver,
    key: dict[str, str],
    pg_schema_url: str,
) -> None:
    cells, _ = gateways
    with admin(cells.url) as adm:
        acc = new_account(adm, "killed", 1_000)
        _, secret = new_key(adm, acc)
    headers = {"authorization": f"Bearer {secret}", "x-request-id": "killed"}
    hellos = drv.seen("hello")
    with httpx.Client(base_url=cells.url, timeout=HANG_S) as c:
        with c.stream("POST", "/v1/completions", json=body(50), headers=headers) as r:
            stream = events(r)
            drv.emit("killed", 2)
            assert [text(next(stream)) for _ in range(2)] == [" w1", " w2"]
            wait_until(
                lambda: recorded_progress(pg_schema_url, "killed") == 2,
                "the cell to record its 2 delivered tokens",
            )
            # The cell is the Ray actor whose child process runs the replica.
            replica_pid = drv.pid("killed")
            cell_pid = parent_pid(replica_pid)
            assert b"ServeReplica" in Path(f"/proc/{cell_pid}/cmdline").read_bytes()
            os.kill(cell_pid, signal.SIGKILL)
            # The proxy loses the cell: it cuts the response short (no last chunk),
            # with nothing more after the tokens the client had.
            tail: list[Any] = []
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                tail.extend(stream)
            assert tail == []
    # Serve starts a new cell (its replica says hello), and two cells serve again.
    drv.wait("hello", count=hellos + 1)
    pids = wait_until(
        lambda: p if len(p := serving_cells(cells, drv, key)) == 2 else None,
        "two cells to serve again",
    )
    assert replica_pid not in pids
    # Nobody settles the killed cell's hold until its heartbeat is STALE_S old; then
    # the sweeper of a live gateway on the ledger charges the recorded 2 tokens.
    with admin(cells.url) as adm:
        swept = receipt(adm, "killed")
        state = account(adm, acc)
    assert swept["finish_reason"] == "expired" and swept["completion_tokens"] == 2, swept
    assert swept["charged"] == 10  # 4 prompt tokens x 1 + 2 completion tokens x 3
    assert state["held"] == 0 and state["balance"] == 990


def test_several_cells_on_sqlite_are_refused(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--ray-serve", "--cells", "2"]
    run = subprocess.run(
        [*cmd, "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 2
    assert "PostgreSQL" in run.stderr and "2 gateway cells" in run.stderr, run.stderr
    assert "ray" not in run.stdout.lower()


def test_the_serve_table_sets_the_cells_and_the_flag_wins(tmp_path: Path) -> None:
    cfg = tmp_path / "tokenmill.toml"
    cfg.write_text('ledger = "postgresql://db/x"\n[serve]\ncells = 3\nport = 9000\n')
    settings = load_settings(cfg, environ={})
    assert settings.for_cells().serve.cells == 3 and settings.serve.port == 9000
    assert settings.for_cells(2).serve.cells == 2
    # One cell keeps its own books: SQLite will do.
    assert load_settings(environ={}).for_cells(1).serve.cells == 1
    with pytest.raises(ConfigError, match="PostgreSQL"):
        load_settings(environ={}).for_cells(2)
    cfg.write_text("[serve]\nreplicas = 2\n")
    with pytest.raises(ConfigError, match=r"serve\.replicas: unknown key"):
        load_settings(cfg, environ={})
