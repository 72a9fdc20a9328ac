"""Ray replicas: an engine in a Ray actor on any node of a cluster, ``placement = "ray"``.

The gateway keeps supervising, exactly as for a child process: admission, the credit
hold, the stream, cancellation and settlement stay in the gateway, and the replica
runs the same loop (:func:`tokenmill.replicas.runner.serve`). A :class:`RayLauncher`
creates one :class:`ReplicaActor` per replica; the
:class:`~tokenmill.replicas.supervisor.SupervisedHost` around it restarts it when it
dies (a new actor, which Ray places on any node with the resources: a surviving one
when its node is gone).

Ray places, locates and supervises the actor; the frames do not travel as Ray objects.
The actor listens on its node's address (a port of the system's choosing) and the
gateway connects to it: the same length-prefixed frames of
:mod:`tokenmill.replicas.wire` as a process replica's socket pair, written and read by
the same code (:class:`~tokenmill.replicas.process.SocketChannel` here,
:func:`~tokenmill.replicas.runner.serve_stream` in the actor). Frames as Ray objects
(one per decode step actor -> gateway, one ``send`` call per event-loop pass the other
way) cost what Ray charges per object: on 2 cores, 1.26 ms of gateway CPU a token
against a process replica's 0.44 at one stream, 20.46 ms of actor CPU against
19.87, and so 0.83 of a process replica's tok/s at concurrency 1 and 0.91 at 16 (the
Ray runs in docs/benchmarks.md). Over the socket a frame costs a ``write`` and a read, as for
a process replica: in two (busy) runs the gateway spent 0.61 and 0.79 ms of CPU a
token with a Ray replica at one stream, against 0.62 and 0.77 with a process replica.

The connection is authenticated, not encrypted: the gateway makes a random secret for
each actor and passes it in the actor's constructor (Ray's own control channel
carries it); the actor accepts the first connection whose first frame (``hello``)
carries it, closes any other, and stops listening once one is accepted. The stream
itself is plain TCP, as Ray's own traffic is without TLS: run the cluster on a
network you trust.

Death: a replica ends when its connection does, or when Ray says its actor is dead
(a node that vanishes may never close the connection): the channel keeps one call on
the actor pending, ``ended``, which returns only when the actor's replica loop does,
and Ray fails it when the actor or its node dies. Either way the streams end with an
error at once. ``kill`` is ``ray.kill`` and closing the connection.

``ray_address`` (a setting, ``--ray-address``, ``TOKENMILL_RAY_ADDRESS``) names the
cluster; ``"local"`` or nothing starts a private Ray instance on this machine, stopped
when the last Ray replica closes. A deployment's ``ray_num_cpus`` and ``ray_resources``
say where its replicas may run. Workers need tokenmill installed (and the model file at
the same path, or the embedded model's package), and the gateway must reach every
node's address on any port. This module imports ``ray``: it is loaded only for a
deployment placed on Ray, never by ``import tokenmill``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import threading
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayError

from tokenmill import otel, stages
from tokenmill.config import ReplicatedDeployment
from tokenmill.engines import Engine, KvMoving, KvState
from tokenmill.errors import EngineError
from tokenmill.replicas.host import KvLink, KvParcel, ReplicaLocation
from tokenmill.replicas.process import SocketChannel
from tokenmill.replicas.supervisor import START_TIMEOUT_S
from tokenmill.replicas.wire import HEADER, encode_frame

log = logging.getLogger("tokenmill.replicas.ray")

_init_lock = threading.Lock()
_users = 0  # launchers using this process's Ray connection
# Whether this module connected it (and so may disconnect it): inside a Ray worker (a
# gateway cell on Ray Serve) the connection is the worker's own and must stay.
_owned = False
# A private local instance notices a dead node (a killed raylet) within about a second,
# so its replicas' streams end well within 2 s; Ray's defaults take several seconds.
# It also skips what only Ray's dashboard and state API would read (per-task events,
# Ray's own metrics) and the idle worker Ray starts ahead for a driver: the gateway's
# actors need neither, and together they cost about 15 CPU ms a second on a machine
# whose every cycle is taken from llama.cpp.
LOCAL_SYSTEM_CONFIG: dict[str, Any] = {
    "health_check_period_ms": 300,
    "health_check_timeout_ms": 300,
    "health_check_failure_threshold": 3,
    "task_events_report_interval_ms": 0,
    "enable_metrics_collection": False,
    "prestart_worker_first_driver": False,
    "enable_worker_prestart": False,
}
# The gateway's connection to a placed actor: made within this long, or the launch
# fails (a node whose address the gateway cannot reach).
CONNECT_TIMEOUT_S = 30.0
# A peer connecting to an actor sends its ``hello`` within this long and this size, or
# is closed.
HELLO_TIMEOUT_S = 10.0
HELLO_MAX_BYTES = 1024


def acquire_ray(address: str | None) -> None:
    """Connect this process to Ray, once for all launchers: ``address``'s cluster, or a
    private local instance for ``"local"`` or nothing. Blocking (seconds): call it off
    the event loop (which also keeps Ray from taking over the main thread's signals)."""
    global _users, _owned
    with _init_lock:
        _users += 1
        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        options: dict[str, Any] = {
            "include_dashboard": False,
            "log_to_driver": False,
            "configure_logging": False,
        }
        try:
            if address in (None, "", "local"):
                # "local" explicitly: a bare init() would join a cluster that `ray start`
                # left in /tmp/ray, which refuses a _system_config.
                ray.init(address="local", _system_config=LOCAL_SYSTEM_CONFIG, **options)
            else:
                ray.init(address=address, **options)
        except BaseException:
            _users -= 1
            raise
        _owned = True
        log.info("connected to Ray at %s", ray.get_runtime_context().gcs_address)


def release_ray() -> None:
    """One launcher less; the last one disconnects what :func:`acquire_ray` connected
    (and so stops a private instance)."""
    global _users, _owned
    with _init_lock:
        _users = max(0, _users - 1)
        if _users == 0 and _owned:
            _owned = False
            ray.shutdown()


def renice_threads(nice: int) -> None:
    """Give every thread of this process the niceness ``nice`` (``replica_nice``).

    Ray starts its worker processes at nice 15 (``worker_niceness``): a replica left
    there runs its llama.cpp threads below everything else on the node, the gateway
    and its clients included, and loses throughput to a process replica (nice 0) on
    any host with other work. Linux keeps a niceness per thread, and the threads Ray
    started before this actor existed keep theirs unless each is set; threads started
    later inherit their creator's. Lowering a niceness needs ``CAP_SYS_NICE`` (root
    has it); without it the replica stays at Ray's and says so.
    """
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread only
        tids = [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except PermissionError:
            log.warning(
                "the Ray replica cannot set its niceness to %d (it is %d, Ray's "
                "worker_niceness; lowering it needs CAP_SYS_NICE): its threads run below "
                "other work on this node",
                nice,
                os.getpriority(os.PRIO_PROCESS, 0),
            )
            return


class ObjectStoreKv:
    """An actor's side of moving KV state through Ray's object store
    (:class:`RayKvLink`): ``kv_export`` returns a sequence's description and its state
    as two objects, so the gateway reads the small one and hands the other, by
    reference, to the target actor's ``kv_import``; Ray carries the bytes from the
    donor's node to the target's (within a node, through its shared memory), never
    through the gateway. ``_kv_engine`` is the actor's loaded engine, None before."""

    def _kv_engine(self) -> Engine | None:
        raise NotImplementedError

    @ray.method(num_returns=2)
    async def kv_export(
        self, tokens: list[int], min_tokens: int
    ) -> tuple[dict[str, Any] | None, bytes]:
        engine = self._kv_engine()
        if not isinstance(engine, KvMoving):
            return None, b""
        got = await engine.export_kv(tokens, min_tokens)
        if got is None:
            return None, b""
        described = {"tokens": list(got.tokens), "fp": got.fingerprint, "nbytes": len(got.state)}
        return described, got.state

    async def kv_import(self, tokens: list[int], fingerprint: str, state: bytes) -> bool:
        engine = self._kv_engine()
        if not isinstance(engine, KvMoving):
            return False
        return await engine.import_kv(KvState(tuple(tokens), bytes(state), fingerprint))


class RayKvLink:
    """The gateway's handle on a Ray replica's object-store moves (see
    :class:`ObjectStoreKv`): a :class:`~tokenmill.replicas.host.KvLink`."""

    kind = "ray_object_store"

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def export_kv(self, tokens: Sequence[int], min_tokens: int) -> KvParcel | None:
        described, state = self.actor.kv_export.remote(list(tokens), min_tokens)
        found: dict[str, Any] | None = await described
        if found is None:
            return None
        held = tuple(int(t) for t in found["tokens"])
        return KvParcel(held, int(found["nbytes"]), str(found["fp"]), self.kind, state)

    async def import_kv(self, parcel: KvParcel) -> bool:
        # The reference as an argument: Ray hands the actor the bytes it names.
        taken = self.actor.kv_import.remote(list(parcel.tokens), parcel.fingerprint, parcel.handle)
        return bool(await taken)


class ReplicaActor(ObjectStoreKv):
    """The replica side on Ray: :func:`tokenmill.replicas.runner.serve` in an actor,
    over one authenticated TCP connection from its gateway."""

    def __init__(self, section: dict[str, Any], log_level: str, nice: int, secret: str) -> None:
        logging.basicConfig(
            level=log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s[ray replica]: %(message)s",
        )
        renice_threads(nice)  # before the engine starts a thread: they inherit it
        self.section = section
        self._secret = secret.encode()
        self._listener: asyncio.Server | None = None
        self._taken = False  # the gateway's connection is accepted: no other
        self._served: asyncio.Future[int] | None = None  # the replica loop's exit code
        self._engine: Engine | None = None  # once the replica loop has loaded it

    def _kv_engine(self) -> Engine | None:
        return self._engine

    def _loaded(self, engine: Engine) -> None:
        self._engine = engine

    async def open(self) -> tuple[int, str, str, int, str | None]:
        """Listen for the gateway; where: pid, node id, node address, port, and the
        host's clock (:func:`tokenmill.stages.clock_id`)."""
        address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self._served = asyncio.get_running_loop().create_future()
        self._listener = await asyncio.start_server(self._connected, address, 0)
        port = int(self._listener.sockets[0].getsockname()[1])
        node_id = ray.get_runtime_context().get_node_id()
        return os.getpid(), node_id, address, port, stages.clock_id()

    async def ended(self) -> int:
        """The replica loop's exit code, once it has ended: the gateway keeps this call
        pending for the actor's whole life, and Ray fails it when the actor dies."""
        if self._served is None:
            raise RuntimeError("ended() before open()")
        return await asyncio.shield(self._served)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not await self._authentic(reader) or self._taken:
            log.warning("closed a connection from %s: not the gateway's", peer(writer))
            writer.close()
            return
        self._taken = True
        if self._listener is not None:
            self._listener.close()  # the connection stays; nobody else gets one
        from tokenmill.replicas.runner import serve_stream

        code = 1
        try:
            code = await serve_stream(reader, writer, self.section, self._loaded)
        except Exception:
            log.exception("the replica loop failed")
        finally:
            self._engine = None  # closed: nothing more moves through the object store
            if self._served is not None and not self._served.done():
                self._served.set_result(code)

    async def _authentic(self, reader: asyncio.StreamReader) -> bool:
        """Whether the peer's first frame is a ``hello`` with this actor's secret."""
        secret = await read_hello(reader)
        return secret is not None and hmac.compare_digest(secret.encode(), self._secret)


async def read_hello(reader: asyncio.StreamReader) -> str | None:
    """The secret in a peer's first frame, a ``hello`` sent within ``HELLO_TIMEOUT_S`` and
    ``HELLO_MAX_BYTES``; None when it is anything else."""
    try:
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
            if size > HELLO_MAX_BYTES:
                return None
            hello = json.loads(await reader.readexactly(size))
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError):
        return None
    if not (isinstance(hello, dict) and hello.get("op") == "hello"):
        return None
    secret = hello.get("secret")
    return secret if isinstance(secret, str) else None


def peer(writer: asyncio.StreamWriter) -> str:
    return str(writer.get_extra_info("peername"))


class RayChannel(SocketChannel):
    """One replica actor: frames over its TCP connection, death from Ray too.

    ``ended``, the actor's call pending for its whole life, is awaited by a task of
    the channel's: Ray failing it (the actor or its node died) closes the connection
    here, so ``receive`` returns None even when no end of stream ever comes. ``wait``
    returns at the first of the end of stream and that call's end; it then stops
    watching, so nothing waits on Ray after the launcher disconnects.
    """

    def __init__(
        self,
        actor: Any,
        location: ReplicaLocation,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        ended: Any,  # the ObjectRef of actor.ended
        clock: str | None,  # the actor's host's clock (stages.clock_id)
    ) -> None:
        super().__init__(reader, writer)
        # On the gateway's own host (any Ray node there) the replica's first-token marks
        # are on our clock, as a child process's are: its TTFT stages count.
        self.same_clock = clock is not None and clock == stages.clock_id()
        self.actor = actor
        self._location = location
        self._how: str | None = None  # how it ended, once it has
        self._eof = asyncio.Event()  # receive() found the end of the stream
        self._watch = asyncio.ensure_future(self._watch_actor(ended))

    @property
    def name(self) -> str:
        where = self._location
        node = (where.node_id or "")[:12]
        return f"ray replica (pid {where.pid} on node {where.node_address} {node})"

    def location(self) -> ReplicaLocation:
        return self._location

    def kv_link(self) -> KvLink | None:
        return RayKvLink(self.actor)

    async def receive(self) -> dict[str, Any] | None:
        message = await super().receive()
        if message is None:
            self._ended("its connection closed")
            self._eof.set()
        return message

    async def _watch_actor(self, ended: Any) -> None:
        try:
            code = await ended
        except RayError as e:
            self._ended(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            # The actor is dead: its connection may never see an end (a vanished node
            # sends no FIN), so it ends here.
            self.close_socket()
        except Exception as e:  # Ray itself failing here must still end the channel
            self._ended(f"watching it failed: {type(e).__name__}: {e}")
            self.close_socket()
        else:
            # Its loop returned and closed the connection: the frames before that end
            # are still read.
            self._ended(f"its replica loop ended (exit {code})")

    def _ended(self, how: str) -> None:
        if self._how is None:
            self._how = how

    def detach(self) -> None:
        self.kill()  # this gateway's alone: nothing else uses it

    def kill(self) -> None:
        self._ended("killed by the gateway")
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self.close_socket()

    async def wait(self) -> str:
        if not (self._eof.is_set() or self._watch.done()):
            eof = asyncio.ensure_future(self._eof.wait())
            try:
                await asyncio.wait((eof, self._watch), return_when=asyncio.FIRST_COMPLETED)
            finally:
                eof.cancel()
        if not self._watch.done():
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        return self._how or "it ended"


class RayLauncher:
    """Creates replica actors for one deployment section."""

    kind = "ray"

    def __init__(self, config: ReplicatedDeployment, address: str | None = None) -> None:
        self.section = config.model_dump(mode="json")
        self.address = address
        self.nice = config.replica_nice
        self.options: dict[str, Any] = {
            "num_cpus": config.ray_cpus(),
            "resources": dict(config.ray_resources),
            "max_restarts": 0,  # the gateway restarts it (SupervisedHost)
            "max_task_retries": 0,
        }
        if otel.traces_enabled():
            # Its spans join the gateway's traces, exported as the gateway's are: the
            # actor runs wherever Ray puts it, with the gateway's OTEL_* variables.
            self.options["runtime_env"] = {"env_vars": otel.passed_on()}
        self._connected = False

    async def launch(self) -> RayChannel:
        if not self._connected:
            await asyncio.to_thread(acquire_ray, self.address)
            self._connected = True
        actor_class: Any = ray.remote(ReplicaActor).options(**self.options)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        secret = secrets.token_hex(32)  # the actor's constructor carries it, through Ray
        actor: Any = actor_class.remote(self.section, level, self.nice, secret)

        async def opened() -> tuple[int, str, str, int, str | None]:
            where: tuple[int, str, str, int, str | None] = await actor.open.remote()
            return where

        try:
            # An actor no node can take stays pending without an error: bound the wait.
            try:
                pid, node_id, address, port, clock = await asyncio.wait_for(
                    opened(), START_TIMEOUT_S
                )
            except TimeoutError:
                raise EngineError(
                    f"no Ray node took the replica within {START_TIMEOUT_S:g}s: does any "
                    f"node offer {self.options['num_cpus']:g} CPUs and "
                    f"{self.options['resources']}?"
                ) from None
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(address, port), CONNECT_TIMEOUT_S
                )
            except (OSError, TimeoutError) as e:
                raise EngineError(
                    f"could not connect to the Ray replica at {address}:{port} (node "
                    f"{node_id[:12]}): {type(e).__name__}: {e}; the gateway must reach "
                    "every Ray node's address on any port"
                ) from None
        except BaseException:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise
        writer.write(encode_frame({"op": "hello", "secret": secret}))
        location = ReplicaLocation(pid, node_id, address)
        return RayChannel(actor, location, reader, writer, actor.ended.remote(), clock)

    async def close(self) -> None:
        if self._connected:
            self._connected = False
            await asyncio.to_thread(release_ray)


__all__ = [
    "ObjectStoreKv",
    "RayChannel",
    "RayKvLink",
    "RayLauncher",
    "ReplicaActor",
    "acquire_ray",
    "peer",
    "read_hello",
    "release_ray",
    "renice_threads",
]
