"""The client, written once, async: requests, retries, SSE parsing, error mapping.

``Client`` (in ``_sync``) runs this same code on a private event loop; nothing here
knows whether a caller is sync or async.

Retries: connect failures, 429 (after ``Retry-After``) and 5xx are retried with
exponential backoff and jitter, but only until the response headers have arrived.
Once a stream has begun it is never re-sent: a break raises :class:`StreamError`
carrying the text received so far, so the caller never sees a token twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, Literal, overload
from urllib.parse import quote

import httpx

from tokenmill.client.errors import (
    APIConnectionError,
    RateLimitError,
    ServerError,
    StreamError,
    TokenmillError,
    error_fields,
    status_error,
)
from tokenmill.client.types import Chunk, Model, Response

log = logging.getLogger("tokenmill.client")

DEFAULT_URL = "http://127.0.0.1:8000"
# A non-streamed answer arrives only when generation ends, which on a busy CPU server
# can take minutes; connecting should not.
DEFAULT_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 10.0
DEFAULT_MAX_RETRIES = 2
# Backoff doubles from BASE up to CAP; a server asking for longer than MAX_RETRY_AFTER
# is not waited for (the error is raised so the caller can decide).
BACKOFF_BASE_S = 0.25
BACKOFF_CAP_S = 8.0
MAX_RETRY_AFTER_S = 60.0

Messages = str | Sequence[Mapping[str, Any]]
EndpointType = Literal["chat", "completion"]


def _normalize_url(url: str) -> str:
    # Accept both the server root and an OpenAI-style base URL ending in /v1.
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def _messages(messages: Messages) -> list[dict[str, Any]]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return [dict(m) for m in messages]


def _sampling(sampling: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sampling.items() if v is not None}


def backoff_delay(attempt: int, error: TokenmillError) -> float | None:
    """Seconds to wait before retry ``attempt`` (0-based), or None: do not retry."""
    if isinstance(error, RateLimitError):
        if error.retry_after is not None:
            if error.retry_after > MAX_RETRY_AFTER_S:
                return None
            # Honour the server's hint; a little jitter spreads clients refused together.
            return error.retry_after * (1.0 + 0.1 * random.random())
    elif not isinstance(error, ServerError | APIConnectionError):
        return None
    delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2.0**attempt)
    # "Equal jitter": at least half the delay, so retries do not collapse to zero.
    return delay / 2 + random.uniform(0, delay / 2)


async def _sse_data(response: httpx.Response) -> AsyncGenerator[str, None]:
    """The ``data`` of each server-sent event (multi-line data joined by newlines)."""
    buf: list[str] = []
    lines = response.aiter_lines()
    async for line in lines:
        if not line:
            if buf:
                yield "\n".join(buf)
                buf = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            buf.append(value.removeprefix(" "))
    if buf:
        yield "\n".join(buf)


class AsyncStream:
    """Async iterator of :class:`Chunk`. Closing it (``aclose`` or leaving ``async with``)
    closes the connection, which tells the server to stop generating."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.request_id: str | None = response.headers.get("x-request-id")
        self.text = ""  # all text received so far
        self._chunks = self._iterate()

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            await self.response.aclose()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _broken(self, message: str, **kw: Any) -> StreamError:
        return StreamError(message, text=self.text, request_id=self.request_id, **kw)

    def _parse(self, data: str) -> Chunk:
        """One event as a chunk; an in-band error event raises :class:`StreamError`."""
        try:
            event = json.loads(data)
        except ValueError:
            raise self._broken(
                f"the server sent an event that is not JSON: {data[:200]!r}"
            ) from None
        if not isinstance(event, dict):
            raise self._broken(f"the server sent an unexpected event: {data[:200]!r}")
        if "error" in event:
            err = error_fields(event)
            raise self._broken(
                str(err.get("message") or "the server reported an error mid-stream"),
                type=err.get("type"),
                code=err.get("code"),
                param=err.get("param"),
                body=event,
            )
        return Chunk.from_event(event, self.request_id)

    async def _iterate(self) -> AsyncGenerator[Chunk, None]:
        # The chunk carrying finish_reason is held back one event so the usage frame
        # that follows it (stream_options.include_usage) lands on the same last chunk.
        pending: Chunk | None = None
        done = False
        try:
            # aclosing: closing this stream finalizes the parser now, not at GC time.
            async with contextlib.aclosing(_sse_data(self.response)) as events:
                async for data in events:
                    if data.strip() == "[DONE]":
                        done = True
                        break
                    chunk = self._parse(data)
                    self.text += chunk.text
                    if pending is not None:
                        if chunk.usage and not chunk.text and chunk.finish_reason is None:
                            usage, raw = chunk.usage, {**pending.raw, **chunk.raw}
                            pending = replace(pending, usage=usage, raw=raw)
                            continue
                        yield pending
                        pending = None
                    if chunk.finish_reason is not None or (chunk.usage and not chunk.text):
                        pending = chunk
                    elif chunk.text:
                        yield chunk
        except httpx.TransportError as e:
            raise self._broken(
                f"the stream broke after {len(self.text)} characters "
                f"({type(e).__name__}: {e or 'connection lost'}); it was not re-sent"
            ) from e
        finally:
            await self.response.aclose()
        if not done:
            raise self._broken(
                f"the stream ended without [DONE] after {len(self.text)} characters; "
                "it was not re-sent"
            )
        if pending is not None:
            yield pending


