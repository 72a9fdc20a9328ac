"""The blocking client: :class:`AsyncClient` run on a private event loop thread.

Every call is handed to that loop and awaited from the caller's thread, so there is
one implementation of requests, retries and streaming. A ``KeyboardInterrupt`` in
the caller (Ctrl-C while waiting) cancels the work on the loop before it propagates,
so an interrupted stream is closed and the server stops generating.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
from collections.abc import Coroutine, Iterator, Mapping
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import httpx

from tokenmill.client._async import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT_S,
    AsyncClient,
    AsyncStream,
    EndpointType,
    Messages,
)
from tokenmill.client.types import Chunk, Model, Response

T = TypeVar("T")


class _LoopThread:
    """An event loop running forever in a daemon thread (daemon: a client that is never
    closed must not keep the interpreter from exiting)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="tokenmill-client", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        # Ctrl-C must reach the caller's thread. The kernel hands a process-directed
        # signal to any thread that does not block it, and Python only runs handlers in
        # the main thread: delivered here, it would leave a caller blocked on a result
        # that never comes (a stream the server keeps open) uninterrupted, for good.
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError("the client is closed")
        if threading.current_thread() is self._thread:
            coro.close()  # waiting here for our own loop would deadlock
            raise RuntimeError("a Client cannot be called from its own callbacks; use AsyncClient")
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        box: list[asyncio.Task[T]] = []

        def copy(task: asyncio.Task[T]) -> None:
            if task.cancelled():
                result.cancel()
            elif (exc := task.exception()) is not None:
                result.set_exception(exc)
            else:
                result.set_result(task.result())

        def start() -> None:
            task = self.loop.create_task(coro)
            box.append(task)
            task.add_done_callback(copy)

        self.loop.call_soon_threadsafe(start)
        try:
            return result.result()
        except BaseException:
            if not result.done():  # interrupted while waiting: stop the work too
                self._cancel(box)
            raise

    def _cancel(self, box: list[asyncio.Task[T]]) -> None:
        async def cancel() -> None:
            # call_soon_threadsafe runs callbacks in order: start() already ran.
            task = box[0]
            task.cancel()
            await asyncio.wait([task])

        asyncio.run_coroutine_threadsafe(cancel(), self.loop).result()

    def close(self) -> None:
        if self.loop.is_closed():
            return
        # Finalize streams the caller abandoned without closing, while the loop runs.
        asyncio.run_coroutine_threadsafe(self.loop.shutdown_asyncgens(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class Stream:
    """Iterator of :class:`Chunk`. ``close()`` (or leaving ``with``) closes the
    connection, which tells the server to stop generating."""

    def __init__(self, runner: _LoopThread, stream: AsyncStream) -> None:
        self._runner = runner
        self._stream = stream
        self.request_id = stream.request_id

    @property
    def text(self) -> str:
        """All text received so far."""
        return self._stream.text

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        try:
            return self._runner.run(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        self._runner.run(self._stream.aclose())

    def __enter__(self) -> Stream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Client:
    """Blocking client for a tokenmill gateway; same arguments as :class:`AsyncClient`.

    ``base_url`` defaults to ``$TOKENMILL_URL`` or ``http://127.0.0.1:8000`` and
    ``api_key`` to ``$TOKENMILL_API_KEY``. Use as ``with Client() as c``.
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
        async def make() -> AsyncClient:
            # Built on the loop that will use it: its connection pool belongs there.
            return AsyncClient(
                base_url, api_key, timeout=timeout, max_retries=max_retries, headers=headers
            )

        self._runner = _LoopThread()
        try:
            self._async = self._runner.run(make())
        except BaseException:
            self._runner.close()
            raise
        self.base_url = self._async.base_url
        self.api_key = self._async.api_key
        self.max_retries = self._async.max_retries

    def close(self) -> None:
        if not self._runner.loop.is_closed():
            try:
                self._runner.run(self._async.aclose())
            finally:
                self._runner.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _wrap(self, coro: Coroutine[Any, Any, Response | AsyncStream]) -> Response | Stream:
        result = self._runner.run(coro)
        return Stream(self._runner, result) if isinstance(result, AsyncStream) else result

    @overload
    def chat(
        self,
        messages: Messages,
        *,
        model: str | None = ...,
        stream: Literal[False] = ...,
        **sampling: Any,
    ) -> Response: ...
    @overload
    def chat(
        self, messages: Messages, *, model: str | None = ..., stream: Literal[True], **sampling: Any
    ) -> Stream: ...
    @overload
    def chat(
        self, messages: Messages, *, model: str | None = ..., stream: bool, **sampling: Any
    ) -> Response | Stream: ...
    def chat(
        self, messages: Messages, *, model: str | None = None, stream: bool = False, **sampling: Any
    ) -> Response | Stream:
        """A chat completion; ``messages`` may be a plain string (one user turn)."""
        return self._wrap(self._async.chat(messages, model=model, stream=stream, **sampling))

    @overload
    def complete(
        self, prompt: str, *, model: str | None = ..., stream: Literal[False] = ..., **sampling: Any
    ) -> Response: ...
    @overload
    def complete(
        self, prompt: str, *, model: str | None = ..., stream: Literal[True], **sampling: Any
    ) -> Stream: ...
    @overload
    def complete(
        self, prompt: str, *, model: str | None = ..., stream: bool, **sampling: Any
    ) -> Response | Stream: ...
    def complete(
        self, prompt: str, *, model: str | None = None, stream: bool = False, **sampling: Any
    ) -> Response | Stream:
        """A text completion of ``prompt``."""
        return self._wrap(self._async.complete(prompt, model=model, stream=stream, **sampling))

    @overload
    def predict(
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
    def predict(
        self,
        deployment: str,
        prompt: str | None = ...,
        messages: Messages | None = ...,
        endpoint_type: EndpointType | None = ...,
        *,
        stream: Literal[True],
        **sampling: Any,
    ) -> Stream: ...
    @overload
    def predict(
        self,
        deployment: str,
        prompt: str | None = ...,
        messages: Messages | None = ...,
        endpoint_type: EndpointType | None = ...,
        *,
        stream: bool,
        **sampling: Any,
    ) -> Response | Stream: ...
    def predict(
        self,
        deployment: str,
        prompt: str | None = None,
        messages: Messages | None = None,
        endpoint_type: EndpointType | None = None,
        *,
        stream: bool = False,
        **sampling: Any,
    ) -> Response | Stream:
        """Call a deployment's predict endpoint with ``prompt`` or ``messages``."""
        return self._wrap(
            self._async.predict(
                deployment, prompt, messages, endpoint_type, stream=stream, **sampling
            )
        )

    def models(self) -> list[Model]:
        return self._runner.run(self._async.models())
