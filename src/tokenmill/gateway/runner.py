"""The child side of a process replica: ``python -m tokenmill.gateway.runner``.

Loads one engine, then serves the frames of :mod:`tokenmill.gateway.process` on the
socket inherited as ``--fd``. Exits when the gateway says ``close`` or when the
socket reaches EOF (the gateway is gone), so an orphaned child never lingers.

An engine with a step sink (``set_step_sink`` / ``submit`` / ``cancel``, as the
llama.cpp engine has) hands each decode step's chunks to the sink on its decode
thread, which writes them to the gateway as one frame right there: a token crosses
no event loop in this process. Other engines are driven through the plain
``generate()`` interface on the event loop. Either way every frame goes through
one :class:`FrameWriter`, so frames from both threads never interleave.
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
from typing import Any

from tokenmill.engines import Engine, load_engine_class
from tokenmill.engines.base import (
    Chunk,
    GenerationRequest,
    SteppedEngine,
    StepSink,
    TokenizingEngine,
)
from tokenmill.errors import EngineError, InvalidRequestError
from tokenmill.gateway.process import (
    decode_request,
    decode_tokenize,
    encode_error,
    encode_frame,
    encode_logprobs,
    encode_usage,
    read_frame,
)

log = logging.getLogger("tokenmill.gateway.runner")

# Health is pushed to the gateway at most this often, and only when it changed.
STATUS_INTERVAL_S = 0.25


class FrameWriter:
    """Whole frames to the gateway, from any thread.

    The socket stays non-blocking (asyncio reads it); a write that finds the buffer
    full waits for room with ``select``. Once the gateway is gone, writes are dropped:
    the read side sees EOF and the process exits.
    """

    def __init__(self, sock: socket.socket) -> None:
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


def chunk_row(rid: str, chunk: Chunk) -> list[Any]:
    usage = encode_usage(chunk.usage)
    logprobs = encode_logprobs(chunk.logprobs)
    return [rid, chunk.text, chunk.finish_reason, usage, chunk.tokens, logprobs]


class Outbox:
    """Chunks produced in one decode step leave together, in one frame.

    The engine wakes every stream of a step in one event-loop callback; each
    stream's task appends its chunk here, and the flush scheduled by the first
    one runs after all of them.
    """

    def __init__(self, writer: FrameWriter) -> None:
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


class Runner:
    def __init__(self, engine: Engine, out: Outbox) -> None:
        self.engine = engine
        self.out = out
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.finished: set[str] = set()

    def status(self) -> dict[str, Any]:
        h = self.engine.health()
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
            # probe kills a child whose engine hangs in native code.
            "stalled_s": int(stalled) if isinstance(stalled, int | float) else 0,
            "context_length": (
                self.engine.context_length() if isinstance(self.engine, TokenizingEngine) else None
            ),
        }

    async def push_status(self) -> None:
        last: dict[str, Any] | None = None
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            s = self.status()
            if s != last:
                self.out.send({"op": "status", "status": s})
                last = s

    async def prepare(self, req: GenerationRequest) -> None:
        try:
            info = await self.engine.prepare(req)
        except Exception as e:
            self.out.send({"op": "error", "id": req.request_id, "error": encode_error(e)})
            return
        self.out.send(
            {
                "op": "prepared",
                "id": req.request_id,
                "prompt_tokens": info.prompt_tokens,
                "context_length": info.context_length,
            }
        )

    async def answer(self, msg: dict[str, Any]) -> None:
        """A ``tokenize`` or ``detokenize`` frame, answered by its id."""
        call_id = msg["id"]
        try:
            if not isinstance(self.engine, TokenizingEngine):
                raise InvalidRequestError(
                    f"the {self.engine.name} engine has no tokenizer", param="model"
                )
            if msg["op"] == "tokenize":
                tokens = await self.engine.tokenize(decode_tokenize(msg["req"]))
                answer: dict[str, Any] = {"tokens": tokens}
            else:
                answer = {"text": await self.engine.detokenize(msg["tokens"])}
        except Exception as e:
            self.out.send({"op": "error", "id": call_id, "error": encode_error(e)})
            return
        self.out.send({"op": "answer", "id": call_id, **answer})

    async def generate(self, req: GenerationRequest) -> None:
        rid = req.request_id
        try:
            async for chunk in self.engine.generate(req):
                self.out.chunk(rid, chunk)
                if chunk.finish_reason is not None:
                    self.finished.add(rid)
                    return
            raise EngineError("the engine ended the stream without finishing it")
        except asyncio.CancelledError:
            return  # aborted: abort() reports the final usage
        except Exception as e:
            self.finished.add(rid)
            self.out.send({"op": "error", "id": rid, "error": encode_error(e)})

    async def abort(self, rid: str, task: asyncio.Task[None]) -> None:
        task.cancel()
        await asyncio.wait([task])
        self.tasks.pop(rid, None)
        if rid in self.finished:
            self.finished.discard(rid)
            return  # it finished on its own; the gateway has its final chunk
        # The engine counts what it really produced; that is what gets billed.
        usage = await self.engine.abort(rid)
        self.out.chunk(rid, Chunk("", "abort", usage))

    def start_generate(self, req: GenerationRequest) -> None:
        rid = req.request_id
        task = asyncio.create_task(self.generate(req))
        self.tasks[rid] = task

        def done(_: asyncio.Task[None]) -> None:
            if self.tasks.get(rid) is task and rid in self.finished:
                self.tasks.pop(rid, None)
                self.finished.discard(rid)

        task.add_done_callback(done)


def step_sink(writer: FrameWriter) -> StepSink:
    """The engine's step sink: one ``chunks`` frame per step, then any errors."""

    def sink(events: list[tuple[str, Chunk | BaseException]]) -> None:
        rows = [chunk_row(rid, item) for rid, item in events if isinstance(item, Chunk)]
        if rows:
            writer.send({"op": "chunks", "c": rows})
        for rid, item in events:
            if not isinstance(item, Chunk):
                writer.send({"op": "error", "id": rid, "error": encode_error(item)})

    return sink


