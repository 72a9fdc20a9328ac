"""Python client for a tokenmill gateway (or any OpenAI-compatible server).

    from tokenmill import Client

    with Client() as client:
        print(client.chat("Hello!", max_tokens=32).text)
        for chunk in client.complete("Once upon a time", stream=True, max_tokens=32):
            print(chunk.text, end="", flush=True)

:class:`AsyncClient` is the same API with ``await``; :class:`Client` runs it on a
private event loop, so both behave identically.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.client._async import AsyncClient, AsyncStream
    from tokenmill.client._sync import Client, Stream
    from tokenmill.client.errors import (
        APIConnectionError,
        APIStatusError,
        AuthenticationError,
        BadRequestError,
        InsufficientCreditError,
        NotFoundError,
        PermissionDeniedError,
        RateLimitError,
        ServerError,
        StreamError,
        TokenmillError,
    )
    from tokenmill.client.types import Chunk, Model, Response, Usage

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "BadRequestError",
    "Chunk",
    "Client",
    "InsufficientCreditError",
    "Model",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "Response",
    "ServerError",
    "Stream",
    "StreamError",
    "TokenmillError",
    "Usage",
]

# Where each name lives. Imported on first use: `tokenmill.client.cli` is loaded by
# every `tokenmill` command, and only chat/complete need httpx.
_MODULES = {
    "AsyncClient": "_async",
    "AsyncStream": "_async",
    "Client": "_sync",
    "Stream": "_sync",
    "Chunk": "types",
    "Model": "types",
    "Response": "types",
    "Usage": "types",
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'tokenmill.client' has no attribute {name!r}")
    module = importlib.import_module(f"tokenmill.client.{_MODULES.get(name, 'errors')}")
    return getattr(module, name)
