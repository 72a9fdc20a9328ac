"""The replica side of a supervised replica: :func:`serve`.

Builds the engine of one deployment config section, then answers the frames of
:mod:`tokenmill.replicas.wire` until the gateway says ``close`` or is gone, so an
orphaned replica never lingers. A replica process runs it as ``python -m
tokenmill.replicas.runner`` over the socket inherited as ``--fd``; a Ray actor
(:mod:`tokenmill.replicas.rayactor`) runs the same loop over a TCP connection to its
gateway (:func:`serve_stream`, both).

An engine with a step sink (``set_step_sink`` / ``submit`` / ``cancel``, as the
llama.cpp engine has) hands each decode step's chunks to the sink on its decode
thread, which writes them to the gateway as one frame right there: a token crosses
no event loop in this process. Other engines are driven through the plain
``generate()`` interface on the event loop. Either way every frame goes through one
:class:`FrameOut`, so frames from both threads never interleave. An ``abort`` frame
is the engine's ``cancel``: the request's final chunk (``abort``, with its usage)
answers it like any other final chunk. ``embed_prepare`` and ``embed`` frames are
answered from tasks of their own: an embedding waits for the decode thread, and the
frames behind it (an ``abort``, the next ``generate``) must not wait with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from asyncio.trsock import TransportSocket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from tokenmill import stages
from tokenmill.engines import (
    CachePublishing,
    Chunk,
    ChunkStream,
    EmbeddingEngine,
    Engine,
    GenerationRequest,
    KvMoving,
    KvState,
    SteppedEngine,
    StepSink,
    TokenizingEngine,
    cannot_embed,
)
from tokenmill.errors import InvalidRequestError
from tokenmill.replicas.spans import traced
from tokenmill.replicas.wire import (
    chunk_row,
    decode_embedding,
    decode_request,
    decode_tokenize,
    encode_cache_event,
    encode_error,
    encode_frame,
    encode_tokenizer_info,
    read_frame,
)

log = logging.getLogger("tokenmill.replicas.runner")

# Health is pushed to the gateway at most this often, and only when it changed.
STATUS_INTERVAL_S = 0.25


class FrameOut(Protocol):
    """Where a replica's frames go: whole frames, in order, from any thread."""

    def send(self, message: dict[str, Any]) -> None: ...


Receive = Callable[[], Awaitable[dict[str, Any] | None]]


class FrameWriter:
    """Whole frames to the gateway, from any thread.

    The socket stays non-blocking (asyncio reads it); a write that finds the buffer
    full waits for room with ``select``. Once the gateway is gone, writes are dropped:
    the read side sees EOF and the process exits.
    """

    def __init__(self, sock: socket.socket | TransportSocket) -> None:
        self._fd = sock.fileno()
        self._lock = threading.Lock()
        self.closed = False

    def send(self, message: dict[str, Any]) -> None:
        self.write(encode_frame(message))

    def write(self, data: bytes) -> None:
        with self._lock:
            view = memoryview(data)
            while view and not self.closed:
                try:
                    view = view[os.write(self._fd, view) :]
                except BlockingIOError:
                    select.select([], [self._fd], [])
                except OSError as e:
                    if e.errno != errno.EINTR:
                        self.closed = True


class Outbox:
    """Chunks produced in one decode step leave together, in one frame.

    The engine wakes every stream of a step in one event-loop callback; each
    stream's task appends its chunk here, and the flush scheduled by the first
    one runs after all of them.
    """

    def __init__(self, writer: FrameOut) -> None:
        self._writer = writer
        self._chunks: list[list[Any]] = []
        self._scheduled = False
        self._loop = asyncio.get_running_loop()

    def chunk(self, rid: str, chunk: Chunk) -> None:
        self._chunks.append(chunk_row(rid, chunk))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def send(self, message: dict[str, Any]) -> None:
        self.flush()  # keep order: earlier chunks of a request precede its error
        self._write(message)

    def flush(self) -> None:
        self._scheduled = False
        if self._chunks:
            chunks, self._chunks = self._chunks, []
            self._write({"op": "chunks", "c": chunks})

    def _write(self, message: dict[str, Any]) -> None:
        self._writer.send(message)


