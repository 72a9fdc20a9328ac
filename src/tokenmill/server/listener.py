"""The HTTP listener: uvicorn, with client timeouts and a draining shutdown.

uvicorn (httptools) waits forever for a request's headers and body and for a client
to read what it is sent, and it holds no limit on a request head. So each connection
here has one deadline, ``client_timeout_s``, armed when it opens (or a new request
begins) and cleared once the request has arrived whole: a client that sends its
headers a byte a second, or never finishes its body, gets a 408 and is closed. A
write that stays blocked that long (a stream nobody reads) aborts the connection,
which the route sees as the client leaving: generation stops and the bill is
settled. A request head over ``MAX_HEAD_BYTES`` gets a 431. So each connection costs
at most its head, one 64 KiB read buffer, the body limit and one write buffer.

On SIGTERM or SIGINT the gateway drains first, while the listener stays open: new
requests get 503 (``/health`` says ``draining``, so a balancer stops sending), open
streams may finish for ``drain_s`` and are then aborted and settled; only then does
uvicorn stop, close the engines and the ledger, and the process exits 0. A second
signal skips what is left of the drain.

This module uses uvicorn's protocol class and its per-connection attributes
(``transport``, ``cycle``, ``flow``), which the pinned version (requirements.lock)
keeps; ``tests/server/test_hostile_clients.py`` fails if a new one changes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Generator
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from tokenmill.config import Settings
from tokenmill.gateway import Gateway
from tokenmill.stages import ARRIVED

log = logging.getLogger("tokenmill.server")

# Request line and headers together: browsers send under 8 KiB; 64 KiB leaves room
# for long cookies while bounding what a hostile head costs.
MAX_HEAD_BYTES = 64 * 1024
# uvicorn's own backstop after the drain: the streams are settled by then, so only
# the last frames of aborted streams are still being written.
GRACEFUL_SHUTDOWN_S = 5
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class HeadTooLarge(Exception):
    """Raised inside the parser's callback, which stops parsing this connection."""


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines of the module docstring."""

    client_timeout_s: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._request_deadline: asyncio.TimerHandle | None = None
        self._write_deadline: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._head_too_large = False

    # -- the request deadline: from connection or first byte to the whole request --

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_request_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # The request's first byte is parsed: where its stages begin (tokenmill.stages).
        self.scope["state"][ARRIVED] = time.monotonic()
        self._head_bytes = 0
        self._arm_request_deadline()

    def _arm_request_deadline(self) -> None:
        if self._request_deadline is None:
            self._request_deadline = self.loop.call_later(
                self.client_timeout_s, self._request_timed_out
            )

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._cancel_request_deadline()

    def _cancel_request_deadline(self) -> None:
        if self._request_deadline is not None:
            self._request_deadline.cancel()
            self._request_deadline = None

    def _request_timed_out(self) -> None:
        self._request_deadline = None
        if self.transport.is_closing():
            return
        log.info(
            "closing a connection from %s: no whole request within %gs",
            _peer(self.client),
            self.client_timeout_s,
        )
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            # Nothing of a response on the wire yet (or all of it): answer 408 and close.
            # A route still waiting for the body sees the client leave.
            self._write_and_close(408, "the request did not arrive in time")
        else:
            self.transport.abort()

    # -- the write deadline: a client that stopped reading --------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(
                self.client_timeout_s, self._write_timed_out
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write_deadline()

    def _cancel_write_deadline(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _write_timed_out(self) -> None:
        self._write_deadline = None
        log.info(
            "closing a connection from %s: it read nothing for %gs",
            _peer(self.client),
            self.client_timeout_s,
        )
        # close() would wait for the buffer to drain, which never happens: abort.
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_request_deadline()
        self._cancel_write_deadline()
        super().connection_lost(exc)

    # -- the head size limit --------------------------------------------------------

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            self._head_too_large = True
            raise HeadTooLarge  # the parser stops; uvicorn answers via send_400_response

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:
            self._write_and_close(431, f"the request head exceeds {MAX_HEAD_BYTES} bytes")
        else:
            super().send_400_response(msg)

    def _write_and_close(self, status: int, message: str) -> None:
        body = message.encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown peer"


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining the gateway on the first signal before it stops."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, drain_s: float) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.drain_s = drain_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises a captured signal once it has stopped, so the process dies
        # of SIGTERM (exit -15) after a clean shutdown; here a drained stop exits 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._drain is not None or self.should_exit:
            # Before serving, or a second signal: stop now (uvicorn: force on SIGINT).
            self.gateway.end_drain()
            super().handle_exit(sig, frame)
            return
        # A signal handler runs between two bytecodes of whatever the loop was doing:
        # it only schedules the drain.
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, name: str) -> None:
        if self._drain is None:
            log.info("%s: draining for up to %gs", name, self.drain_s)
            self._drain = asyncio.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.gateway.drain(self.drain_s)
        finally:
            self.should_exit = True


def serve(app: Any, settings: Settings, gateway: Gateway) -> None:
    """Serve ``app`` until a signal, then drain ``gateway`` and stop (see the module)."""
    protocol = type(
        "GuardedHttpProtocol",
        (GuardedHttpProtocol,),
        {"client_timeout_s": settings.client_timeout_s},
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=protocol,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    DrainingServer(config, gateway, settings.drain_s).run()
