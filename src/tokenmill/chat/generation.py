"""One generation through the gateway, read back as neutral events.

:func:`open_generation` turns a :class:`~tokenmill.chat.request.ChatRequest` into
the engine's :class:`~tokenmill.engines.base.GenerationRequest` (the turns rendered,
the tools described or handed to the template, the constraint set, the schema put in
the prompt) and opens it through the gateway; :class:`Generation` reads its chunks
back as :mod:`tokenmill.chat.events`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from tokenmill.chat.events import Event, Result
from tokenmill.chat.request import ChatRequest
from tokenmill.gateway.core import Gateway, RequestStream
from tokenmill.gateway.deployment import Deployment
from tokenmill.gateway.metering import Caller

__all__ = ["Generation", "open_generation"]


class Generation:
    """An open generation: iterate :meth:`events` or await :meth:`collect`, once;
    :meth:`aclose` always (it settles the bill, and is safe to call twice)."""

    stream: RequestStream

    @property
    def request_id(self) -> str:
        raise NotImplementedError

    @property
    def choices(self) -> int:
        """How many choices: ``n`` for each prompt."""
        raise NotImplementedError

    def events(self) -> AsyncIterator[Event]:
        raise NotImplementedError

    async def collect(self) -> Result:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


async def open_generation(
    gateway: Gateway,
    deployment: Deployment,
    request: ChatRequest,
    request_id: str,
    caller: Caller,
) -> Generation:
    """Check, build and open the engine request (may raise: a 400 naming the field,
    or whatever the gateway refuses with before streaming)."""
    raise NotImplementedError
