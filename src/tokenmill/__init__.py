"""tokenmill: serve LLMs with token streaming over an OpenAI-compatible API, and meter
every token. Importing this package never imports llama.cpp, torch or ray."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.client import (
        APIConnectionError,
        APIStatusError,
        AsyncClient,
        AuthenticationError,
        BadRequestError,
        Client,
        InsufficientCreditError,
        NotFoundError,
        PermissionDeniedError,
        RateLimitError,
        ServerError,
        StreamError,
        TokenmillError,
    )

__version__ = "0.1.0"

# The client's names, imported on first use so that `import tokenmill` (the server,
# the CLI) does not pay for httpx.
__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "InsufficientCreditError",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "ServerError",
    "StreamError",
    "TokenmillError",
    "__version__",
]
_CLIENT_NAMES = frozenset(__all__) - {"__version__"}


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from tokenmill import client

        return getattr(client, name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
