"""Gateway cells on Ray Serve: ``tokenmill serve --ray-serve [--cells N]``.

Each cell is a whole gateway, the app of :func:`tokenmill.server.app.create_app` with
its deployments, run as one replica of a Ray Serve deployment behind Serve's HTTP
proxy. The cells share nothing but the ledger: with more than one cell it must be
PostgreSQL (:meth:`tokenmill.config.Settings.for_cells`), so keys, credit and rpm/tpm
stay exact across cells. A cell's deployments keep their own placement: by default
their replicas are child processes of the cell's actor.

The cell builds its app in its own process (``__serve_build_asgi_app__``): only the
settings, as JSON, cross to the replica; no app object is pickled. Serve runs the
app's lifespan there, and a cell joins the application only once its deployments are
loaded (or fails to start when one cannot load), so ``serve.run`` returning means
every cell serves.

This module imports ``ray.serve``: it is loaded only for ``--ray-serve``, never by
``import tokenmill``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import FrameType
from typing import Any

from fastapi import FastAPI
from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.config import Settings
from tokenmill.replicas.rayactor import acquire_ray, release_ray

log = logging.getLogger("tokenmill.server.cells")

APP_NAME = "tokenmill"
DEPLOYMENT_NAME = "cell"
# After Serve's own drain of a stopping cell (its open requests may finish for the
# gateway's drain_s), the cell's lifespan closes the gateway and the ledger.
SHUTDOWN_MARGIN_S = 10.0


class ProxyRequestId:
    """Serve's proxy adds ``x-request-id`` to every response itself: the client's, or
    one it made and put in the request, which the gateway then takes as its own. The
    gateway's copy is dropped when it is that same id, so a response carries the header
    once, as direct. (A client id the gateway refuses, such as one over 128 characters,
    leaves both: the proxy's echo of the client's and the gateway's own.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)

        async def send_once(message: Message) -> None:
            if message["type"] == "http.response.start" and given is not None:
                message["headers"] = [
                    h
                    for h in message.get("headers", [])
                    if not (h[0] == b"x-request-id" and h[1] == given)
                ]
            await send(message)

        await self.app(scope, receive, send_once)


def cell_app(settings: Settings) -> FastAPI:
    """The gateway's app, whose lifespan ends its start-up only once the deployments
    are loaded: a cell joins Serve's application ready to serve."""
    from tokenmill.server.app import create_app

    app = create_app(settings)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        context: AbstractAsyncContextManager[Any] = inner(a)
        async with context as state:
            await asyncio.shield(a.state.loader)
            if a.state.load_error:
                raise RuntimeError("a deployment of this gateway cell failed to start")
            yield state

    app.router.lifespan_context = lifespan
    app.add_middleware(ProxyRequestId)
    return app


@serve.ingress()
class GatewayCell:
    """One gateway cell: a Serve replica whose ASGI app is a whole gateway."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = Settings.model_validate(settings)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return cell_app(self.settings)


def _deployment(settings: Settings) -> Any:
    cfg = settings.serve
    return serve.deployment(
        name=DEPLOYMENT_NAME,
        num_replicas=cfg.cells,
        max_ongoing_requests=cfg.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.num_cpus},
        graceful_shutdown_timeout_s=settings.drain_s + SHUTDOWN_MARGIN_S,
    )(GatewayCell)


def run(settings: Settings) -> int:
    """Run the cells until SIGTERM or SIGINT; then take them down and return 0.

    The cluster is ``ray_address``'s (a private local instance when unset). Serve's
    proxy listens on ``[serve] port``, else the gateway's ``port``, at ``host``.
    """
    cfg = settings.serve
    port = settings.port if cfg.port is None else cfg.port
    stop = threading.Event()
    began = time.monotonic()
    # From the main thread, so Ray's own SIGTERM handler comes first and ours replaces it.
    acquire_ray(settings.ray_address)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():  # a second signal: stop waiting for anything
            raise KeyboardInterrupt
        log.info("signal %d: taking the gateway cells down", signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    started_serve = False
    try:
        started_serve = not _serve_running()
        serve.start(http_options={"host": settings.host, "port": port})
        app = _deployment(settings).bind(settings.model_dump(mode="json"))
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        log.info(
            "%d gateway cell(s) ready on Ray Serve in %.1f s", cfg.cells, time.monotonic() - began
        )
        print(
            f"tokenmill serving on http://{settings.host}:{port} "
            f"(Ray Serve, {cfg.cells} gateway cell{'s' if cfg.cells != 1 else ''})",
            flush=True,
        )
        stop.wait()
    finally:
        try:
            _take_down(started_serve)
        finally:
            release_ray()
            for s, handler in previous.items():
                signal.signal(s, handler)
    return 0


def _serve_running() -> bool:
    """Whether Serve already runs on this cluster (someone else's to keep)."""
    from ray.serve.context import _get_global_client

    return _get_global_client(raise_if_no_controller_running=False) is not None


def _take_down(started_serve: bool) -> None:
    """Delete our application; stop Serve too when we started it and nothing else runs."""
    try:
        serve.delete(APP_NAME)
    except Exception:
        log.exception("deleting the Serve application %r failed", APP_NAME)
    if started_serve and not serve.status().applications:
        serve.shutdown()  # type: ignore[no-untyped-call]