class AsyncClient:
    """Async client for a tokenmill gateway (or any OpenAI-compatible server).

    ``base_url`` defaults to ``$TOKENMILL_URL`` or ``http://127.0.0.1:8000`` and
    ``api_key`` to ``$TOKENMILL_API_KEY``. Use as ``async with AsyncClient() as c``.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        from tokenmill import __version__

        self.base_url = _normalize_url(base_url or os.environ.get("TOKENMILL_URL") or DEFAULT_URL)
        self.api_key = api_key if api_key is not None else os.environ.get("TOKENMILL_API_KEY")
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.max_retries = max_retries
        all_headers = {"user-agent": f"tokenmill-python/{__version__}"}
        if self.api_key:
            all_headers["authorization"] = f"Bearer {self.api_key}"
        all_headers.update(headers or {})
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=all_headers,
            timeout=timeout
            if isinstance(timeout, httpx.Timeout)
            else httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S)),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- the three generation calls -------------------------------------------------

    @overload
    async def chat(
        self,
        messages: Messages,
        *,
        model: str | None = ...,
        stream: Literal[False] = ...,
        **sampling: Any,
    ) -> Response: ...
    @overload
    async def chat(
        self, messages: Messages, *, model: str | None = ..., stream: Literal[True], **sampling: Any
    ) -> AsyncStream: ...
    @overload
    async def chat(
        self, messages: Messages, *, model: str | None = ..., stream: bool, **sampling: Any
    ) -> Response | AsyncStream: ...
    async def chat(
        self, messages: Messages, *, model: str | None = None, stream: bool = False, **sampling: Any
    ) -> Response | AsyncStream:
        """A chat completion; ``messages`` may be a plain string (one user turn)."""
        body = {"model": model, "messages": _messages(messages), **_sampling(sampling)}
        return await self._generate("/v1/chat/completions", body, stream)

    @overload
    async def complete(
        self, prompt: str, *, model: str | None = ..., stream: Literal[False] = ..., **sampling: Any
    ) -> Response: ...
    @overload
    async def complete(
        self, prompt: str, *, model: str | None = ..., stream: Literal[True], **sampling: Any
    ) -> AsyncStream: ...
    @overload
    async def complete(
        self, prompt: str, *, model: str | None = ..., stream: bool, **sampling: Any
    ) -> Response | AsyncStream: ...
    async def complete(
        self, prompt: str, *, model: str | None = None, stream: bool = False, **sampling: Any
    ) -> Response | AsyncStream:
        """A text completion of ``prompt``."""
        body = {"model": model, "prompt": prompt, **_sampling(sampling)}
        return await self._generate("/v1/completions", body, stream)

    @overload
    async def predict(
        self,
        deployment: str,
        prompt: str | None = ...,
        messages: Messages | None = ...,
        endpoint_type: EndpointType | None = ...,
        *,
        stream: Literal[False] = ...,
        **sampling: Any,
    ) -> Response: ...
    @overload
    async def predict(
        self,
        deployment: str,
        prompt: str | None = ...,
        messages: Messages | None = ...,
        endpoint_type: EndpointType | None = ...,
        *,
        stream: Literal[True],
        **sampling: Any,
    ) -> AsyncStream: ...
    @overload
    async def predict(
        self,
        deployment: str,
        prompt: str | None = ...,
        messages: Messages | None = ...,
        endpoint_type: EndpointType | None = ...,
        *,
        stream: bool,
        **sampling: Any,
    ) -> Response | AsyncStream: ...
    async def predict(
        self,
        deployment: str,
        prompt: str | None = None,
        messages: Messages | None = None,
        endpoint_type: EndpointType | None = None,
        *,
        stream: bool = False,
        **sampling: Any,
    ) -> Response | AsyncStream:
        """Call a deployment's predict endpoint with ``prompt`` or ``messages``."""
        if (prompt is None) == (messages is None):
            raise ValueError("pass exactly one of prompt and messages")
        body: dict[str, Any] = {"endpoint_type": endpoint_type, **_sampling(sampling)}
        if prompt is not None:
            body["prompt"] = prompt
        else:
            assert messages is not None
            body["messages"] = _messages(messages)
        action = "predictWithResponseStream" if stream else "predict"
        path = f"/v1/deployments/{quote(deployment, safe='')}/{action}"
        return await self._generate(path, body, stream)

    async def models(self) -> list[Model]:
        response = await self._send("GET", "/v1/models")
        body = await self._json(response)
        return [Model.from_body(m) for m in body.get("data", []) if isinstance(m, dict)]

    # -- plumbing ---------------------------------------------------------------------

    async def _generate(
        self, path: str, body: dict[str, Any], stream: bool
    ) -> Response | AsyncStream:
        body = {k: v for k, v in body.items() if v is not None}
        body["stream"] = stream
        if stream:
            # Ask for the usage frame so the last chunk can carry the token counts.
            body.setdefault("stream_options", {"include_usage": True})
        response = await self._send("POST", path, body)
        if stream:
            return AsyncStream(response)
        return Response.from_body(await self._json(response), response.headers.get("x-request-id"))

    async def _json(self, response: httpx.Response) -> dict[str, Any]:
        try:
            content = await response.aread()
        except httpx.TransportError as e:
            raise APIConnectionError(
                f"the connection broke while reading the response: {e}",
                request_id=response.headers.get("x-request-id"),
            ) from e
        finally:
            await response.aclose()
        try:
            body = json.loads(content)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise TokenmillError(
                f"the server sent a response that is not a JSON object: {content[:200]!r}",
                status=response.status_code,
                request_id=response.headers.get("x-request-id"),
            )
        return body

    async def _send(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> httpx.Response:
        """Send with retries; return a response with status < 400, body not yet read."""
        attempt = 0
        while True:
            error: TokenmillError
            try:
                request = self._http.build_request(method, path, json=body)
                response = await self._http.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                error = APIConnectionError(f"cannot reach {self.base_url}: {e or type(e).__name__}")
            except httpx.TimeoutException as e:
                # The request reached the server, which may be generating: not retried.
                raise APIConnectionError(f"{method} {path} timed out: {type(e).__name__}") from e
            except httpx.TransportError as e:
                raise APIConnectionError(f"{method} {path} failed: {e or type(e).__name__}") from e
            else:
                if response.status_code < 400:
                    return response
                try:
                    content = await response.aread()
                except httpx.TransportError:
                    content = b""
                finally:
                    await response.aclose()
                error = status_error(
                    response.status_code,
                    content,
                    request_id=response.headers.get("x-request-id"),
                    retry_after=response.headers.get("retry-after"),
                )
            delay = backoff_delay(attempt, error) if attempt < self.max_retries else None
            if delay is None:
                raise error
            attempt += 1
            log.info(
                "retry %d/%d of %s %s in %.2fs: %s",
                attempt,
                self.max_retries,
                method,
                path,
                delay,
                error,
            )
            await asyncio.sleep(delay)
