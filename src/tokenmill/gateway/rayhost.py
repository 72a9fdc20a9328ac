"""Ray replicas: an engine in a Ray actor on any node of a cluster, ``placement = "ray"``.

The gateway keeps supervising, exactly as for a child process: admission, the credit
hold, the stream, cancellation and settlement stay in the gateway, and the replica
runs the same loop (:func:`tokenmill.gateway.runner.serve`) over Ray instead of a
socket. A :class:`RayLauncher` creates one :class:`ReplicaActor` per replica; the
:class:`~tokenmill.gateway.supervised.SupervisedHost` around it restarts it when it
dies (a new actor, which Ray places on any node with the resources: a surviving one
when its node is gone).

Frames, as :mod:`tokenmill.gateway.wire` defines them: gateway -> actor, ``send``
calls (fire-and-forget: a dead actor shows as the end of the other direction), one
per event-loop pass carrying every frame the gateway queued in it; actor -> gateway,
one long-lived streaming call, ``frames``, whose every item is a list of frames: one
Ray object per decode step carrying the step's chunks for all its streams (never one
per token, never on a timer), or several steps' when the actor's loop found them
already queued. The gateway reads that stream on a thread of its own, which hands
each item to the event loop in one callback: awaiting each object ref on the event
loop cost the loop 0.35-0.65 ms of CPU a frame, the callback 0.13-0.15 ms (and the
whole process about 0.4 ms a frame less; 16-chunk frames at 100 a second).

``ray_address`` (a setting, ``--ray-address``, ``TOKENMILL_RAY_ADDRESS``) names the
cluster; ``"local"`` or nothing starts a private Ray instance on this machine, stopped
when the last Ray replica closes. A deployment's ``ray_num_cpus`` and ``ray_resources``
say where its replicas may run. Workers need tokenmill installed (and the model file at
the same path, or the embedded model's package). This module imports ``ray``: it is
loaded only for a deployment placed on Ray, never by ``import tokenmill``.
"""

from __future__ import annotations

import asyncio
import collections
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
# How long a channel's reader thread waits for the next frame before it looks whether
# the channel was killed (an actor that dies ends the wait at once, with Ray's error):
# what ``wait`` takes at most, after ``kill``, to see the thread gone.
READ_POLL_S = 0.1


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
        # overtaken by the abort after it): calls are numbered and applied in order.
        self._next = 0
        self._early: dict[int, list[dict[str, Any]]] = {}

    def where(self) -> tuple[int, str, str]:
        context = ray.get_runtime_context()
        address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return os.getpid(), context.get_node_id(), address

    async def send(self, number: int, messages: list[dict[str, Any]]) -> None:
        self._early[number] = messages
        while self._next in self._early:  # no await in here: nothing interleaves
            for message in self._early.pop(self._next):
                self.inbox.put_nowait(message)
            self._next += 1

    async def frames(self) -> AsyncIterator[list[dict[str, Any]]]:
        from tokenmill.gateway.runner import serve

        out = _FrameQueue(asyncio.get_running_loop())
        task = asyncio.create_task(serve(self.inbox.get, out, self.section))
        task.add_done_callback(lambda _: out.end())
        queue = out.queue
        while True:
            # One Ray object per item: the frame that woke us, and whatever else the
            # decode thread had already queued behind it (never waiting for more).
            frame = await queue.get()
            batch: list[dict[str, Any]] = []
            while frame is not None:
                batch.append(frame)
                if queue.empty():
                    break
                frame = queue.get_nowait()
            if batch:
                yield batch
            if frame is None:
                break
        await task


class RayChannel:
    """One replica actor: ``send`` calls one way, the ``frames`` stream the other.

    A reader thread takes the stream's items as they come (a blocking wait on the
    next object, then ``ray.get``) and hands each to the event loop in one
    ``call_soon_threadsafe``; ``receive`` pops them in order. The thread ends with the
    stream (the actor ended or died: Ray ends the wait with an error) or, at the
    latest ``READ_POLL_S`` after it, once the channel is killed; ``wait`` returns only
    once it has, so nothing reads from Ray after the last launcher disconnects it.
    """

    def __init__(self, actor: Any, where: tuple[int, str, str]) -> None:
        self.actor = actor
        self.pid, self.node_id, self.node_address = where
        self._loop = asyncio.get_running_loop()
        self._inbox: collections.deque[dict[str, Any]] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None  # receive(), waiting
        self._outbox: list[dict[str, Any]] = []  # frames for the next send call
        self._sent = 0  # send calls made: their numbers
        self._gone = asyncio.Event()  # no frame comes any more
        self._read = asyncio.Event()  # the reader thread has ended
        self._stop = threading.Event()  # killed: the reader thread stops waiting
        self._how = "the actor ended"
        frames = actor.frames.remote()  # an async generator: a streaming call
        self._reader = threading.Thread(
            target=self._read_frames,
            args=(frames,),
            name=f"tokenmill-ray-reader-{self.pid}",
            daemon=True,
        )
        self._reader.start()

    @property
    def name(self) -> str:
        return f"ray replica (pid {self.pid} on node {self.node_address} {self.node_id[:12]})"

    def location(self) -> ReplicaLocation:
        return ReplicaLocation(self.pid, self.node_id, self.node_address)

    def send(self, message: dict[str, Any]) -> None:
        if self._gone.is_set():
            raise EngineError("the replica is gone; retry the request")
        # Every frame queued in this pass of the event loop leaves in one call (a burst
        # of requests: their prepare, then their generate frames): a Ray call costs
        # the loop far more than a frame.
        self._outbox.append(message)
        if len(self._outbox) == 1:
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        messages, self._outbox = self._outbox, []
        if messages and not self._gone.is_set():
            self.actor.send.remote(self._sent, messages)
            self._sent += 1

    async def receive(self) -> dict[str, Any] | None:
        # Frames that came before the stream ended are still read (a "fatal" frame,
        # an error); a killed channel dropped them.
        while not self._inbox:
            if self._gone.is_set():
                return None
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._inbox.popleft()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- the reader thread, and its callbacks on the event loop ---------------------------

    def _read_frames(self, frames: Any) -> None:
        how = "the actor ended"
        try:
            while not self._stop.is_set():
                # A nil ref: nothing within READ_POLL_S. StopIteration: the stream ended.
                ref = frames._next_sync(READ_POLL_S)
                if ref.is_nil():
                    continue
                batch: list[dict[str, Any]] = ray.get(ref)
                self._loop.call_soon_threadsafe(self._arrived, batch)
        except StopIteration:
            pass
        except RayError as e:
            how = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        except Exception as e:  # Ray itself failing here must still end the channel
            how = f"reading its frames failed: {type(e).__name__}: {e}"
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self._loop.call_soon_threadsafe(self._read_ended, how)

    def _arrived(self, batch: list[dict[str, Any]]) -> None:
        if not self._gone.is_set():
            self._inbox.extend(batch)
            self._wake()

    def _read_ended(self, how: str) -> None:
        self._end(how)
        self._read.set()

    def _end(self, how: str) -> None:
        if not self._gone.is_set():
            self._how = how
            self._gone.set()
            self._wake()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self._stop.set()
        self._outbox.clear()
        self._inbox.clear()
        self._end("killed by the gateway")

    async def wait(self) -> str:
        await self._gone.wait()
        await self._read.wait()
        # Its last act was to schedule _read_ended: it is returning, with nothing left
        # that could block, so this join lasts until it is next scheduled at most.
        self._reader.join()
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
