"""Each GenAI request's trace context and answer, for :mod:`tokenmill.tracing`:
installed only when traces or the GenAI metrics are on.

A pure ASGI middleware inside :class:`~tokenmill.server.app.RequestContext` (which
names the request): for every ``POST`` of a GenAI route (chat, completions,
embeddings, messages, responses) it tells the observer the request came in, with the
W3C ``traceparent`` (and whatever else ``OTEL_PROPAGATORS`` names) it carries, whose
span then starts; it makes that span's trace context the request's
(:func:`tokenmill.otel.carry`: its replica is given it); and once the response is done
it tells the observer its status (and, for an error, its body), so that a request
refused before the gateway took it (a bad body) is traced too. The observer writes
the trace of one the gateway took when the gateway ends it.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill import otel
from tokenmill.tracing import Tracing, operation_of

# An error body is kept up to this many bytes (its message is in the first ones).
ERROR_BYTES = 4096


class TraceContext:
    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        operation = None
        if scope["type"] == "http" and scope["method"] == "POST":
            operation = operation_of(scope.get("path", ""))
        if operation is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        state = scope.setdefault("state", {})
        request_id: str = state["request_id"]
        incoming = self.tracing.arrived(request_id, operation, headers, state)

        async def answer(message: Message) -> None:
            if message["type"] == "http.response.start":
                incoming.status = message["status"]
            elif incoming.status >= 400 and len(incoming.error) < ERROR_BYTES:
                incoming.error += message.get("body", b"")
            await send(message)

        token = None if incoming.carried is None else otel.carry(incoming.carried)
        failure = None
        try:
            await self.app(scope, receive, answer)
        except BaseException as e:
            failure = type(e).__name__
            raise
        finally:
            if token is not None:
                otel.uncarry(token)
            self.tracing.answered(request_id, failure)
