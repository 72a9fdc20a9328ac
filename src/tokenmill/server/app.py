"""The ASGI application: the only module that assembles the web framework.

Start-up loads the deployments in the background so ``/health`` answers 503 while
models load and 200 once every deployment is ready. Shutdown drains in a fixed
order: stop accepting, let streams finish up to a deadline, abort the rest (each
settled by its stream), then close engines and the ledger.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill import stages
from tokenmill.config import Settings
from tokenmill.errors import ResourceNotFoundError, ServiceError
from tokenmill.gateway import Gateway, new_request_id
from tokenmill.identity import ANONYMOUS
from tokenmill.ledger import BatchStore, FileStore, LedgerMeter, ResponseStore, build_ledger
from tokenmill.metrics import CONTENT_TYPE, BudgetReading, GatewayMetrics
from tokenmill.server.admin import router as admin_router
from tokenmill.server.auth import Auth, KeyCache
from tokenmill.server.batches.router import router as batches_router
from tokenmill.server.batches.runner import BatchRunner
from tokenmill.server.deployments import router as deployments_router
from tokenmill.server.errors import (
    ANTHROPIC_TYPES,
    anthropic_body,
    error_response,
    from_validation_error,
    handle_service_error,
    handle_unexpected,
    speaks_anthropic,
)
from tokenmill.server.messages.router import router as messages_router
from tokenmill.server.openai.router import router as openai_router
from tokenmill.server.openapi import document, json_response
from tokenmill.server.protocol import Health, HealthDetail
from tokenmill.server.ratelimits import RateLimitHeaders
from tokenmill.server.responses.router import router as responses_router
from tokenmill.server.traces import TraceContext
from tokenmill.tracing import Tracing

log = logging.getLogger("tokenmill.server")

# Client-supplied request ids are echoed back and logged: keep them short and tame.
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# The web playground's static files, shipped as package data.
PLAYGROUND_DIR = Path(__file__).resolve().parent.parent / "playground"


class RequestContext:
    """Pure ASGI middleware: a request id on every response, the caller on the state."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                candidate = value.decode("latin-1")
                if _REQUEST_ID_RE.match(candidate):
                    rid = candidate
                break
        rid = rid or new_request_id()
        state = scope.setdefault("state", {})
        marks: stages.Marks = {"app": time.monotonic()}
        arrived = state.pop(stages.ARRIVED, None)
        if arrived is not None:
            marks["arrive"] = arrived
        state["request_id"] = rid
        state.setdefault("caller", ANONYMOUS)
        header = (b"x-request-id", rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                message["headers"] = [*headers, header]
            await send(message)

        token = stages.begin(marks)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            stages.end(token)


class TokenmillApp(FastAPI):
    """FastAPI, serving the OpenAPI document of :mod:`tokenmill.server.openapi`."""

    def __init__(self, settings: Settings, **kwargs: Any) -> None:
        # Operation ids are the routes' function names: short, stable, and what links use.
        super().__init__(generate_unique_id_function=lambda route: route.name, **kwargs)
        self.api_keys = settings.admin_key is not None

    def openapi(self) -> dict[str, Any]:
        if not self.openapi_schema:
            self.openapi_schema = document(self, api_keys=self.api_keys)
        return self.openapi_schema


def create_app(settings: Settings, gateway: Gateway | None = None) -> FastAPI:
    ledger = build_ledger(settings)
    meter = LedgerMeter(ledger, {d.id: d.price for d in settings.deployments})
    # A gateway handed in keeps its own meter; the ledger still serves the admin API.
    gw = gateway or Gateway(settings, meter=meter)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def load() -> None:
            try:
                await gw.start()
                log.info("ready: %s", ", ".join(gw.deployments))
            except Exception:
                log.exception("a deployment failed to start")
                app.state.load_error = True

        # The books open before any request can be admitted, and close after the last.
        await ledger.open()
        await meter.start()
        loader = asyncio.create_task(load())
        app.state.loader = loader
        runner.start()
        try:
            yield
        finally:
            loader.cancel()
            runner.stop_claiming()
            await gw.close(settings.drain_s)
            await runner.close()
            await meter.close()
            await ledger.close()
            if tracing is not None:
                tracing.close()

    app = TokenmillApp(
        settings,
        title="tokenmill",
        summary="OpenAI-compatible LLM serving with token streaming, metered per token",
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.gateway = gw
    # Per-app registry: several apps in one process never clash on the global one.
    # ``metrics = false`` leaves the observer out entirely, and /metrics 404s.
    metrics = (
        GatewayMetrics(gw, per_account=settings.metrics_per_account) if settings.metrics else None
    )
    if metrics is not None:
        gw.observers.append(metrics)
    # Off unless an OTLP endpoint is set: then one trace per request (tokenmill.tracing).
    tracing = Tracing.from_environment()
    if tracing is not None:
        gw.observers.append(tracing)
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.ledger = ledger
    app.state.key_cache = KeyCache(ledger)
    app.state.responses = responses = ResponseStore(ledger, settings.responses_retention_s)
    app.state.files = files = FileStore(ledger, settings.files_retention_s)
    app.state.batches = batches = BatchStore(ledger, files)
    app.state.batch_runner = runner = BatchRunner(
        gw, batches, ledger, responses, stale_s=meter.stale_s
    )
    app.state.load_error = False
    app.add_exception_handler(ServiceError, handle_service_error)
    app.add_exception_handler(Exception, handle_unexpected)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(
                ResourceNotFoundError(
                    f"no route {request.method} {request.url.path}", code="unknown_url"
                ),
                request.url.path,
            )
        err = ServiceError(str(exc.detail))
        if speaks_anthropic(request.url.path):
            body = anthropic_body(err)
            body["error"]["type"] = ANTHROPIC_TYPES.get(exc.status_code, "invalid_request_error")
        else:
            body = err.to_openai_body()
            body["error"]["type"] = "invalid_request_error"
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(request: Request, exc: RequestValidationError) -> JSONResponse:
        # A path or query parameter of the wrong type: the same 400 as a bad body field,
        # naming the parameter without its place ("limit", not "query.limit").
        errors = [{**e, "loc": tuple(e["loc"])[1:]} for e in exc.errors()]
        return error_response(from_validation_error(errors), request.url.path)

    @app.get(
        "/health",
        response_model=Health,
        responses={503: json_response(Health, "Loading, or a deployment failed to start")},
    )
    async def health() -> JSONResponse:
        if app.state.load_error:
            return JSONResponse({"status": "failed"}, status_code=503)
        if gw.draining:  # shutting down: a balancer should send elsewhere
            return JSONResponse({"status": "draining"}, status_code=503)
        if not gw.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/health")
    async def health_detail() -> HealthDetail:
        return HealthDetail.model_validate({"ready": gw.ready, "deployments": gw.stats()})

    if metrics is not None:

        @app.get("/metrics", include_in_schema=False)
        async def prometheus_metrics() -> Response:
            budgets = [
                BudgetReading(owner_type, owner, b.duration, b.spent, b.remaining)
                for owner_type, owner, b in await ledger.all_budget_states()
            ]
            return Response(metrics.render(budgets), media_type=CONTENT_TYPE)

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(PLAYGROUND_DIR / "index.html", headers={"cache-control": "no-cache"})

    # Assets under /playground/ only, so the playground never shadows an API path.
    app.mount("/playground", StaticFiles(directory=PLAYGROUND_DIR), name="playground")

    # One router per API (each a folder: protocol, serving, events, router).
    app.include_router(openai_router)
    app.include_router(deployments_router)
    app.include_router(responses_router)
    app.include_router(messages_router)
    app.include_router(admin_router)
    app.include_router(batches_router)
    # Innermost first: the rate-limit headers read the key that Auth names; the trace
    # context is kept under the request id that RequestContext gives.
    app.add_middleware(RateLimitHeaders, ledger=ledger)
    if tracing is not None:
        app.add_middleware(TraceContext, tracing=tracing)
    app.add_middleware(Auth, admin_key=settings.admin_key, keys=app.state.key_cache)
    app.add_middleware(RequestContext)
    return app
