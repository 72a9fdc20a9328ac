"""Process replicas: an engine running in a supervised child process.

:class:`ProcessEngine` implements the :class:`~tokenmill.engines.base.Engine`
interface by forwarding every call to a real engine (``LlamaCppEngine``) that runs
in ``python -m tokenmill.gateway.runner``. A crash in native code (a segfault in
llama.cpp, an OOM kill) takes down that child only: its in-flight requests fail at
once with :class:`EngineError` and the child is restarted with exponential backoff.

IPC is one ``socketpair`` per child carrying length-prefixed JSON frames (4-byte
big-endian length, then UTF-8 JSON). Requests are multiplexed by request id. The
child batches every chunk the engine produced in one decode step into one
``chunks`` frame, so the per-token cost is one small frame per step shared by all
running streams, not one round trip per token.

Frames, gateway -> child: ``prepare``, ``generate``, ``abort`` (by id),
``tokenize``, ``detokenize`` (by id), ``ping``, ``close``. Child -> gateway:
``ready`` / ``fatal`` (start-up), ``prepared``, ``chunks``, ``answer`` (to a
``tokenize`` or ``detokenize``), ``error`` (by id), ``status`` (the health
snapshot, pushed when it changes), ``pong``.

Health: a child can be alive yet wedged (a native call that never returns, a
stopped process). The gateway pings it every ``probe_interval_s``; a child whose
last answer is older than ``probe_timeout_s``, or whose engine reports one decode
step running longer than that, is killed, and handled like any other death.

Priority: with ``replica_nice`` above 0 the child lowers its own priority before it
starts a thread, so every thread of the engine inherits it. The default is 0: a
niced replica yields the cores not only to the gateway but to every busy process on
the host, and starves (see ``DeploymentConfig.replica_nice``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
import struct
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill import errors
from tokenmill.engines.base import (
    ChatMessage,
    Chunk,
    EngineHealth,
    GenerationRequest,
    PromptInfo,
    SamplingParams,
    TokenizeRequest,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from tokenmill.engines.chunks import ChunkQueue, ChunkReader
from tokenmill.errors import EngineError, TokenmillError

log = logging.getLogger("tokenmill.gateway.process")

HEADER = struct.Struct(">I")
# A child that has not loaded its model after this long is considered wedged.
START_TIMEOUT_S = 300.0
# Restart backoff: 0.5 s, 1 s, 2 s, ... capped; reset once a child stayed up a while.
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0
# An abort is answered within a decode step; this guards against a wedged child.
ABORT_WAIT_S = 10.0
CLOSE_WAIT_S = 10.0
# Health probe defaults (per deployment: health_check_interval_s / _timeout_s).
PROBE_INTERVAL_S = 5.0
PROBE_TIMEOUT_S = 30.0


# -- wire format (shared with runner.py) ------------------------------------------


def encode_frame(message: dict[str, Any]) -> bytes:
    payload = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()
    return HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next frame, or None at end of stream (the peer is gone)."""
    try:
        header = await reader.readexactly(HEADER.size)
        (size,) = HEADER.unpack(header)
        payload = await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    message: dict[str, Any] = json.loads(payload)
    return message


def encode_request(r: GenerationRequest) -> dict[str, Any]:
    sampling = dataclasses.asdict(r.sampling)
    sampling["stop"] = list(r.sampling.stop)
    return {
        "id": r.request_id,
        "s": sampling,
        "p": r.prompt,
        "m": None if r.messages is None else [[m.role, m.content] for m in r.messages],
        "t": r.chat_template,
        "k": None if r.prompt_tokens is None else list(r.prompt_tokens),
    }


def encode_tokenize(r: TokenizeRequest) -> dict[str, Any]:
    messages = None if r.messages is None else [[m.role, m.content] for m in r.messages]
    return {"p": r.prompt, "m": messages, "t": r.chat_template, "g": r.add_generation_prompt}


