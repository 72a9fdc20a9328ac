"""Replica pools: Ray replicas that several gateways share, ``pool = "NAME"``.

A deployment placed on Ray that names a pool does not start replicas of its own. Its
replica ``i`` is the Ray actor named ``NAME/i`` in the namespace
:data:`POOL_NAMESPACE`, *detached*: it belongs to the cluster, not to the gateway
that created it. Every gateway (or Ray Serve cell) configured with the same pool
attaches to the same actors, so N gateways hold one copy of the model, not N, and a
conversation continued through another gateway meets the same engines.

* **Created once, race-free.** The first gateway to need ``NAME/i`` creates it
  (Ray's ``get_if_exists``: of gateways racing, one creates and the others get it);
  the actor loads its engine once, on the first attach.
* **Attached per gateway.** Each gateway calls :meth:`PoolActor.attach` with its
  deployment's section: a gateway whose replica keys differ from the actor's (another
  model, other slots...) is refused with the keys named, not served a different model.
  The answer says where to connect and carries a one-time ticket, the ``hello`` of
  one connection (as a single gateway's Ray replica takes a secret in its
  constructor, :mod:`tokenmill.replicas.rayactor`; anyone who can call the actor is on
  the cluster already). The replica then serves every connection at once, enforcing
  its own slot count (:mod:`tokenmill.replicas.shared`).
* **Gateways come and go; the pool stays.** A gateway closing detaches (its
  connection closes, its requests end); the actors keep running for the others and
  for the next gateway. Only ``tokenmill pool stop NAME`` (:func:`stop_pool`) removes
  them, or the cluster ending (with a private local Ray instance, that is the gateway
  that started it exiting: share a pool through a real cluster, ``ray_address``).
* **A replica that dies is seen by all.** Each attached gateway's connection ends
  (or Ray fails its pending ``ended`` call), so each one's
  :class:`~tokenmill.replicas.supervisor.SupervisedHost` launches again: the first to
  get there creates a new actor under the name, the others attach to it. A gateway
  that finds the dead actor still registered under the name retries shortly.
  A replica found wedged (its probe) or that fails to load is killed by the gateway
  that found it, which is every gateway's view too.

This module imports ``ray``: it is loaded only for a deployment with a pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from tokenmill import stages
from tokenmill.config import ReplicatedDeployment
from tokenmill.engines import Engine
from tokenmill.errors import EngineError
from tokenmill.replicas.host import ReplicaLocation
from tokenmill.replicas.rayactor import (
    CONNECT_TIMEOUT_S,
    ObjectStoreKv,
    RayChannel,
    acquire_ray,
    peer,
    read_hello,
    release_ray,
    renice_threads,
)
from tokenmill.replicas.shared import SharedReplica
from tokenmill.replicas.supervisor import START_TIMEOUT_S
from tokenmill.replicas.wire import encode_frame

log = logging.getLogger("tokenmill.replicas.pool")

# Pools' actors live in this Ray namespace, whatever namespace a gateway joins with.
POOL_NAMESPACE = "tokenmill-pools"
# A deployment section's keys that are each gateway's own business, not the replica's:
# gateways of one pool may differ in them (the rest must match).
GATEWAY_KEYS = frozenset(
    {
        "id",
        "endpoint_type",
        "max_queue",
        "queue_timeout_s",
        "idle_unload_s",
        "price",
        "replicas",
        "health_check_interval_s",
        "health_check_timeout_s",
        # Where this gateway would cache converted weights: the pool's replicas use
        # the cache of the gateway that started them.
        "weights_dir",
    }
)
# A ticket not used for a connection within this long is void.
TICKET_TTL_S = 60.0
# A dead actor may stay registered under its name for a moment after its connections
# end: attaching to it is retried this many times, this far apart.
ATTACH_TRIES = 10
ATTACH_RETRY_S = 0.5


def actor_name(pool: str, index: int) -> str:
    """Replica ``index`` of ``pool``: its actor's name (a pool name has no ``/``)."""
    return f"{pool}/{index}"


def scaler_name(pool: str) -> str:
    """The pool's autoscaler actor (tokenmill.gateway.poolscale), beside its replicas."""
    return f"{pool}/autoscale"


def replica_keys(section: dict[str, Any]) -> dict[str, Any]:
    """What a pool's replica is, of a deployment's section: all but the gateway's keys."""
    return {k: v for k, v in section.items() if k not in GATEWAY_KEYS}


