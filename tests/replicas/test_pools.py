"""Replica pools (``pool = "..."``): Ray replicas that several gateways share.

Two gateways on the session's Ray cluster name the same pool of scripted replicas
(one slot each): they attach to the same actors instead of starting their own, the
replicas' own slot count holds across both (a request finding its replica full goes
to the other one, or waits for a slot, never runs beside it), one gateway stopping
leaves the pool serving the other, and a replica that dies is created again once
and serves both. Every step is ordered by the driver's events; the pool is removed
afterwards by ``tokenmill pool stop``, as an operator would.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial
from typing import Any

import httpx
import pytest

from tests.conftest import RayCluster, ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.gateway.test_tier_routing import busy_home_moves
from tests.sse import DONE, events, text
from tests.waiting import HANG_S, wait_until

PROMPT = "Tell a long story."


def body(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": "scripted", "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}


def replicas(c: httpx.Client) -> list[dict[str, Any]]:
    r = c.get("/v1/deployments/scripted")
    assert r.status_code == 200, r.text
    return list(r.json()["replicas"])


def where(c: httpx.Client) -> list[tuple[int, str]]:
    """Each replica's pid and actor id, as the gateway reports them."""
    return [(r["pid"], r["actor_id"]) for r in replicas(c)]


def pool_cli(cluster: RayCluster, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tokenmill", "pool", *args, "--ray-address", cluster.address]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, env=env)


@pytest.fixture
def pool(ray_cluster: RayCluster) -> Iterator[str]:
    """A pool name of this test's own, stopped after the test's gateways (ask for it
    before ``driver`` and ``start_server``: it is torn down after them)."""
    name = f"pool-{uuid.uuid4().hex[:8]}"
    yield name
    stopped = pool_cli(ray_cluster, "stop", name)
    assert stopped.returncode == 0, stopped.stderr
    assert pool_cli(ray_cluster, "list").stdout.count(name) == 0


def pooled(driver: EngineDriver, cluster: RayCluster, pool: str, replicas: int) -> str:
    table = scripted_deployment(
        driver, placement="ray", pool=pool, ray_num_cpus=0.25, max_num_seqs=1, replicas=replicas
    )
    return f"ray_address = {cluster.address!r}\n{table}"


def most_at_once(driver: EngineDriver) -> dict[int, int]:
    """The most requests each replica process ran at once, from the driver's events."""
    running: dict[int, int] = {}
    most: dict[int, int] = {}
    for event in list(driver.events):
        if event["event"] not in ("started", "ended", "aborted"):
            continue
        pid = driver.pid(event["id"])
        running[pid] = running.get(pid, 0) + (1 if event["event"] == "started" else -1)
        most[pid] = max(most.get(pid, 0), running[pid])
    return most


def test_two_gateways_share_a_pool_and_never_overcommit_a_replica(
    pool: str,
    driver: EngineDriver,
    ray_cluster: RayCluster,
    start_server: Callable[..., ServerProcess],
) -> None:
    config = pooled(driver, ray_cluster, pool, replicas=2)
    gw_a, gw_b = start_server(config=config), start_server(config=config)
    with ExitStack() as stack, ThreadPoolExecutor(1) as waiting:
        a = stack.enter_context(httpx.Client(base_url=gw_a.url, timeout=HANG_S))
        b = stack.enter_context(httpx.Client(base_url=gw_b.url, timeout=HANG_S))
        # The same two actors for both: two engines in all, not four.
        shared = where(a)
        assert shared == where(b) and len({pid for pid, _ in shared}) == 2
        assert all(r["state"] == "ready" and r["pool"] == pool for r in replicas(b))
        assert driver.seen("hello") == 2
        listed = pool_cli(ray_cluster, "list")
        assert f'"{pool}/0"' in listed.stdout and f'"{pool}/1"' in listed.stdout, listed

        # a holds one replica's slot; b, which knows nothing of a's request, still
        # lands its first on the other replica (the full one refuses at once).
        streams = {}
        r = stack.enter_context(
            a.stream("POST", "/v1/completions", json=body(9), headers={"x-request-id": "a1"})
        )
        streams["a1"] = events(r)
        r = stack.enter_context(
            b.stream("POST", "/v1/completions", json=body(9), headers={"x-request-id": "b1"})
        )
        streams["b1"] = events(r)
        assert driver.pid("b1") != driver.pid("a1")
        # Both replicas full: b's next request waits for a slot (b's own admission had
        # one free), and starts nowhere meanwhile.
        b2 = waiting.submit(
            b.post, "/v1/completions", json=body(2, False), headers={"x-request-id": "b2"}
        )
        wait_until(lambda: b.get("/v1/deployments/scripted").json()["queued"] == 1, "b2 to wait")
        assert driver.seen("started", "b2") == 0
        # Each replica counts the slot taken, whichever gateway took it.
        wait_until(lambda: [rep["running"] for rep in replicas(a)] == [1, 1], "a's view")
        # a's request ends: its slot goes to b2, on that replica.
        driver.emit("a1", 1)
        driver.finish("a1")
        assert list(streams["a1"])[-1] == DONE
        driver.emit("b2", 2)
        finished = b2.result(timeout=HANG_S)
        assert finished.status_code == 200, finished.text
        assert finished.json()["usage"]["completion_tokens"] == 2
        assert driver.pid("b2") == driver.pid("a1")

        # a leaves: the pool's replicas stay, and serve b (b1 is still running).
        gw_a.stop()
        assert gw_a.proc.returncode == 0, gw_a.log()
        driver.emit("b1", 1)
        driver.finish("b1")
        assert list(streams["b1"])[-1] == DONE
        with b.stream("POST", "/v1/completions", json=body(1), headers={"x-request-id": "b3"}) as r:
            tail = events(r)
            driver.emit("b3", 1)
            assert list(tail)[-1] == DONE
        assert where(b) == shared and driver.seen("hello") == 2
    # Never more than one stream at once on a replica of one slot, across both gateways.
    assert most_at_once(driver) == {pid: 1 for pid, _ in shared}


def test_a_pool_replica_that_dies_is_created_again_once_and_serves_both_gateways(
    pool: str,
    driver: EngineDriver,
    ray_cluster: RayCluster,
    start_server: Callable[..., ServerProcess],
) -> None:
    config = pooled(driver, ray_cluster, pool, replicas=1)
    gw_a, gw_b = start_server(config=config), start_server(config=config)
    with (
        httpx.Client(base_url=gw_a.url, timeout=HANG_S) as a,
        httpx.Client(base_url=gw_b.url, timeout=HANG_S) as b,
    ):
        (first,) = where(a)
        assert where(b) == [first]
        with a.stream("POST", "/v1/completions", json=body(9), headers={"x-request-id": "k"}) as r:
            stream = events(r)
            driver.emit("k", 1)
            assert text(next(stream)) == " w1"
            driver.crash("k")  # the actor's process exits
            tail = list(stream)
        errors = [e for e in tail if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_error", tail

        def back(c: httpx.Client) -> dict[str, Any] | None:
            (rep,) = replicas(c)
            return rep if rep["state"] == "ready" and rep["pid"] != first[0] else None

        again_a = wait_until(lambda: back(a), "gateway a's replica to be back")
        again_b = wait_until(lambda: back(b), "gateway b's replica to be back")
        # One new actor, the same for both: whoever came first created it.
        assert (again_a["pid"], again_a["actor_id"]) == (again_b["pid"], again_b["actor_id"])
        assert again_a["actor_id"] != first[1]
        assert driver.seen("hello") == 2
        assert again_a["restarts"] == again_b["restarts"] == 1
        for c, rid in ((a, "after-a"), (b, "after-b")):
            with c.stream(
                "POST", "/v1/completions", json=body(1), headers={"x-request-id": rid}
            ) as r:
                tail_events = events(r)
                driver.emit(rid, 1)
                assert list(tail_events)[-1] == DONE
            assert driver.pid(rid) == again_a["pid"]


def real_pool(cluster: RayCluster, pool: str, model: str, slots: int, n_ctx: int) -> str:
    """A config of deployment ``model``: the real model in ``pool``, 2 replicas of
    ``slots`` slots and one thread each."""
    return (
        f"ray_address = {cluster.address!r}\n"
        f'[[deployments]]\nid = "{model}"\nplacement = "ray"\npool = "{pool}"\n'
        f"replicas = 2\nmax_num_seqs = {slots}\nn_ctx = {n_ctx}\nn_threads = 1\n"
        "ray_num_cpus = 0.25\n"
    )


def test_a_conversation_alternating_between_two_gateways_finds_its_cache(
    pool: str, ray_cluster: RayCluster, start_server: Callable[..., ServerProcess]
) -> None:
    # The real model, two replicas in the pool: each turn, through the other gateway,
    # goes to the replica holding the conversation (both gateways index both
    # replicas' caches) and finds the whole earlier conversation there; on the other
    # replica it would find nothing of it.
    config = real_pool(ray_cluster, pool, "smollm2", slots=2, n_ctx=512)
    gateways = [start_server(config=config), start_server(config=config)]
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three rivers of Europe."},
    ]
    usages: list[dict[str, Any]] = []
    routes: list[dict[str, Any]] = []
    for turn, srv in enumerate([*gateways, gateways[0], gateways[1]]):
        request = {"model": "smollm2", "messages": messages, "max_tokens": 8, "temperature": 0}
        with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
            r = c.post("/v1/chat/completions", json=request)
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
        rid = r.headers["x-request-id"]
        routes.append(wait_until(partial(srv.request_line, rid), "the log line")["route"])
        answer = r.json()["choices"][0]["message"]["content"]
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"And {turn + 2} more?"},
        ]
    for before, after in itertools.pairwise(usages):
        # At least the whole earlier prompt (and the answer, bar its last token, which
        # was sampled, not decoded, unless the engine warmed the next turn meanwhile).
        cached = after["prompt_tokens_details"]["cached_tokens"]
        assert cached >= before["prompt_tokens"] + before["completion_tokens"] - 1, usages
        assert after["prompt_tokens"] > cached
    # Every later turn continued the sequence one replica held, always the same one.
    assert all(r["reason"] == "cache" and r["continues"] for r in routes[1:]), routes
    assert len({r["replica"] for r in routes}) == 1, routes


