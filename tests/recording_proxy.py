"""A recording HTTP proxy between an agent CLI and a tokenmill server: what the
client really sent, and what it got back.

The real CLIs (Claude Code, Codex) are black boxes: a test points their base URL at
a :class:`RecordingProxy`, which forwards every request to the server unchanged and
passes the answer back as it comes (an event stream chunk by chunk), recording each
exchange (:class:`Exchange`: method, path, JSON body, status, headers, the answer's
bytes). Assertions then read :attr:`RecordingProxy.exchanges`.
"""

from __future__ import annotations

import http.server
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx

# Headers that belong to one hop, not to the message.
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}
    | {"accept-encoding", "content-encoding"}
)
# As long as the CLIs' own request timeouts: a hang is the CLI's to report.
FORWARD_TIMEOUT_S = 600.0


@dataclass
class Exchange:
    method: str
    path: str
    body: Any  # the request's JSON (None: no body or not JSON)
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    answer: bytearray = field(default_factory=bytearray)
    done: bool = False  # the whole answer went back

    @property
    def text(self) -> str:
        return self.answer.decode("utf-8", errors="replace")

    def events(self) -> list[dict[str, Any]]:
        """An event stream's ``data:`` payloads, as JSON."""
        out = []
        for line in self.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[len("data: ") :]))
        return out


class RecordingProxy:
    """Forward to ``target`` (a server's base URL); :attr:`url` is the proxy's."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                proxy._forward(self)

            do_POST = do_DELETE = do_HEAD = do_GET

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _forward(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("content-length") or 0)
        raw = handler.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        exchange = Exchange(handler.command, handler.path, body)
        with self._lock:
            self.exchanges.append(exchange)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in HOP_HEADERS}
        url = self.target + handler.path
        with (
            httpx.Client(timeout=FORWARD_TIMEOUT_S) as client,
            client.stream(handler.command, url, content=raw, headers=headers) as response,
        ):
            exchange.status = response.status_code
            exchange.headers = {k.lower(): v for k, v in response.headers.items()}
            handler.send_response(response.status_code)
            for key, value in response.headers.items():
                if key.lower() not in HOP_HEADERS:
                    handler.send_header(key, value)
            handler.send_header("connection", "close")  # the end of the body is the end
            handler.end_headers()
            for chunk in response.iter_raw():
                exchange.answer += chunk
                handler.wfile.write(chunk)
                handler.wfile.flush()
        exchange.done = True

    def posts(self, path: str) -> list[Exchange]:
        """The POSTs to ``path`` (its query string aside), in order."""
        with self._lock:
            return [
                e for e in self.exchanges if e.method == "POST" and e.path.partition("?")[0] == path
            ]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
