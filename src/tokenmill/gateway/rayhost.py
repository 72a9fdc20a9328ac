"""Ray replicas: an engine in a Ray actor on any node of a cluster, ``placement = "ray"``.

The gateway keeps supervising, exactly as for a child process: admission, the credit
hold, the stream, cancellation and settlement stay in the gateway, and the replica
runs the same loop (:func:`tokenmill.gateway.runner.serve`) over Ray instead of a
socket. A :class:`RayLauncher` creates one :class:`ReplicaActor` per replica; the
:class:`~tokenmill.gateway.supervised.SupervisedHost` around it restarts it when it
dies (a new actor, which Ray places on any node with the resources: a surviving one
when its node is gone).

Frames, as :mod:`tokenmill.gateway.wire` defines them: gateway -> actor, one
``send`` call each (fire-and-forget: a dead actor shows as the end of the other
direction); actor -> gateway, one long-lived streaming call, ``frames``, whose every
item is one frame: one Ray object per decode step carrying the step's chunks for all
its streams (never one per token, never on a timer).

``ray_address`` (a setting, ``--ray-address``, ``TOKENMILL_RAY_ADDRESS``) names the
cluster; ``"local"`` or nothing starts a private Ray instance on this machine, stopped
when the last Ray replica closes. A deployment's ``ray_num_cpus`` and ``ray_resources``
say where its replicas may run. Workers need tokenmill installed (and the model file at
the same path, or the embedded model's package). This module imports ``ray``: it is
loaded only for a deployment placed on Ray, never by ``import tokenmill``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import RayError

from tokenmill.config import ReplicatedDeployment
from tokenmill.errors import EngineError
from tokenmill.gateway.hosts import ReplicaLocation
from tokenmill.gateway.supervised import START_TIMEOUT_S

log = logging.getLogger("tokenmill.gateway.ray")

_init_lock = threading.Lock()
_users = 0  # launchers using this process's Ray connection
# Whether this module connected it (and so may disconnect it): inside a Ray worker (a
# gateway cell on Ray Serve) the connection is the worker's own and must stay.
_owned = False
# A private local instance notices a dead node (a killed raylet) within about a second,
# so its replicas' streams end well within 2 s; Ray's defaults take several seconds.
LOCAL_SYSTEM_CONFIG = {
    "health_check_period_ms": 300,
    "health_check_timeout_ms": 300,
    "health_check_failure_threshold": 3,
}


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


class _FrameQueue:
    """The actor's outgoing frames: ``send`` from any thread, read by ``frames``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def send(self, message: dict[str, Any]) -> None:
        # Through the loop even from its own thread: frames keep one order.
        with contextlib.suppress(RuntimeError):  # the loop is gone: the actor is ending
            self._loop.call_soon_threadsafe(self.queue.put_nowait, message)

    def end(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.queue.put_nowait, None)


class ReplicaActor:
    """The replica side on Ray: :func:`tokenmill.gateway.runner.serve` in an actor."""

    def __init__(self, section: dict[str, Any], log_level: str, nice: int) -> None:
        if nice:
            os.nice(nice)  # before the engine starts a thread: they inherit it
        logging.basicConfig(
            level=log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s[ray replica]: %(message)s",
        )
        self.section = section
        self.inbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        # Ray runs an async actor's calls out of order (a big prompt's frame can be
        # overtaken by the abort after it): frames are numbered and applied in order.
        self._next = 0
        self._early: dict[int, dict[str, Any]] = {}

    def where(self) -> tuple[int, str, str]:
        context = ray.get_runtime_context()
        address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return os.getpid(), context.get_node_id(), address

    async def send(self, number: int, message: dict[str, Any]) -> None:
        self._early[number] = message
        while self._next in self._early:  # no await in here: nothing interleaves
            self.inbox.put_nowait(self._early.pop(self._next))
            self._next += 1

    async def frames(self) -> AsyncIterator[dict[str, Any]]:
        from tokenmill.gateway.runner import serve

        out = _FrameQueue(asyncio.get_running_loop())
        task = asyncio.create_task(serve(self.inbox.get, out, self.section))
        task.add_done_callback(lambda _: out.end())
        while (frame := await out.queue.get()) is not None:
            yield frame
        await task


class RayChannel:
    """One replica actor: ``send`` calls one way, the ``frames`` stream the other."""

    def __init__(self, actor: Any, where: tuple[int, str, str]) -> None:
        self.actor = actor
        self.pid, self.node_id, self.node_address = where
        self._frames = actor.frames.remote()  # an async generator: a streaming call
        self._sent = 0
        self._gone = asyncio.Event()
        self._how = "the actor ended"

    @property
    def name(self) -> str:
        return f"ray replica (pid {self.pid} on node {self.node_address} {self.node_id[:12]})"

    def location(self) -> ReplicaLocation:
        return ReplicaLocation(self.pid, self.node_id, self.node_address)

    def send(self, message: dict[str, Any]) -> None:
        if self._gone.is_set():
            raise EngineError("the replica is gone; retry the request")
        self.actor.send.remote(self._sent, message)
        self._sent += 1

    async def receive(self) -> dict[str, Any] | None:
        if self._gone.is_set():
            return None
        try:
            ref = await self._frames.__anext__()
            frame: dict[str, Any] = await ref
            return frame
        except StopAsyncIteration:
            self._end("the actor ended")
        except RayError as e:
            self._end(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return None

    def _end(self, how: str) -> None:
        if not self._gone.is_set():
            self._how = how
            self._gone.set()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self._end("killed by the gateway")

    async def wait(self) -> str:
        await self._gone.wait()
        return self._how


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
        self._connected = False

    async def launch(self) -> RayChannel:
        if not self._connected:
            await asyncio.to_thread(acquire_ray, self.address)
            self._connected = True
        actor_class: Any = ray.remote(ReplicaActor).options(**self.options)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        actor: Any = actor_class.remote(self.section, level, self.nice)

        async def placed() -> tuple[int, str, str]:
            where: tuple[int, str, str] = await actor.where.remote()
            return where

        try:
            # An actor no node can take stays pending without an error: bound the wait.
            where = await asyncio.wait_for(placed(), START_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise EngineError(
                f"no Ray node took the replica within {START_TIMEOUT_S:g}s: does any node "
                f"offer {self.options['num_cpus']:g} CPUs and {self.options['resources']}?"
            ) from None
        except BaseException:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise
        return RayChannel(actor, where)

    async def close(self) -> None:
        if self._connected:
            self._connected = False
            await asyncio.to_thread(release_ray)


__all__ = ["RayChannel", "RayLauncher", "ReplicaActor", "acquire_ray", "release_ray"]
