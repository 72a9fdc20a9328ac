"""An OpenAI-compatible server that streams but never reports usage.

Older servers (and some proxies) ignore ``stream_options.include_usage``; no server
that runs here behaves that way, so the tests stand this one up over real HTTP:
``python -m uvicorn tests.gateway.no_usage_upstream:app --port N``. It streams
:data:`TEXT` in several-token chunks, then a finish chunk, then ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

TEXT = "The quick brown fox jumps over the lazy dog. " * 3
CHUNK_CHARS = 10


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _stream(chat: bool) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    for i in range(0, len(TEXT), CHUNK_CHARS):
        piece = TEXT[i : i + CHUNK_CHARS]
        choice: dict[str, Any] = {"index": 0, "finish_reason": None}
        if chat:
            choice["delta"] = {"content": piece}
        else:
            choice["text"] = piece
        yield _event({"id": "x", "object": obj, "choices": [choice]})
    end: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
    end["delta" if chat else "text"] = {} if chat else ""
    yield _event({"id": "x", "object": obj, "choices": [end]})
    yield b"data: [DONE]\n\n"


async def chat(request: Request) -> StreamingResponse:
    await request.json()
    return StreamingResponse(_stream(True), media_type="text/event-stream")


async def completions(request: Request) -> StreamingResponse:
    await request.json()
    return StreamingResponse(_stream(False), media_type="text/event-stream")


app = Starlette(
    routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
)