async def serve(fd: int, engine_name: str, kwargs: dict[str, Any]) -> int:
    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    frames = FrameWriter(sock)
    out = Outbox(frames)
    engine: Engine = load_engine_class(engine_name)(**kwargs)
    try:
        await engine.start()
    except Exception as e:
        log.error("the engine failed to load: %s", e)
        out.send({"op": "fatal", "message": str(e)})
        return 1
    runner = Runner(engine, out)
    stepped = engine if isinstance(engine, SteppedEngine) else None
    if stepped is not None:
        stepped.set_step_sink(step_sink(frames))
    out.send({"op": "ready", "status": runner.status()})
    status_task = asyncio.create_task(runner.push_status())
    aborts: set[asyncio.Task[None]] = set()
    try:
        while True:
            msg = await read_frame(reader)
            if msg is None or msg["op"] == "close":
                break
            op = msg["op"]
            if op == "generate" and stepped is not None:
                req = decode_request(msg["req"])
                try:
                    stepped.submit(req)
                except Exception as e:
                    out.send({"op": "error", "id": req.request_id, "error": encode_error(e)})
            elif op == "abort" and stepped is not None:
                stepped.cancel(msg["id"])
            elif op == "generate":
                runner.start_generate(decode_request(msg["req"]))
            elif op == "abort":
                rid = msg["id"]
                task = runner.tasks.get(rid)
                if task is not None:
                    t = asyncio.create_task(runner.abort(rid, task))
                    aborts.add(t)
                    t.add_done_callback(aborts.discard)
            elif op == "prepare":
                await runner.prepare(decode_request(msg["req"]))
            elif op in ("tokenize", "detokenize"):
                await runner.answer(msg)
            elif op == "ping":
                out.send({"op": "pong", "status": runner.status()})
    finally:
        status_task.cancel()
        for task in list(runner.tasks.values()):
            task.cancel()
        await engine.close()
        out.flush()
        with contextlib.suppress(Exception):
            writer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill.gateway.runner")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--kwargs", default="{}")
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
    return asyncio.run(serve(args.fd, args.engine, json.loads(args.kwargs)))


if __name__ == "__main__":
    sys.exit(main())