class PoolActor(ObjectStoreKv):
    """A pool's replica on Ray: one engine (a :class:`SharedReplica`) for every gateway
    that attaches. See the module docstring."""

    def _kv_engine(self) -> Engine | None:
        return self.replica.engine

    def __init__(self, section: dict[str, Any], log_level: str, nice: int) -> None:
        logging.basicConfig(
            level=log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s[pool replica]: %(message)s",
        )
        renice_threads(nice)  # before the engine starts a thread: they inherit it
        self.section = section
        self.replica = SharedReplica(section)
        self._listener: asyncio.Server | None = None
        self._address = ""
        # Tickets handed out and not used yet, and when; each one's connection's end.
        self._tickets: dict[str, float] = {}
        self._ends: dict[str, asyncio.Future[int]] = {}

    async def attach(
        self, section: dict[str, Any]
    ) -> tuple[int, str, str, int, str | None, str, str]:
        """A gateway attaching with its deployment's ``section``: where to connect (pid,
        node id, address, port, the host's clock, this actor's id) and a ticket for one
        connection. Raises ValueError, naming the keys, when ``section`` describes
        another replica than this one."""
        mine, theirs = replica_keys(self.section), replica_keys(section)
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if differ:
            raise ValueError(
                f"its replicas run another configuration ({', '.join(differ)} differ from "
                "this gateway's deployment): give every gateway of a pool the same replica "
                "keys, or stop the pool (tokenmill pool stop) so that it starts afresh"
            )
        if self._listener is None:
            self._address = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
            self._listener = await asyncio.start_server(self._connected, self._address, 0)
            self.replica.start()  # loads the engine; connections wait for it
        now = time.monotonic()
        for old, at in list(self._tickets.items()):
            if now - at > TICKET_TTL_S:  # never used: its connection will not come
                del self._tickets[old]
                self._end(old)
        ticket = secrets.token_hex(32)
        self._tickets[ticket] = now
        self._ends[ticket] = asyncio.get_running_loop().create_future()
        port = int(self._listener.sockets[0].getsockname()[1])
        context = ray.get_runtime_context()
        actor_id = context.get_actor_id() or ""
        where = (os.getpid(), context.get_node_id(), self._address, port, stages.clock_id())
        return (*where, actor_id, ticket)

    async def ended(self, ticket: str) -> int:
        """Returns once the connection of ``ticket`` has ended: a gateway keeps this
        call pending while attached, and Ray fails it when the actor dies."""
        end = self._ends.get(ticket)
        if end is None:
            return 0
        return await asyncio.shield(end)

    def _end(self, ticket: str) -> None:
        end = self._ends.pop(ticket, None)
        if end is not None and not end.done():
            end.set_result(0)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        presented = await read_hello(reader)
        ticket = next(
            (
                t
                for t in self._tickets
                if presented is not None and hmac.compare_digest(t.encode(), presented.encode())
            ),
            None,
        )
        if ticket is None:
            log.warning("closed a connection from %s: no ticket of this replica's", peer(writer))
            writer.close()
            return
        del self._tickets[ticket]  # one connection per ticket
        try:
            await self.replica.serve(reader, writer)
        finally:
            self._end(ticket)


