"""Replicas on a Ray cluster (``placement = "ray"``), through the whole gateway.

A real Ray cluster runs on this machine (``ray_cluster``); gateways join it by
``ray_address``. Scripted replicas order every step by the driver's events: a
replica's actor dying ends its streams with an error event and ``[DONE]``, a node
dying moves the replica to a surviving node, and a client leaving stops generation.
One test serves the real model from a Ray actor on a second node, beside a
process replica of the same model. The rest drive an actor directly, in this
process: frame order both ways over its channel, the secret its connection needs,
and its channel ending when Ray says it died, even with its socket still open.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RayCluster, ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.gateway.test_tier_routing import busy_home_moves
from tests.otlp import Received, Receiver, traced_env
from tests.sse import DONE, events, text, to_done
from tests.waiting import HANG_S, wait_until
from tokenmill.config import ReplicatedDeployment
from tokenmill.errors import EngineError
from tokenmill.replicas.wire import encode_frame, read_frame
from tokenmill.stages import STAGE_NAMES

PROMPT = "Tell a long story."  # 4 words: 4 prompt tokens for the scripted engine


def body(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": "scripted", "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}


def named(rid: str) -> dict[str, str]:
    return {"x-request-id": rid}


def replica(c: httpx.Client, dep: str = "scripted") -> dict[str, Any]:
    r = c.get(f"/v1/deployments/{dep}")
    assert r.status_code == 200, r.text
    return dict(r.json()["replicas"][0])


def on_ray(driver: EngineDriver, cluster: RayCluster, extra: str = "") -> str:
    """A scripted deployment on the cluster; ``extra`` lines go in its table."""
    table = scripted_deployment(driver, placement="ray", max_num_seqs=2)
    return f"ray_address = {cluster.address!r}\n{table}{extra}"


def test_a_ray_replica_serves_streams_and_says_where_it_runs(
    driver: EngineDriver, ray_cluster: RayCluster, start_server: Callable[..., ServerProcess]
) -> None:
    srv = start_server(config=on_ray(driver, ray_cluster))
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        rep = replica(c)
        assert rep["host"] == "ray" and rep["state"] == "ready" and rep["restarts"] == 0
        assert rep["pid"] == driver.wait("hello")["pid"]  # the actor's own process
        assert rep["node_id"] in ray_cluster.node_ids() and rep["node_address"]
        with c.stream("POST", "/v1/completions", json=body(3), headers=named("s")) as r:
            stream = events(r)
            driver.emit("s", 3)
            got = list(stream)
        assert got[-1] == DONE
        assert "".join(text(e) for e in got if isinstance(e, dict)) == " w1 w2 w3"
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(c.post, "/v1/completions", json=body(2, False), headers=named("w"))
            driver.emit("w", 2)
            r2 = whole.result(timeout=HANG_S)
        assert r2.status_code == 200, r2.text
        usage = r2.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (4, 2)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """An OTLP receiver; named before the servers, it outlives them (they export what
    is left as they stop)."""
    r = Receiver()
    yield r
    r.close()


def test_a_ray_actor_exports_its_spans_into_the_gateways_trace(
    receiver: Receiver,
    driver: EngineDriver,
    ray_cluster: RayCluster,
    start_server: Callable[..., ServerProcess],
) -> None:
    # The actor runs on the test's cluster, whose processes have no OTEL_* variables:
    # it exports because the gateway hands them on in the actor's runtime environment.
    srv = start_server(config=on_ray(driver, ray_cluster), env=traced_env(receiver))
    trace_id, parent = "5bf92f3577b34da6a3ce929d0e0e4736", "10f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{parent}-01", **named("t")}
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(c.post, "/v1/completions", json=body(2, False), headers=headers)
        driver.emit("t", 2)
        assert answer.result(timeout=HANG_S).status_code == 200
    names = {"tokenmill.replica", "tokenmill.replica.decode", "tokenmill.decode"}

    def spans() -> list[Received] | None:
        got = receiver.trace(trace_id)
        return got if names <= {s.span.name for s in got} else None

    got = wait_until(spans, "the gateway's and the actor's spans")
    [root] = [s for s in got if s.span.name == "text_completion scripted"]
    [actor] = [s for s in got if s.span.name == "tokenmill.replica"]
    [decode] = [s for s in got if s.span.name == "tokenmill.replica.decode"]
    assert root.parent == parent and actor.parent == root.id and decode.parent == actor.id
    assert actor.attributes["tokenmill.replica.pid"] == driver.wait("hello")["pid"]
    assert actor.attributes["gen_ai.usage.output_tokens"] == 2
    assert actor.resource["service.name"] == "tokenmill-under-test"


def test_a_client_leaving_stops_generation_on_ray(
    driver: EngineDriver, ray_cluster: RayCluster, start_server: Callable[..., ServerProcess]
) -> None:
    srv = start_server(config=on_ray(driver, ray_cluster))
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with c.stream("POST", "/v1/completions", json=body(50), headers=named("gone")) as r:
            stream = events(r)
            driver.emit("gone", 2)
            assert [text(next(stream)) for _ in range(2)] == [" w1", " w2"]
        # The connection closed: the actor is told, and the slot comes back.
        assert driver.wait("aborted", "gone")["tokens"] == 2
        wait_until(lambda: replica(c)["in_flight"] == 0, "the slot to come back")


def test_a_dead_actor_ends_its_streams_and_is_replaced(
    driver: EngineDriver, ray_cluster: RayCluster, start_server: Callable[..., ServerProcess]
) -> None:
    srv = start_server(config=on_ray(driver, ray_cluster))
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c, ThreadPoolExecutor(1) as pool:
        first = replica(c)
        whole = pool.submit(c.post, "/v1/completions", json=body(50, False), headers=named("w"))
        driver.wait("started", "w")
        with c.stream("POST", "/v1/completions", json=body(50), headers=named("s")) as r:
            stream = events(r)
            driver.emit("s", 1)
            assert text(next(stream)) == " w1"
            driver.crash("s")  # the actor's process exits: both requests lose it
            tail = list(stream)
        assert tail[-1] == DONE
        errors = [e for e in tail if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_error", tail
        answer = whole.result(timeout=HANG_S)
        assert answer.status_code == 502, answer.text
        assert answer.json()["error"]["code"] == "engine_error"
        # A new actor: it connects to the driver again, and serves.
        second_pid = driver.wait("hello", count=2)["pid"]
        back = wait_until(
            lambda: (rep := replica(c))["state"] == "ready" and rep, "the replica to be back"
        )
        assert back["pid"] == second_pid != first["pid"] and back["restarts"] == 1
        with c.stream("POST", "/v1/completions", json=body(1), headers=named("again")) as r:
            stream = events(r)
            driver.emit("again", 1)
            assert [e for e in stream if e == DONE] == [DONE]


def test_a_dead_node_moves_its_replica_to_a_surviving_node(
    driver: EngineDriver, ray_cluster: RayCluster, start_server: Callable[..., ServerProcess]
) -> None:
    # Two nodes offer the pool; the replica lands on one, which then dies whole.
    nodes = [ray_cluster.add_node(pool=1), ray_cluster.add_node(pool=1)]
    try:
        config = on_ray(driver, ray_cluster, "ray_num_cpus = 0.5\nray_resources = { pool = 1 }\n")
        srv = start_server(config=config)
        with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
            first = replica(c)
            assert first["node_id"] in nodes
            with c.stream("POST", "/v1/completions", json=body(50), headers=named("n")) as r:
                stream = events(r)
                driver.emit("n", 1)
                assert text(next(stream)) == " w1"
                ray_cluster.remove_node(first["node_id"])
                tail = list(stream)
            assert tail[-1] == DONE
            errors = [e for e in tail if isinstance(e, dict) and "error" in e]
            assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_error", tail
            back = wait_until(
                lambda: (rep := replica(c))["state"] == "ready" and rep, "the replica to move"
            )
            survivor = next(n for n in nodes if n != first["node_id"])
            assert back["node_id"] == survivor and back["restarts"] >= 1
    finally:
        for node in nodes:
            if node in ray_cluster.node_ids():
                ray_cluster.remove_node(node)


def test_a_node_gone_for_good_queues_requests_then_503(
    driver: EngineDriver, ray_cluster: RayCluster, start_server: Callable[..., ServerProcess]
) -> None:
    # Only one node offers `only_b`: once it is gone, no replica can ever come back.
    node = ray_cluster.add_node(only_b=1)
    try:
        extra = "ray_num_cpus = 0.5\nray_resources = { only_b = 1 }\nqueue_timeout_s = 0.5\n"
        srv = start_server(config=on_ray(driver, ray_cluster, extra))
        with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
            assert replica(c)["node_id"] == node
            with c.stream("POST", "/v1/completions", json=body(50), headers=named("b")) as r:
                stream = events(r)
                driver.emit("b", 1)
                assert text(next(stream)) == " w1"
                ray_cluster.remove_node(node)
                tail = list(stream)
            assert tail[-1] == DONE
            errors = [e for e in tail if isinstance(e, dict) and "error" in e]
            assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_error", tail
            # The replacement actor is pending: no node offers what it needs.
            wait_until(lambda: replica(c)["state"] == "restarting", "the replica to restart")
            r2 = c.post("/v1/completions", json=body(2, False), headers=named("q"))
            # Refused by the queue's timeout (it waited there), not at once: no replica
            # came back, because none can.
            assert r2.status_code == 503, r2.text
            assert "no replica was ready to serve within 0.5s" in r2.json()["error"]["message"]
            assert float(r2.headers["retry-after"]) > 0
            status = c.get("/v1/deployments/scripted").json()
            assert status["queued"] == 0 and replica(c)["state"] == "restarting"
            assert driver.seen("started", "q") == 0
        # Closing the gateway cancels the pending launch (the fixture's SIGTERM, at once).
        srv.stop()
        assert srv.proc.returncode == 0, srv.log()
    finally:
        if node in ray_cluster.node_ids():
            ray_cluster.remove_node(node)


def test_the_real_model_on_a_second_node_streams_what_a_process_replica_does(
    ray_cluster: RayCluster, start_server: Callable[..., ServerProcess]
) -> None:
    # The same model twice in one gateway: one replica placed on node B by its
    # resource, one a child process. Greedy decoding gives the same tokens on both.
    node_b = ray_cluster.add_node(node_b=1)
    try:
        common = "max_num_seqs = 2\nn_ctx = 512\nn_threads = 1\n"
        config = (
            f"ray_address = {ray_cluster.address!r}\n"
            f'[[deployments]]\nid = "onray"\nplacement = "ray"\n{common}'
            "ray_num_cpus = 0.5\nray_resources = { node_b = 1 }\n"
            f'[[deployments]]\nid = "local"\nplacement = "process"\n{common}'
        )
        srv = start_server(config=config)
        with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
            on_b = replica(c, "onray")
            assert on_b["host"] == "ray" and on_b["node_id"] == node_b and on_b["pid"]
            assert replica(c, "local")["host"] == "process"
            answers, ids = {}, {}
            for dep in ("onray", "local"):
                request: dict[str, Any] = {"model": dep, "max_tokens": 16, "stream": True}
                request |= {"messages": [{"role": "user", "content": "Say hi"}]}
                request |= {"temperature": 0, "ignore_eos": True}
                request |= {"stream_options": {"include_usage": True}}
                with c.stream("POST", "/v1/chat/completions", json=request) as r:
                    assert r.status_code == 200
                    ids[dep] = r.headers["x-request-id"]
                    got = to_done(r)
                pieces = [e["choices"][0]["delta"].get("content", "") for e in got if e["choices"]]
                answers[dep] = ("".join(pieces), got[-1]["usage"])
            assert answers["onray"] == answers["local"]
            # Ray starts workers at nice 15; the replica runs at its replica_nice (0),
            # every thread, llama.cpp's included, as a process replica does.
            assert thread_niceness(on_b["pid"]) == {0}
            said, usage = answers["onray"]
            assert said and usage["completion_tokens"] == 16 and usage["prompt_tokens"] > 0
            assert usage["total_tokens"] == usage["prompt_tokens"] + 16
            # Node B is this host: the actor's first-token marks are on the gateway's
            # clock, so its TTFT stages are all logged, replica ones included, in order.
            line = wait_until(lambda: srv.request_line(ids["onray"]), "the request's log line")
            assert list(line["stages_ms"]) == list(STAGE_NAMES)
            assert min(line["stages_ms"].values()) >= 0, line["stages_ms"]
            # The replica's count reaches the gateway with its next status frame.
            wait_until(lambda: replica(c, "onray")["tokens_generated"] >= 16, "the count")
    finally:
        if node_b in ray_cluster.node_ids():
            ray_cluster.remove_node(node_b)


def test_a_busy_homes_history_moves_between_ray_actors(
    ray_cluster: RayCluster, start_server: Callable[..., ServerProcess]
) -> None:
    # Two Ray actors of one slot each: a continuation whose home is busy goes to the
    # other actor, its KV state exported by one actor into Ray's object store and
    # imported from there by the other: the gateway passes only a reference on.
    config = (
        f"ray_address = {ray_cluster.address!r}\n"
        '[[deployments]]\nid = "moves"\nplacement = "ray"\nreplicas = 2\n'
        "max_num_seqs = 1\nn_ctx = 1024\nn_threads = 1\nray_num_cpus = 0.5\n"
    )
    busy_home_moves(start_server(config=config), "moves", via="ray_object_store")


def run_on_ray(cluster: RayCluster, scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``scenario`` on an event loop of its own, connected to ``cluster``'s Ray."""
    from tokenmill.replicas.rayactor import acquire_ray, release_ray

    acquire_ray(cluster.address)
    try:
        asyncio.run(scenario())
    finally:
        release_ray()