def test_both_gateways_of_a_pool_see_what_its_replicas_parked(
    pool: str, ray_cluster: RayCluster, start_server: Callable[..., ServerProcess]
) -> None:
    # The real model, two replicas of one slot in the pool. Four conversations open
    # through gateway A, so at least one of the first two is parked in its replica's
    # host memory (a slot per replica). Each next turn of those two, through gateway B,
    # goes back to the replica holding it, from its slot or its host tier as B's own
    # index says, and finds it whole: both gateways index what the pool's replicas
    # publish, host-memory lanes included.
    config = real_pool(ray_cluster, pool, "smollm2", slots=1, n_ctx=512)
    config += f"kv_host_bytes = {64 << 20}\n"
    a, b = start_server(config=config), start_server(config=config)
    topics = ["lighthouses", "glaciers", "beekeeping", "violins"]

    def turn(srv: ServerProcess, prompt: str) -> tuple[dict[str, Any], dict[str, Any]]:
        request = {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{srv.url}/v1/completions", json=request, timeout=HANG_S)
        assert r.status_code == 200, r.text
        line = wait_until(partial(srv.request_line, r.headers["x-request-id"]), "the log line")
        return r.json(), line["route"]

    openings = {t: f"Notes for a museum guide about {t}, in three paragraphs. " * 4 for t in topics}
    first = {t: turn(a, openings[t]) for t in topics}
    tiers = []
    for t in topics[:2]:
        body, home = first[t]
        following = openings[t] + body["choices"][0]["text"] + " The next paragraph says"
        again, route = turn(b, following)
        assert route["replica"] == home["replica"], (t, route, home)
        assert (route["reason"], route["continues"]) == ("cache", True), route
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= body["usage"]["prompt_tokens"], (t, again["usage"])
        tiers.append(route["tier"])
    assert "host" in tiers and set(tiers) <= {"slot", "host"}, tiers


def test_a_pools_busy_home_sends_its_history_through_the_object_store(
    pool: str, ray_cluster: RayCluster, start_server: Callable[..., ServerProcess]
) -> None:
    # The real model, a pool of two replicas of one slot: a continuation whose home is
    # busy goes to the other pool replica, its KV state through Ray's object store
    # from one pool actor to the other.
    config = real_pool(ray_cluster, pool, "pooled", slots=1, n_ctx=1024)
    busy_home_moves(start_server(config=config), "pooled", via="ray_object_store")


def scaled_pool(driver: EngineDriver, cluster: RayCluster, pool: str) -> str:
    """A pool of one replica of one slot, autoscaled to 2 at one request a replica."""
    autoscale = (
        "[deployments.autoscale]\nmin_replicas = 1\nmax_replicas = 2\n"
        "target_ongoing_requests = 1\nupscale_delay_s = 0\ndownscale_delay_s = 0\n"
        "look_back_s = 0.01\n"
    )
    return pooled(driver, cluster, pool, replicas=1) + autoscale


def test_two_gateways_of_an_autoscaled_pool_scale_it_by_one_decision(
    pool: str,
    driver: EngineDriver,
    ray_cluster: RayCluster,
    start_server: Callable[..., ServerProcess],
) -> None:
    config = scaled_pool(driver, ray_cluster, pool)
    gw_a, gw_b = start_server(config=config), start_server(config=config)
    with ExitStack() as stack:
        a = stack.enter_context(httpx.Client(base_url=gw_a.url, timeout=HANG_S))
        b = stack.enter_context(httpx.Client(base_url=gw_b.url, timeout=HANG_S))
        streams = {}
        for c, rid in ((a, "a1"), (b, "b1")):
            r = stack.enter_context(
                c.stream("POST", "/v1/completions", json=body(9), headers={"x-request-id": rid})
            )
            streams[rid] = events(r)
        # One request at each gateway: each alone is within its one replica's target,
        # together they are two. The pool's scaler sums them: one more replica, started
        # once (one new engine) and used by both gateways.
        driver.started("a1")
        driver.started("b1")
        assert driver.pid("a1") != driver.pid("b1")
        assert driver.seen("hello") == 2
        for c in (a, b):
            scaled = c.get("/v1/deployments/scripted").json()["autoscale"]
            assert scaled["desired_replicas"] == 2
            assert [(e["replicas_from"], e["replicas_to"]) for e in scaled["events"]] == [(1, 2)]
        assert f'"{pool}/1"' in pool_cli(ray_cluster, "list").stdout
        # a1 holds replica 0's only slot: b1 waited for the new replica 1.
        pids = [pid for pid, _ in where(a)]
        assert pids == [driver.pid("a1"), driver.pid("b1")] and where(b) == where(a)

        # a1 ends: one request in all, one replica. Both gateways drain the same one,
        # the newest, which b1 runs on: it finishes there before the replica goes.
        driver.emit("a1", 1)
        driver.finish("a1")
        assert list(streams["a1"])[-1] == DONE

        def leaving(c: httpx.Client) -> bool | None:
            return [r["phase"] for r in replicas(c)][1] in ("draining", "off") or None

        for c in (a, b):
            wait_until(partial(leaving, c), "replica 1 to leave")
        driver.emit("b1", 2)
        driver.finish("b1")
        b1 = list(streams["b1"])
        assert b1[-1] == DONE and "".join(text(e) for e in b1 if isinstance(e, dict)) == " w1 w2"
        # Once neither gateway uses it, the pool's replica 1 is stopped, for both.
        wait_until(
            lambda: f'"{pool}/1"' not in pool_cli(ray_cluster, "list").stdout or None,
            "the pool's replica 1 to be stopped",
        )
        for c in (a, b):
            assert [r["phase"] for r in replicas(c)] == ["active", "off"]
        with b.stream("POST", "/v1/completions", json=body(1), headers={"x-request-id": "b2"}) as r:
            tail = events(r)
            driver.emit("b2", 1)
            assert list(tail)[-1] == DONE
        assert driver.pid("b2") == pids[0]
