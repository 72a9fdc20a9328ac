"""Autoscaling over HTTP (tokenmill.gateway.scaling): scripted replica processes whose
every token the test drives, so what is asserted is the order of events (replicas
started, a stream finished on a replica being removed, a replica stopped), never how
long anything took. Delays are 0: the policy's hysteresis is
tests/gateway/test_autoscale_policy.py's subject; here, what a decision does.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from tests.conftest import RayCluster, ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.ledger.helpers import (
    ADMIN_KEY,
    PRICE,
    account,
    admin,
    charge_for,
    new_account,
    new_key,
    receipt,
    user,
)
from tests.sse import DONE, PING, events, lines, text
from tests.waiting import HANG_S, wait_until

BALANCE = 10**9
PROMPT = "Tell a long story."  # 4 words: 4 prompt tokens for the scripted engine


def serve(
    start_server: Callable[..., ServerProcess],
    driver: EngineDriver,
    prefix: str = "",
    keys: dict[str, object] | None = None,
    **autoscale: float,
) -> tuple[ServerProcess, str, str]:
    """A priced, autoscaled scripted deployment (``keys``: more of its keys, ``prefix``:
    top-level lines); a funded account and its key."""
    table: dict[str, object] = {"max_num_seqs": 2, "queue_timeout_s": HANG_S, **(keys or {})}
    config = prefix + scripted_deployment(driver, "scripted", **table)
    config += f"[deployments.price]\nprompt_per_mtok = {PRICE.prompt_per_mtok}\n"
    config += f"completion_per_mtok = {PRICE.completion_per_mtok}\n"
    scaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 2,
        "upscale_delay_s": 0,
        "downscale_delay_s": 0,
        "look_back_s": 0.01,
        **autoscale,
    }
    config += "[deployments.autoscale]\n" + "".join(f"{k} = {v}\n" for k, v in scaling.items())
    srv = start_server(config=config, env={"TOKENMILL_ADMIN_KEY": ADMIN_KEY})
    with admin(srv.url) as a:
        acct = new_account(a, "scaled", BALANCE)
        _, key = new_key(a, acct)
    return srv, acct, key


def describe(c: httpx.Client) -> dict[str, Any]:
    r = c.get("/v1/deployments/scripted")
    assert r.status_code == 200, r.text
    return dict(r.json())


def phases(c: httpx.Client) -> list[tuple[str, str]]:
    return [(r["phase"], r["state"]) for r in describe(c)["replicas"]]


def until_phases(c: httpx.Client, want: list[tuple[str, str]]) -> None:
    wait_until(lambda: phases(c) == want or None, f"the replicas to be {want} ({phases(c)})")


def open_stream(stack: ExitStack, c: httpx.Client, rid: str) -> Any:
    body = {"model": "scripted", "prompt": PROMPT, "max_tokens": 50, "stream": True}
    headers = {"x-request-id": rid}
    r = stack.enter_context(c.stream("POST", "/v1/completions", json=body, headers=headers))
    assert r.status_code == 200, r.read()
    return r


@pytest.mark.parametrize("placement", ["process", "ray"])
def test_queued_load_adds_a_replica_and_a_stream_on_the_one_removed_finishes_billed(
    start_server: Callable[..., ServerProcess],
    driver: EngineDriver,
    placement: str,
    request: pytest.FixtureRequest,
) -> None:
    prefix, keys = "", {}
    if placement == "ray":  # a new replica is a new actor on the test's cluster
        cluster: RayCluster = request.getfixturevalue("ray_cluster")
        prefix = f"ray_address = {cluster.address!r}\n"
        keys = {"placement": "ray", "ray_num_cpus": 0.5}
    srv, acct, key = serve(start_server, driver, prefix, keys, drain_s=HANG_S)
    with ExitStack() as stack, user(srv.url, key) as c:
        assert phases(c) == [("active", "ready"), ("off", "unloaded")]
        streams = {}
        for rid in ("r1", "r2"):
            streams[rid] = events(open_stream(stack, c, rid))
            driver.started(rid)
        # Both slots of the one replica are taken: a third request waits, 3 ongoing for
        # a target of 2 a replica, and a second replica starts for it.
        streams["r3"] = events(open_stream(stack, c, "r3"))
        driver.started("r3")
        assert driver.pid("r3") != driver.pid("r1") == driver.pid("r2")
        assert phases(c) == [("active", "ready"), ("active", "ready")]
        scaled = describe(c)["autoscale"]
        assert scaled["desired_replicas"] == 2
        assert [(e["direction"], e["replicas_to"]) for e in scaled["events"]] == [("up", 2)]
        metrics = c.get("/metrics").text
        assert 'tokenmill_replicas_desired{deployment="scripted"} 2.0' in metrics, metrics

        # r1 ends: 2 ongoing, one replica's worth. Both replicas run a stream; the
        # newer one goes, and r3 keeps running on it while it drains.
        driver.emit("r1", 3)
        driver.finish("r1")
        assert list(streams["r1"])[-1] == DONE
        until_phases(c, [("active", "ready"), ("draining", "ready")])
        assert describe(c)["autoscale"]["desired_replicas"] == 1

        driver.emit("r3", 5)
        driver.finish("r3")
        r3 = list(streams["r3"])
        assert r3[-1] == DONE and "".join(text(e) for e in r3 if isinstance(e, dict)) == (
            " w1 w2 w3 w4 w5"
        ), r3
        # Its last stream done, the drained replica stops.
        until_phases(c, [("active", "ready"), ("off", "unloaded")])
        driver.finish("r2")
        assert list(streams["r2"])[-1] == DONE

        got = {rid: receipt(c, rid) for rid in ("r1", "r2", "r3")}
        assert got["r3"]["completion_tokens"] == 5 and got["r3"]["finish_reason"] == "stop"
        for r in got.values():
            assert r["charged"] == charge_for(r["prompt_tokens"], r["completion_tokens"]), r
        with admin(srv.url) as a:
            books = account(a, acct)
        assert books["held"] == 0, books
        assert books["balance"] == BALANCE - sum(r["charged"] for r in got.values()), books


def test_a_stream_past_the_drain_limit_ends_in_band_billed_for_what_it_produced(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> None:
    # Nobody finishes r3: only the drain limit ends it (its length only has to be
    # short enough for the test to wait).
    srv, acct, key = serve(start_server, driver, drain_s=0.5)
    with ExitStack() as stack, user(srv.url, key) as c:
        streams = {}
        for rid in ("r1", "r2", "r3"):
            streams[rid] = events(open_stream(stack, c, rid))
            driver.started(rid)
        driver.emit("r3", 2)
        produced = [text(next(streams["r3"])) for _ in range(2)]  # out before the drain
        assert produced == [" w1", " w2"], produced
        driver.finish("r1")
        rest = list(streams["r3"])
        assert rest[-1] == DONE, rest
        errors = [e for e in rest if isinstance(e, dict) and "error" in e]
        assert errors, rest
        assert "".join(text(e) for e in rest if isinstance(e, dict)) == ""
        until_phases(c, [("active", "ready"), ("off", "unloaded")])
        got = receipt(c, "r3")
        assert got["completion_tokens"] == 2, got
        assert got["charged"] == charge_for(got["prompt_tokens"], 2), got
        driver.finish("r2")
        assert list(streams["r2"])[-1] == DONE
        receipt(c, "r2")
        with admin(srv.url) as a:
            assert account(a, acct)["held"] == 0


def test_at_zero_replicas_the_next_request_loads_one_with_pings_while_it_waits(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> None:
    srv, _, key = serve(
        start_server, driver, "stream_keepalive_s = 0.05\n", min_replicas=0, max_replicas=1
    )
    with ExitStack() as stack, user(srv.url, key) as c:
        # Started with one replica; idle, it goes.
        until_phases(c, [("active", "unloaded")])
        assert describe(c)["autoscale"]["events"][-1]["replicas_to"] == 0
        driver.hold_starts()
        waiter = lines(open_stream(stack, c, "w"))
        # Loading: the stream's head is out, and pings keep it alive until a token.
        assert next(waiter) == PING
        assert next(waiter) == PING
        wait_until(lambda: phases(c) == [("active", "loading")] or None, "the replica to load")
        driver.release_starts()
        driver.started("w")
        driver.emit("w", 1)
        driver.finish("w")
        data = [line for line in waiter if line != PING]
        assert data[-1] == f"data: {DONE}", data
        # The waiting request was the scale event up from zero (and, idle again with no
        # downscale delay, it may have gone down since).
        moves = [(e["replicas_from"], e["replicas_to"]) for e in describe(c)["autoscale"]["events"]]
        assert moves[:3] == [(1, 0), (0, 1), (1, 0)][: len(moves)] and (0, 1) in moves, moves
        assert receipt(c, "w")["completion_tokens"] == 1
