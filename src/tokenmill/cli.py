"""The ``tokenmill`` command. Each subcommand imports what it needs when it runs."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from tokenmill.config import (
    DEFAULT_DEPLOYMENT_ID,
    ConfigError,
    LlamaCppDeployment,
    Settings,
    load_settings,
)

Command = Callable[[argparse.Namespace], int]


def settings_from_args(args: argparse.Namespace) -> Settings:
    """``tokenmill serve``'s settings: its flags over ``TOKENMILL_*`` over ``--config``."""
    overrides = {
        "host": args.host,
        "port": args.port,
        "data_dir": args.data_dir,
        "ledger": getattr(args, "ledger", None),
        "log_level": args.log_level,
        "ray_address": getattr(args, "ray_address", None),
    }
    settings = load_settings(args.config, overrides)
    # The one model's KV knobs (--n-ctx, --max-num-seqs, --kv-layout, --kv-host-bytes,
    # --kv-disk-dir).
    sizes = {
        key: value
        for key in ("n_ctx", "max_num_seqs", "kv_layout", "kv_host_bytes", "kv_disk_dir")
        if (value := getattr(args, key, None)) is not None
    }
    if args.model is not None:
        if settings.deployments:
            raise ConfigError("--model serves one model; do not combine it with --config")
        if not args.model.is_file():
            raise ConfigError(f"--model: file not found: {args.model}")
        dep = LlamaCppDeployment(id=args.name or args.model.stem, model=args.model)
        settings = settings.model_copy(update={"deployments": [dep]})
    elif sizes and settings.deployments:
        raise ConfigError(
            "--n-ctx, --max-num-seqs, --kv-layout, --kv-host-bytes and --kv-disk-dir size "
            "the one model of the command line; with --config set them in its "
            "[[deployments]] tables"
        )
    settings = settings.with_default_deployment()
    if sizes:
        (only,) = settings.deployments
        try:
            sized = LlamaCppDeployment.model_validate({**only.model_dump(), **sizes})
        except ValidationError as e:
            flags = ", ".join(f"--{k.replace('_', '-')}" for k in sizes)
            raise ConfigError(f"{flags}: {e.errors()[0]['msg']}") from None
        settings = settings.model_copy(update={"deployments": [sized]})
    return settings


def _serve(args: argparse.Namespace) -> int:
    from tokenmill.server.app import create_app
    from tokenmill.server.listener import serve

    try:
        settings = settings_from_args(args)
    except ConfigError as e:
        print(f"tokenmill: {e}", file=sys.stderr)
        return 2
    if args.ray_serve:
        try:
            settings = settings.for_cells(args.cells)
        except ConfigError as e:
            print(f"tokenmill: {e}", file=sys.stderr)
            return 2
    elif args.cells is not None:
        print("tokenmill: --cells needs --ray-serve", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.ray_serve:
        from tokenmill.server import cells  # imports ray.serve: only here

        return cells.run(settings)
    app = create_app(settings)
    print(f"tokenmill serving on http://{settings.host}:{settings.port}", flush=True)
    serve(app, settings, app.state.gateway)
    if "ray" in sys.modules:
        _exit_past_ray()
    return 0


def _exit_past_ray() -> None:
    """Leave the process without the interpreter's teardown once the gateway has shut
    down in order (streams drained, bills settled, the ledger closed, Ray released).

    Ray's C++ core worker tears itself down in the interpreter's exit handlers, and
    after Ray has marked a node dead under load that teardown has aborted the process
    (SIGABRT, exit -6, on SIGTERM: issue 46), turning a clean shutdown into a crash
    for whatever supervises the gateway. Nothing of tokenmill's is left to run there.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill", description="Serve LLMs with token streaming, and meter every token."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the gateway")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--config", type=Path, help="a tokenmill.toml file")
    serve.add_argument("--data-dir", type=Path, help="where the ledger and state live")
    serve.add_argument(
        "--ledger", help="postgresql://... to share the books between gateways (default: SQLite)"
    )
    serve.add_argument("--model", type=Path, help="serve this GGUF file instead of the default")
    serve.add_argument(
        "--name", help=f"deployment id for --model (default: file stem; '{DEFAULT_DEPLOYMENT_ID}')"
    )
    serve.add_argument(
        "--n-ctx",
        type=int,
        help="tokens one sequence may hold (default 0: the model's trained context; 2048 "
        "a slot with --kv-layout per_slot)",
    )
    serve.add_argument("--max-num-seqs", type=int, help="sequences a replica runs at once (16)")
    serve.add_argument(
        "--kv-layout",
        choices=["shared", "per_slot"],
        help="shared: the slots draw on one KV pool (default); per_slot: a KV stream a "
        "slot, greedy answers the same alone or batched",
    )
    serve.add_argument(
        "--kv-host-bytes",
        type=int,
        help="host memory for parked KV sequences, in bytes (default: a quarter of the "
        "memory available, at most 8 GiB; 0: none)",
    )
    serve.add_argument(
        "--kv-disk-dir",
        help="a directory where parked KV sequences are also written, so that a replica "
        'restarted or killed finds them again (default: <data dir>/kv/<model>; "": none)',
    )
    serve.add_argument("--log-level", default=None, help="debug, info, warning")
    serve.add_argument(
        "--ray-address",
        help='the Ray cluster of placement = "ray" deployments: "auto", "ray://head:10001", '
        'or "local" (default: a private local instance)',
    )
    serve.add_argument(
        "--ray-serve",
        action="store_true",
        help="run gateway cells as a Ray Serve application behind Serve's HTTP proxy",
    )
    serve.add_argument(
        "--cells",
        type=int,
        help="gateway cells with --ray-serve (default: [serve] cells, 1); "
        "more than one needs a PostgreSQL ledger",
    )
    serve.set_defaults(func=_serve)

    for register in _extensions():
        register(sub)
    return parser


def _extensions() -> list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]]:
    """Subcommands defined next to the code they drive (client, ledger, pools, convert,
    bench)."""
    found = []
    for module_name in (
        "tokenmill.client.cli",
        "tokenmill.ledger.cli",
        "tokenmill.replicas.pool_cli",
        "tokenmill.engines.llamacpp.convert",
        "tokenmill.bench",
    ):
        try:
            module = __import__(module_name, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue
        found.append(module.register)
    return found


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Command = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
