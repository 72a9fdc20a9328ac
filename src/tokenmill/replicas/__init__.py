"""Replica hosting: where a deployment's engines run, and how the gateway reaches them.

A layer between the gateway's request path and the engines. The gateway
(:mod:`tokenmill.gateway.replicaset`) drives every replica through one interface,
:class:`~tokenmill.replicas.host.ReplicaHost`, and builds them with
:func:`~tokenmill.replicas.placement.build_host`; this package imports the engines
and never the gateway or the server.

The modules, one job each:

* ``host``: the :class:`ReplicaHost` interface, its states and location;
* ``local``: :class:`LocalHost`, the engine in the gateway's own process;
* ``placement``: a deployment's config to its replicas' hosts;
* ``supervisor``: :class:`SupervisedHost`, a replica elsewhere: launched, probed,
  restarted when it dies or hangs;
* ``client``: :class:`ReplicaClient`, requests to one launched replica as frames,
  multiplexed by id, and its answers back to streams and calls;
* ``wire``: the frames (length-prefixed JSON) both sides speak;
* ``runner``: the replica side, an engine served over the frames; the child
  process's ``main`` (``python -m tokenmill.replicas.runner``);
* ``process``: a replica in a child process, over a socket pair;
* ``rayactor``: a replica in a Ray actor, and the gateway's Ray connection;
* ``pool``, ``shared``, ``slotbook``: a pool's replicas, named Ray actors shared by
  gateways, each keeping its own slot count; ``pool_cli``: ``tokenmill pool``.

Importing this package imports no engine backend, no Ray and no torch: the modules
that need them (``rayactor``, ``pool``) are imported by name where they are used.
"""

from __future__ import annotations

from tokenmill.replicas.host import ADMITTING, ReplicaHost, ReplicaState
from tokenmill.replicas.placement import build_host

__all__ = [
    "ADMITTING",
    "ReplicaHost",
    "ReplicaState",
    "build_host",
]