def decode_tokenize(d: dict[str, Any]) -> TokenizeRequest:
    messages = d["m"]
    return TokenizeRequest(
        prompt=d["p"],
        messages=None if messages is None else tuple(ChatMessage(r, c) for r, c in messages),
        chat_template=d["t"],
        add_generation_prompt=bool(d["g"]),
    )


def decode_request(d: dict[str, Any]) -> GenerationRequest:
    s = dict(d["s"])
    s["stop"] = tuple(s["stop"])
    s["logit_bias"] = tuple((int(t), float(b)) for t, b in s["logit_bias"])
    messages = d["m"]
    tokens = d.get("k")
    return GenerationRequest(
        request_id=d["id"],
        sampling=SamplingParams(**s),
        prompt=d["p"],
        messages=None if messages is None else tuple(ChatMessage(r, c) for r, c in messages),
        chat_template=d["t"],
        prompt_tokens=None if tokens is None else tuple(int(t) for t in tokens),
    )


def encode_usage(u: Usage | None) -> list[int] | None:
    return None if u is None else [u.prompt_tokens, u.completion_tokens, u.cached_tokens]


def decode_usage(u: list[int] | None) -> Usage | None:
    return None if u is None else Usage(u[0], u[1], u[2])


# Token bytes travel as latin-1 text: one character a byte, valid JSON, no base64.
def encode_logprobs(tokens: tuple[TokenLogprob, ...]) -> list[Any] | None:
    if not tokens:
        return None
    return [
        [
            t.piece.decode("latin-1"),
            t.logprob,
            t.offset,
            [[top.piece.decode("latin-1"), top.logprob] for top in t.top],
        ]
        for t in tokens
    ]


def decode_logprobs(rows: list[Any] | None) -> tuple[TokenLogprob, ...]:
    if not rows:
        return ()
    return tuple(
        TokenLogprob(
            piece.encode("latin-1"),
            logprob,
            offset,
            tuple(TopLogprob(p.encode("latin-1"), lp) for p, lp in top),
        )
        for piece, logprob, offset, top in rows
    )


def encode_error(e: BaseException) -> dict[str, Any]:
    if isinstance(e, TokenmillError):
        out: dict[str, Any] = {
            "type": type(e).__name__,
            "message": e.message,
            "param": e.param,
            "code": e.code,
        }
        retry_after = getattr(e, "retry_after", None)
        if retry_after is not None:
            out["retry_after"] = retry_after
        return out
    return {"type": "EngineError", "message": f"the replica failed: {type(e).__name__}: {e}"}


def decode_error(d: dict[str, Any]) -> TokenmillError:
    cls = getattr(errors, str(d.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, TokenmillError)):
        cls = EngineError
    message = str(d.get("message", "the replica failed"))
    if cls is errors.OverloadedError:
        return errors.OverloadedError(
            message, retry_after=float(d.get("retry_after", 1.0)), code=d.get("code")
        )
    return cls(message, param=d.get("param"), code=d.get("code"))


# -- the gateway side ---------------------------------------------------------------


@dataclass(eq=False)
class _Pending:
    queue: ChunkQueue
    final: asyncio.Future[Usage | None]
    abort_sent: bool = False


@dataclass(eq=False)
class _Child:
    """One incarnation of the child process and its connection."""

    proc: asyncio.subprocess.Process
    writer: asyncio.StreamWriter
    reader: asyncio.StreamReader
    started: float = field(default_factory=time.monotonic)
    pending: dict[str, _Pending] = field(default_factory=dict)
    prepares: dict[str, asyncio.Future[PromptInfo]] = field(default_factory=dict)
    # tokenize / detokenize calls waiting for their ``answer`` frame, by call id.
    calls: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    lost: bool = False
    answered: float = field(default_factory=time.monotonic)  # last frame received

    def send(self, message: dict[str, Any]) -> None:
        if self.lost or self.writer.is_closing():
            raise EngineError("the replica process is gone; retry the request")
        self.writer.write(encode_frame(message))