class PoolChannel(RayChannel):
    """This gateway's connection to a pool's actor. Detaching closes the connection
    and leaves the actor serving; ``kill`` (a replica that fails or hangs) ends it for
    every gateway, as it already is for them."""

    def __init__(self, *args: Any, label: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._label = label

    @property
    def name(self) -> str:
        where = self.location()
        node = (where.node_id or "")[:12]
        return f"pool replica {self._label} (pid {where.pid} on node {where.node_address} {node})"

    def detach(self) -> None:
        self._ended("detached from the pool's replica")
        self.close_socket()


class PoolLauncher:
    """Attaches to replica ``index`` of a deployment's pool, creating it when absent."""

    kind = "ray"

    def __init__(
        self, config: ReplicatedDeployment, index: int, address: str | None = None
    ) -> None:
        if config.pool is None:
            raise ValueError("PoolLauncher needs a deployment with a pool")
        self.pool = config.pool
        self.name = actor_name(config.pool, index)
        self.section = config.model_dump(mode="json")
        self.address = address
        self.nice = config.replica_nice
        self.options: dict[str, Any] = {
            "name": self.name,
            "namespace": POOL_NAMESPACE,
            "lifetime": "detached",  # the cluster's, not this gateway's
            "get_if_exists": True,
            "num_cpus": config.ray_cpus(),
            "resources": dict(config.ray_resources),
            "max_restarts": 0,  # the gateways recreate it (see the module docstring)
            "max_task_retries": 0,
        }
        self._connected = False

    def _actor(self) -> Any:
        """The pool's actor of this name, created if there is none (blocking)."""
        actor_class: Any = ray.remote(PoolActor).options(**self.options)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        return actor_class.remote(self.section, level, self.nice)

    async def launch(self) -> PoolChannel:
        if not self._connected:
            await asyncio.to_thread(acquire_ray, self.address)
            self._connected = True
        actor, where = await self._attach()
        pid, node_id, address, port, clock, actor_id, ticket = where
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(address, port), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError) as e:
            raise EngineError(
                f"could not connect to pool replica {self.name} at {address}:{port}: "
                f"{type(e).__name__}: {e}; the gateway must reach every Ray node's address "
                "on any port"
            ) from None
        writer.write(encode_frame({"op": "hello", "secret": ticket}))
        location = ReplicaLocation(pid, node_id, address, actor_id)
        ended = actor.ended.remote(ticket)
        return PoolChannel(actor, location, reader, writer, ended, clock, label=self.name)

    async def _attach(self) -> tuple[Any, tuple[int, str, str, int, str | None, str, str]]:
        for attempt in range(1, ATTACH_TRIES + 1):
            actor = await asyncio.to_thread(self._actor)
            try:
                # An actor no node can take stays pending without an error: bound the wait.
                where: tuple[int, str, str, int, str | None, str, str] = await asyncio.wait_for(
                    actor.attach.remote(self.section), START_TIMEOUT_S
                )
                return actor, where
            except TimeoutError:
                raise EngineError(
                    f"pool replica {self.name} was not placed within {START_TIMEOUT_S:g}s: "
                    f"does any node offer {self.options['num_cpus']:g} CPUs and "
                    f"{self.options['resources']}?"
                ) from None
            except RayTaskError as e:  # it refused this gateway's configuration
                cause = e.cause if e.cause is not None else e
                raise EngineError(f"pool {self.pool!r} (actor {self.name}): {cause}") from None
            except RayActorError as e:  # a dead actor still under the name
                if attempt == ATTACH_TRIES:
                    raise EngineError(
                        f"pool replica {self.name} died on attach {ATTACH_TRIES} times: "
                        f"{type(e).__name__}"
                    ) from None
                log.info("pool replica %s is dead; attaching again", self.name)
                await asyncio.sleep(ATTACH_RETRY_S)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        if self._connected:
            self._connected = False
            await asyncio.to_thread(release_ray)


def pool_actors(pool: str | None = None) -> dict[str, list[str]]:
    """The pools on the connected cluster and their replicas' actor names (blocking)."""
    found: dict[str, list[str]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if not isinstance(entry, dict) or entry.get("namespace") != POOL_NAMESPACE:
            continue
        name = str(entry["name"])
        owner, _, index = name.rpartition("/")
        if index.isdigit() and (pool is None or owner == pool):
            found.setdefault(owner, []).append(name)
    return {p: sorted(names, key=lambda n: int(n.rpartition("/")[2])) for p, names in found.items()}


def stop_pool(pool: str) -> list[str]:
    """Kill every replica of ``pool`` on the connected cluster (blocking): the names
    killed. Gateways attached to it see their replicas die and create new ones, so
    stop them (or reconfigure them) first."""
    names = pool_actors(pool).get(pool, [])
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=POOL_NAMESPACE)
        except ValueError:
            continue  # gone meanwhile
        ray.kill(actor, no_restart=True)
    with contextlib.suppress(ValueError):  # its autoscaler, if it has one
        ray.kill(ray.get_actor(scaler_name(pool), namespace=POOL_NAMESPACE), no_restart=True)
    return names


__all__ = [
    "POOL_NAMESPACE",
    "PoolActor",
    "PoolChannel",
    "PoolLauncher",
    "actor_name",
    "pool_actors",
    "replica_keys",
    "scaler_name",
    "stop_pool",
]