def thread_niceness(pid: int) -> set[int]:
    """The niceness of each thread of process ``pid`` (this machine's)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text()
        found.add(int(stat[stat.rindex(")") + 2 :].split()[16]))  # field 19: nice
    return found


def scripted_on_ray(driver: EngineDriver) -> ReplicatedDeployment:
    from tokenmill.config import parse_section

    keys = {"id": "scripted", "engine": "scripted", "control": str(driver.path)}
    section = parse_section({**keys, "placement": "ray", "ray_num_cpus": 0.5})
    assert isinstance(section, ReplicatedDeployment)
    return section


def test_a_ray_channel_keeps_frame_order_and_ends_with_its_actor(
    driver: EngineDriver, ray_cluster: RayCluster
) -> None:
    from tokenmill.replicas.rayactor import RayLauncher

    async def scenario() -> None:
        launcher = RayLauncher(scripted_on_ray(driver), ray_cluster.address)
        channel = await launcher.launch()
        try:
            first = await channel.receive()
            assert first is not None and first["op"] == "ready", first
            # Each call is answered (a text, or an error frame with its id), in order.
            for i in range(20):
                channel.send({"op": "detokenize", "id": f"c{i}", "tokens": [i]})
            answered: list[str] = []
            while len(answered) < 20:
                msg = await channel.receive()
                assert msg is not None
                if msg["op"] in ("answer", "error"):
                    answered.append(msg["id"])
            assert answered == [f"c{i}" for i in range(20)]
            channel.kill()
            assert await asyncio.wait_for(channel.wait(), HANG_S) == "killed by the gateway"
            while await channel.receive() is not None:  # what had come before the kill
                pass
            with pytest.raises(EngineError):
                channel.send({"op": "ping"})
        finally:
            channel.kill()
            await channel.wait()
            await launcher.close()

    asyncio.run(scenario())


def test_a_ray_actor_serves_only_the_connection_that_brings_its_secret(
    driver: EngineDriver, ray_cluster: RayCluster
) -> None:
    import ray

    from tokenmill.replicas.rayactor import ReplicaActor

    async def closed_at_once(address: str, port: int, first: bytes) -> None:
        reader, writer = await asyncio.open_connection(address, port)
        writer.write(first)
        assert await reader.read() == b""  # closed, without a frame
        writer.close()

    async def scenario() -> None:
        section = scripted_on_ray(driver).model_dump(mode="json")
        actor: Any = ray.remote(ReplicaActor).options(num_cpus=0.5).remote(section, "INFO", 0, "s")
        try:
            _, _, address, port, _ = await actor.open.remote()
            await closed_at_once(address, port, encode_frame({"op": "hello", "secret": "t"}))
            await closed_at_once(address, port, encode_frame({"op": "ping"}))
            await closed_at_once(address, port, b"\xff\xff\xff\xff")  # 4 GiB to come
            assert driver.seen("hello") == 0  # no engine started for any of them
            reader, writer = await asyncio.open_connection(address, port)
            writer.write(encode_frame({"op": "hello", "secret": "s"}))
            first = await read_frame(reader)
            assert first is not None and first["op"] == "ready", first
            assert driver.seen("hello") == 1
            # Accepted: the actor listens no more.
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection(address, port)
            writer.write(encode_frame({"op": "close"}))
            assert await read_frame(reader) is None
            assert await actor.ended.remote() == 0
            writer.close()
        finally:
            ray.kill(actor, no_restart=True)

    run_on_ray(ray_cluster, scenario)


def test_a_ray_channel_ends_when_ray_says_its_actor_died_though_its_socket_stays_open(
    driver: EngineDriver, ray_cluster: RayCluster
) -> None:
    # A vanished node may never close the connection: Ray's word is enough.
    import ray

    from tokenmill.replicas.host import ReplicaLocation
    from tokenmill.replicas.rayactor import RayChannel, ReplicaActor

    async def scenario() -> None:
        section = scripted_on_ray(driver).model_dump(mode="json")
        actor: Any = ray.remote(ReplicaActor).options(num_cpus=0.5).remote(section, "INFO", 0, "s")
        ours, theirs = socket.socketpair()  # the test holds the far end open throughout
        try:
            await actor.open.remote()
            reader, writer = await asyncio.open_connection(sock=ours)
            ended = actor.ended.remote()
            channel = RayChannel(actor, ReplicaLocation(), reader, writer, ended, None)
            receiving = asyncio.ensure_future(channel.receive())
            ray.kill(actor, no_restart=True)
            assert await asyncio.wait_for(receiving, HANG_S) is None
            how = await asyncio.wait_for(channel.wait(), HANG_S)
            assert "ActorDiedError" in how, how
            with pytest.raises(EngineError):
                channel.send({"op": "ping"})
        finally:
            theirs.close()
            ray.kill(actor, no_restart=True)

    run_on_ray(ray_cluster, scenario)