class ProcessEngine:
    """An engine in a supervised child process. See the module docstring."""

    def __init__(
        self,
        engine: str,
        kwargs: dict[str, Any],
        *,
        probe_interval_s: float = PROBE_INTERVAL_S,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        nice: int = 0,
    ) -> None:
        self.engine_name = engine
        self.nice = nice
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.name = f"process:{engine}"
        # Paths and the like travel as JSON: the child rebuilds them from strings.
        self.kwargs = {
            k: (str(v) if v is not None and not _is_json(v) else v) for k, v in kwargs.items()
        }
        self.restarts = 0
        self._child: _Child | None = None
        self._ready = False
        self._state = "unloaded"
        self._status: dict[str, Any] = {}
        self._slots = int(kwargs.get("max_num_seqs") or 1)
        self._supervisor: asyncio.Task[None] | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self._watchers: list[Callable[[], None]] = []
        self._lost = asyncio.Event()
        self._closing = False
        self._lock = asyncio.Lock()
        self._calls = 0  # tokenize / detokenize calls sent, for their ids

    # -- properties -------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        child = self._child
        return None if child is None or child.lost else child.proc.pid

    @property
    def state(self) -> str:
        """``loading`` / ``ready`` / ``unhealthy`` (dead, restart pending) / ``unloaded``."""
        return self._state

    def health(self) -> EngineHealth:
        s = self._status
        return EngineHealth(
            ready=self._ready,
            slots=self._slots,
            running=int(s.get("running", 0)),
            waiting=int(s.get("waiting", 0)),
            tokens_generated=int(s.get("tokens_generated", 0)),
            kv_cache_usage=float(s.get("kv_cache_usage", 0.0)),
            threads=s.get("threads"),
            detail={"pid": self.pid, "restarts": self.restarts},
        )

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever the replica becomes ready or stops being ready."""
        self._watchers.append(callback)

    def _set_ready(self, ready: bool) -> None:
        changed = ready != self._ready
        self._ready = ready
        if changed:
            for callback in self._watchers:
                callback()

    # -- lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        async with self._lock:
            if self._supervisor is not None and not self._supervisor.done():
                return
            self._closing = False
            await self._spawn()
            self._supervisor = asyncio.create_task(self._supervise())

    async def close(self) -> None:
        async with self._lock:
            self._closing = True
            if self._supervisor is not None:
                self._supervisor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._supervisor
                self._supervisor = None
            child = self._child
            self._set_ready(False)
            if child is not None:
                with contextlib.suppress(Exception):
                    child.send({"op": "close"})
                try:
                    await asyncio.wait_for(child.proc.wait(), CLOSE_WAIT_S)
                except TimeoutError:
                    log.warning("replica process %d did not exit; killing it", child.proc.pid)
                    child.proc.kill()
                    await child.proc.wait()
                self._fail_child(child, EngineError("the replica is shutting down"))
                for task in (self._reader_task, self._probe_task):
                    if task is not None:
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
                self._child = None
            self._state = "unloaded"

    async def _spawn(self) -> None:
        """Start a child and wait until its engine is loaded; raise if it is not."""
        self._state = "loading"
        parent_sock, child_sock = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tokenmill.gateway.runner",
                "--fd",
                str(child_sock.fileno()),
                "--engine",
                self.engine_name,
                "--kwargs",
                json.dumps(self.kwargs),
                "--log-level",
                logging.getLevelName(logging.getLogger().getEffectiveLevel()),
                "--nice",
                str(self.nice),
                pass_fds=(child_sock.fileno(),),
            )
        except BaseException:
            parent_sock.close()
            self._state = "unhealthy"
            raise
        finally:
            # Only the child may hold its end: its death must read as EOF here.
            child_sock.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent_sock)
        child = _Child(proc, writer, reader)
        try:
            first = await asyncio.wait_for(read_frame(reader), START_TIMEOUT_S)
        except TimeoutError:
            first = {"op": "fatal", "message": f"not loaded after {START_TIMEOUT_S:g}s"}
        except BaseException:  # cancelled (closed while loading): leave no orphan
            writer.close()
            proc.kill()
            await asyncio.shield(proc.wait())
            self._state = "unloaded"
            raise
        if first is None or first.get("op") != "ready":
            reason = "exited" if first is None else str(first.get("message"))
            writer.close()
            if proc.returncode is None:
                proc.kill()
            code = await proc.wait()
            self._state = "unhealthy"
            raise EngineError(f"the replica process failed to start ({reason}; exit {code})")
        self._status = dict(first.get("status") or {})
        self._slots = int(self._status.get("slots", self._slots))
        self._child = child
        self._lost.clear()
        self._reader_task = asyncio.create_task(self._read_loop(child))
        self._probe_task = asyncio.create_task(self._probe(child))
        self._state = "ready"
        self._set_ready(True)
        log.info("replica process %d ready (%s)", proc.pid, self.engine_name)

    async def _supervise(self) -> None:
        backoff = BACKOFF_INITIAL_S
        while not self._closing:
            await self._lost.wait()
            if self._closing:
                return
            child = self._child
            if child is not None:
                if time.monotonic() - child.started > STABLE_AFTER_S:
                    backoff = BACKOFF_INITIAL_S
                code = await child.proc.wait()
                log.error(
                    "replica process %d died (exit %s); restarting in %.1fs",
                    child.proc.pid,
                    code,
                    backoff,
                )
            while not self._closing:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                self.restarts += 1
                try:
                    await self._spawn()
                    break
                except Exception as e:
                    log.error("restarting the replica failed: %s", e)

    async def _probe(self, child: _Child) -> None:
        """Kill the child when it stops answering pings or a decode step hangs."""
        while not child.lost:
            await asyncio.sleep(self.probe_interval_s)
            if child.lost:
                return
            silent = time.monotonic() - child.answered
            stalled = float(self._status.get("stalled_s", 0.0))
            if silent > self.probe_timeout_s or stalled > self.probe_timeout_s:
                what = f"silent for {silent:.1f}s" if silent > stalled else "decode stalled"
                log.error(
                    "replica process %d is wedged (%s; limit %gs); killing it",
                    child.proc.pid,
                    what,
                    self.probe_timeout_s,
                )
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
                return
            with contextlib.suppress(EngineError):
                child.send({"op": "ping"})

    async def _read_loop(self, child: _Child) -> None:
        pending = child.pending
        try:
            while True:
                msg = await read_frame(child.reader)
                if msg is None:
                    break
                child.answered = time.monotonic()
                op = msg["op"]
                if op == "chunks":
                    for rid, text, reason, usage, tokens, logprobs in msg["c"]:
                        p = pending.get(rid)
                        if p is None:
                            continue
                        u = decode_usage(usage)
                        lps = decode_logprobs(logprobs)
                        p.queue.put_nowait(Chunk(text, reason, u, tokens, lps))
                        # It stays pending until its reader is done with it: a reader
                        # that left before this last chunk asks abort() for the usage.
                        if reason is not None and not p.final.done():
                            p.final.set_result(u)
                elif op in ("status", "pong"):
                    self._status = msg["status"]
                elif op == "prepared":
                    fut = child.prepares.pop(msg["id"], None)
                    if fut is not None and not fut.done():
                        fut.set_result(PromptInfo(msg["prompt_tokens"], msg["context_length"]))
                elif op == "answer":
                    cfut = child.calls.pop(msg["id"], None)
                    if cfut is not None and not cfut.done():
                        cfut.set_result(msg)
                elif op == "error":
                    rid = msg["id"]
                    err = decode_error(msg["error"])
                    cfut = child.calls.pop(rid, None)
                    if cfut is not None and not cfut.done():
                        cfut.set_exception(err)
                    pfut = child.prepares.pop(rid, None)
                    if pfut is not None and not pfut.done():
                        pfut.set_exception(err)
                    p = pending.pop(rid, None)
                    if p is not None:
                        p.queue.put_nowait(err)
                        if not p.final.done():
                            p.final.set_result(None)
        except Exception:
            log.exception("reading from replica process %d failed", child.proc.pid)
        finally:
            # EOF: the child died (or is closing). Nothing it had will ever answer.
            if child is self._child:
                if not self._closing:
                    self._state = "unhealthy"
                self._set_ready(False)
            self._fail_child(
                child, EngineError("the replica process died during the request; retry it")
            )
            self._lost.set()

    def _fail_child(self, child: _Child, err: TokenmillError) -> None:
        child.lost = True
        with contextlib.suppress(Exception):
            child.writer.close()
        for rid, p in list(child.pending.items()):
            p.queue.put_nowait(err)
            if not p.final.done():
                p.final.set_result(None)
            child.pending.pop(rid, None)
        for fut in child.prepares.values():
            if not fut.done():
                fut.set_exception(err)
        child.prepares.clear()
        for call in child.calls.values():
            if not call.done():
                call.set_exception(err)
        child.calls.clear()

    # -- requests ---------------------------------------------------------------

    def _live_child(self) -> _Child:
        child = self._child
        if child is None or child.lost or not self._ready:
            raise EngineError("the replica process is restarting; retry the request")
        return child

    async def prepare(self, request: GenerationRequest) -> PromptInfo:
        child = self._live_child()
        fut: asyncio.Future[PromptInfo] = asyncio.get_running_loop().create_future()
        child.prepares[request.request_id] = fut
        try:
            child.send({"op": "prepare", "req": encode_request(request)})
            return await fut
        finally:
            child.prepares.pop(request.request_id, None)

    async def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send a ``tokenize`` / ``detokenize`` frame and wait for its ``answer``."""
        child = self._live_child()
        self._calls += 1
        call_id = f"call-{self._calls}"
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        child.calls[call_id] = fut
        try:
            child.send({**message, "id": call_id})
            return await fut
        finally:
            child.calls.pop(call_id, None)

    async def tokenize(self, request: TokenizeRequest) -> list[int]:
        answer = await self._call({"op": "tokenize", "req": encode_tokenize(request)})
        return [int(t) for t in answer["tokens"]]

    async def detokenize(self, tokens: Sequence[int]) -> str:
        answer = await self._call({"op": "detokenize", "tokens": list(tokens)})
        return str(answer["text"])

    def context_length(self) -> int:
        # The child reports its engine's in every status frame.
        return int(self._status.get("context_length") or self.kwargs.get("n_ctx") or 0)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        child = self._live_child()
        rid = request.request_id
        loop = asyncio.get_running_loop()
        p = _Pending(asyncio.Queue(), loop.create_future())
        child.pending[rid] = p
        try:
            child.send({"op": "generate", "req": encode_request(request)})
        except BaseException:
            child.pending.pop(rid, None)
            raise
        reader = ChunkReader(p.queue)
        try:
            async for chunk in reader:
                yield chunk
        finally:
            if reader.finished:
                child.pending.pop(rid, None)
            else:  # the caller must call abort(), which also forgets the request
                self._send_abort(child, rid, p)

    def _send_abort(self, child: _Child, rid: str, p: _Pending) -> None:
        if p.abort_sent or p.final.done():
            return
        p.abort_sent = True
        # If the child is gone, _fail_child settles the request instead.
        with contextlib.suppress(EngineError):
            child.send({"op": "abort", "id": rid})

    async def abort(self, request_id: str) -> Usage | None:
        child = self._child
        p = None if child is None else child.pending.get(request_id)
        if child is None or p is None:
            return None
        self._send_abort(child, request_id, p)
        try:
            return await asyncio.wait_for(asyncio.shield(p.final), ABORT_WAIT_S)
        except TimeoutError:
            log.error("request %s did not stop within %ss", request_id, ABORT_WAIT_S)
            return None
        finally:
            child.pending.pop(request_id, None)


def _is_json(v: Any) -> bool:
    return isinstance(v, str | int | float | bool | list | dict)


__all__ = [
    "ProcessEngine",
    "decode_error",
    "decode_logprobs",
    "decode_request",
    "decode_tokenize",
    "decode_usage",
    "encode_error",
    "encode_frame",
    "encode_logprobs",
    "encode_request",
    "encode_tokenize",
    "encode_usage",
    "read_frame",
]
