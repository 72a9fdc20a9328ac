"""``tokenmill pool list|stop``: a cluster's replica pools, from the shell.

A pool's replicas outlive every gateway (:mod:`tokenmill.replicas.pool`), so removing
them is an operator's act: ``tokenmill pool stop NAME`` kills them on the cluster of
``--ray-address`` (default ``$TOKENMILL_RAY_ADDRESS``, else ``auto``: the cluster this
machine's ``ray start`` joined). Ray is imported only when a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _ray_address(args: argparse.Namespace) -> str:
    address: str = args.ray_address or os.environ.get("TOKENMILL_RAY_ADDRESS") or "auto"
    return address


def _connected(args: argparse.Namespace) -> str | None:
    """Join the cluster; an error message when it cannot be (or is a private one)."""
    address = _ray_address(args)
    if address == "local":
        return "a private local Ray instance holds no pool of other gateways: name the cluster"
    from tokenmill.replicas.rayactor import acquire_ray

    try:
        acquire_ray(address)
    except Exception as e:
        return f"cannot join the Ray cluster at {address!r}: {e}"
    return None


def _list(args: argparse.Namespace) -> int:
    if (error := _connected(args)) is not None:
        print(f"tokenmill: {error}", file=sys.stderr)
        return 1
    from tokenmill.replicas.pool import pool_actors
    from tokenmill.replicas.rayactor import release_ray

    try:
        print(json.dumps(pool_actors(), indent=2))
    finally:
        release_ray()
    return 0


def _stop(args: argparse.Namespace) -> int:
    if (error := _connected(args)) is not None:
        print(f"tokenmill: {error}", file=sys.stderr)
        return 1
    from tokenmill.replicas.pool import stop_pool
    from tokenmill.replicas.rayactor import release_ray

    try:
        stopped = stop_pool(args.name)
    finally:
        release_ray()
    if not stopped:
        print(f"tokenmill: no pool named {args.name!r} on this cluster", file=sys.stderr)
        return 1
    print(f"stopped {len(stopped)} replica(s) of pool {args.name!r}: {', '.join(stopped)}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--ray-address",
        help="the cluster (default $TOKENMILL_RAY_ADDRESS, else auto: this machine's)",
    )
    pool = sub.add_parser("pool", help="replica pools that gateways share on a Ray cluster")
    commands = pool.add_subparsers(dest="pool_command", required=True)
    listing = commands.add_parser("list", parents=[common], help="pools and their replicas")
    listing.set_defaults(func=_list)
    stop = commands.add_parser(
        "stop", parents=[common], help="kill a pool's replicas (gateways attached lose them)"
    )
    stop.add_argument("name", help="the pool's name (a deployment's pool key)")
    stop.set_defaults(func=_stop)