def engine_status(engine: Engine) -> dict[str, Any]:
    """The health snapshot a replica sends in ``ready``, ``status`` and ``pong``."""
    h = engine.health()
    stalled = h.detail.get("stalled_s", 0)
    return {
        "ready": h.ready,
        "slots": h.slots,
        "running": h.running,
        "waiting": h.waiting,
        "tokens_generated": h.tokens_generated,
        "kv_cache_usage": round(h.kv_cache_usage, 4),
        "threads": h.threads,
        # Whole seconds the current decode step has been running: the gateway's
        # probe kills a replica whose engine hangs in native code.
        "stalled_s": int(stalled) if isinstance(stalled, int | float) else 0,
        "context_length": (
            engine.context_length() if isinstance(engine, TokenizingEngine) else None
        ),
        # The KV pool and host-memory tier (llama.cpp), for the deployment's describe.
        "kv": h.kv,
        "moves_kv": h.moves_kv,
        "weights": h.weights,
    }


class Runner:
    """The replica loop: frames in, the engine driven, frames out."""

    def __init__(self, engine: Engine, out: Outbox) -> None:
        self.engine = engine
        self.out = out
        # Streams of engines without a step sink, pumped into ``chunks`` frames.
        self.pumps: dict[str, asyncio.Task[None]] = {}
        # Embedding calls being answered.
        self.calls: set[asyncio.Task[None]] = set()

    def status(self) -> dict[str, Any]:
        return engine_status(self.engine)

    async def push_status(self) -> None:
        last: dict[str, Any] | None = None
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            s = self.status()
            if s != last:
                self.out.send({"op": "status", "status": s})
                last = s

    async def prepare(self, req: GenerationRequest) -> bool:
        """Answer a ``prepare`` frame: ``prepared``, or an ``error`` (then False)."""
        started = time.monotonic()
        try:
            info = await self.engine.prepare(req)
        except Exception as e:
            self.out.send({"op": "error", "id": req.request_id, "error": encode_error(e)})
            return False
        self.out.send(
            {
                "op": "prepared",
                "id": req.request_id,
                "prompt_tokens": info.prompt_tokens,
                "context_length": info.context_length,
                "longest_prompt": info.longest_prompt,
                # The prompts' token ids (for routing, and for another replica).
                "k": None if info.tokens is None else [list(p) for p in info.tokens],
                # When the work began and ended (tokenmill.stages).
                "t": [started, time.monotonic()],
            }
        )
        return True

    async def call(self, msg: dict[str, Any]) -> bool:
        """Answer a call frame (``tokenize`` ... ``embed``) by its id; False when ``msg``
        is no call."""
        op = msg["op"]
        if op in ("tokenize", "detokenize", "tokenizer_info"):
            await self.answer(msg)
        elif op in ("embed_prepare", "embed"):
            self.embedding(msg)
        elif op in ("kv_export", "kv_import", "kv_held"):
            self._task(self._kv_move(msg))
        else:
            return False
        return True

    def _task(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self.calls.add(task)
        task.add_done_callback(self.calls.discard)

    async def _kv_move(self, msg: dict[str, Any]) -> None:
        """A ``kv_export`` (the state of the longest held prefix of ``tokens``, as the
        answer's blob), ``kv_import`` (a state to keep) or ``kv_held`` frame (the
        sequences held), answered by its id."""
        call_id = msg["id"]
        try:
            if not isinstance(self.engine, KvMoving):
                raise InvalidRequestError(f"the {self.engine.name} engine cannot move KV state")
            if msg["op"] == "kv_held":
                answer: dict[str, Any] = {
                    "seqs": [list(s) for s in await self.engine.held_kv(int(msg["min"]))]
                }
            elif msg["op"] == "kv_export":
                got = await self.engine.export_kv(msg["tokens"], int(msg["min"]))
                answer = {"found": got is not None}
                if got is not None:
                    answer |= {"tokens": list(got.tokens), "fp": got.fingerprint, "blob": got.state}
            else:
                state = KvState(tuple(msg["tokens"]), bytes(msg["blob"]), str(msg["fp"]))
                answer = {"ok": await self.engine.import_kv(state)}
        except Exception as e:
            self.out.send({"op": "error", "id": call_id, "error": encode_error(e)})
            return
        self.out.send({"op": "answer", "id": call_id, **answer})

    async def answer(self, msg: dict[str, Any]) -> None:
        """A ``tokenize``, ``detokenize`` or ``tokenizer_info`` frame, answered by its id."""
        call_id = msg["id"]
        try:
            if not isinstance(self.engine, TokenizingEngine):
                raise InvalidRequestError(
                    f"the {self.engine.name} engine has no tokenizer", param="model"
                )
            if msg["op"] == "tokenize":
                tokens = await self.engine.tokenize(decode_tokenize(msg["req"]))
                answer: dict[str, Any] = {"tokens": tokens}
            elif msg["op"] == "tokenizer_info":
                answer = {"info": encode_tokenizer_info(await self.engine.tokenizer_info())}
            else:
                answer = {"text": await self.engine.detokenize(msg["tokens"])}
        except Exception as e:
            self.out.send({"op": "error", "id": call_id, "error": encode_error(e)})
            return
        self.out.send({"op": "answer", "id": call_id, **answer})

    def embedding(self, msg: dict[str, Any]) -> None:
        """An ``embed_prepare`` or ``embed`` frame, answered by its id from a task."""
        self._task(self._embedding(msg))

    async def _embedding(self, msg: dict[str, Any]) -> None:
        call_id = msg["id"]
        try:
            if not isinstance(self.engine, EmbeddingEngine):
                raise InvalidRequestError(cannot_embed(self.engine.name), param="model")
            req = decode_embedding(msg["req"])
            if msg["op"] == "embed_prepare":
                info = await self.engine.prepare_embeddings(req)
                answer: dict[str, Any] = {
                    "prompt_tokens": info.prompt_tokens,
                    "dimensions": info.dimensions,
                }
            else:
                done = await self.engine.embed(req)
                answer = {"vectors": done.vectors, "prompt_tokens": done.prompt_tokens}
        except Exception as e:
            self.out.send({"op": "error", "id": call_id, "error": encode_error(e)})
            return
        self.out.send({"op": "answer", "id": call_id, **answer})

    def generate(self, req: GenerationRequest) -> None:
        """Start a request; a task copies its stream, final chunk included, to frames."""
        rid = req.request_id
        try:
            stream = self.engine.generate(req)
        except Exception as e:
            self.out.send({"op": "error", "id": rid, "error": encode_error(e)})
            return
        task = asyncio.create_task(self._pump(rid, stream))
        self.pumps[rid] = task
        task.add_done_callback(lambda _: self.pumps.pop(rid, None))

    async def _pump(self, rid: str, stream: ChunkStream) -> None:
        try:
            async for chunk in stream:
                self.out.chunk(rid, chunk)
        except Exception as e:
            self.out.send({"op": "error", "id": rid, "error": encode_error(e)})


def step_sink(out: FrameOut, first_marks: dict[str, tuple[float, ...]] | None = None) -> StepSink:
    """The engine's step sink: one ``chunks`` frame per step, then any errors.

    ``first_marks`` is the engine's (request id -> marks of its first token): a frame
    carrying a request's first token carries them too, as ``t`` (tokenmill.stages).
    """

    def sink(events: list[tuple[str, Chunk | BaseException]]) -> None:
        rows = [chunk_row(rid, item) for rid, item in events if isinstance(item, Chunk)]
        marks = None
        if first_marks:  # taken with any event of theirs, so that none is left behind
            marks = stages.take_first(first_marks, (rid for rid, _ in events))
        if rows:
            frame: dict[str, Any] = {"op": "chunks", "c": rows}
            if marks is not None:
                frame["t"] = marks
            out.send(frame)
        for rid, item in events:
            if not isinstance(item, Chunk):
                out.send({"op": "error", "id": rid, "error": encode_error(item)})

    return sink


def create_engine_from(section: dict[str, Any]) -> Engine:
    """The engine of a deployment's config section, received as JSON."""
    from tokenmill.config import parse_section
    from tokenmill.engines import create_engine

    return create_engine(parse_section(section))


async def load_engine(section: dict[str, Any]) -> Engine:
    """The engine of ``section``, started; raises (and logs) when it cannot load."""
    try:
        engine = create_engine_from(section)
        await engine.start()
    except Exception as e:
        log.error("the engine failed to load: %s", e)
        raise
    return engine


async def serve(
    receive: Receive,
    frames: FrameOut,
    section: dict[str, Any],
    on_engine: Callable[[Engine], None] | None = None,
) -> int:
    """Run one replica: load the engine ``section`` describes (handed to ``on_engine``
    once loaded: a Ray actor's object-store calls use it), then answer frames from
    ``receive`` on ``frames`` until ``close`` or the gateway is gone."""
    out = Outbox(frames)
    try:
        engine = await load_engine(section)
    except Exception as e:
        out.send({"op": "fatal", "message": str(e)})
        return 1
    if on_engine is not None:
        on_engine(engine)
    runner = Runner(engine, out)
    stepped = engine if isinstance(engine, SteppedEngine) else None
    if stepped is not None:
        stepped.set_step_sink(step_sink(frames, getattr(stepped, "first_marks", None)))
    out.send({"op": "ready", "status": runner.status()})
    if isinstance(engine, CachePublishing):
        # Straight to the socket, from whatever thread changes the cache (as a step's
        # chunks are): a snapshot first, then every change (``kv_all``, ``kv``).
        engine.publish_cache(lambda event: frames.send(encode_cache_event(event)))
    status_task = asyncio.create_task(runner.push_status())
    try:
        while True:
            msg = await receive()
            if msg is None or msg["op"] == "close":
                break
            op = msg["op"]
            if op == "generate":
                req = decode_request(msg["req"])
                if stepped is None:
                    runner.generate(req)
                    continue
                try:
                    stepped.submit(req)
                except Exception as e:
                    out.send({"op": "error", "id": req.request_id, "error": encode_error(e)})
            elif op == "abort":
                # The one way to stop a request: its final chunk ("abort") follows.
                engine.cancel(msg["id"])
            elif op == "prepare":
                await runner.prepare(decode_request(msg["req"]))
            elif await runner.call(msg):
                continue
            elif op == "ping":
                out.send({"op": "pong", "status": runner.status()})
    finally:
        status_task.cancel()
        for task in [*runner.pumps.values(), *runner.calls]:
            task.cancel()
        await engine.close()
        out.flush()
    return 0


async def serve_stream(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    section: dict[str, Any],
    on_engine: Callable[[Engine], None] | None = None,
) -> int:
    """A replica over a stream socket, closed when it ends: frames read by ``reader``,
    written by a :class:`FrameWriter` on the same socket (from the decode thread too).
    A replica process's inherited socket, or a Ray actor's TCP connection to its
    gateway (:mod:`tokenmill.replicas.rayactor`). With tracing on, its own spans of
    the requests are exported (:mod:`tokenmill.replicas.spans`)."""

    async def receive() -> dict[str, Any] | None:
        return await read_frame(reader)

    try:
        with traced(receive, FrameWriter(writer.get_extra_info("socket"))) as (inbox, frames):
            return await serve(inbox, frames, section, on_engine)
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def serve_socket(fd: int, section: dict[str, Any]) -> int:
    """A replica process: frames over the socket inherited as ``--fd``."""
    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    return await serve_stream(reader, writer, section)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill.replicas.runner")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--section", required=True, help="the deployment's config, JSON")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--nice", type=int, default=0)
    args = parser.parse_args(argv)
    if args.nice:
        # Before any thread exists: llama.cpp's threads inherit it.
        os.nice(args.nice)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s[replica]: %(message)s",
        stream=sys.stderr,
    )
    # Ctrl-C reaches the whole process group; the gateway decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return asyncio.run(serve_socket(args.fd, json.loads(args.section)))


if __name__ == "__main__":
    sys.exit(main())
