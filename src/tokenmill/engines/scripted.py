"""A test engine whose every step is driven from outside: ``engine = "scripted"``.

Admission, queueing, timeouts, cancellation, the replica supervisor and metering
are tested by the order of events, not by how fast a model runs: a test must be able
to say "now emit 3 tokens to this request", "now fail it", "now crash the replica"
and see "this request started", "this request was aborted". :class:`ScriptedEngine`
keeps the :class:`~tokenmill.engines.base.Engine` contract (usage on the final
chunk, ``tokens`` counts, ``max_tokens`` a hard limit, ``cancel`` ends the stream
with the tokens really produced) and generates nothing by itself: each request waits for commands
from a *driver*, a test listening on the Unix socket named by the deployment's
``control`` key.

It is not in the :data:`~tokenmill.engines.ENGINES` name table and must never serve
real traffic: only a deployment that says ``engine = "scripted"`` with ``control``
(or the class path ``tokenmill.engines.scripted:ScriptedEngine``) reaches it.

Every engine instance (the one in the gateway, or one in each replica process, and
again after a restart) opens its own connection to ``control`` when it starts.
Messages are JSON objects, one per line.

Engine -> driver (events)::

    {"event": "hello", "pid": P}                     connected; once per instance,
                                                     then it waits for "go"
    {"event": "started", "id": R, "prompt": S, "prompt_tokens": N, "max_tokens": N,
     "constraint": KIND | null,                      its structured output's kind
     "messages": [{"role", "content"}] | null}       the rendered turns, of a chat
    {"event": "aborted", "id": R, "tokens": N}       cancelled before it finished
    {"event": "ended", "id": R, "reason": "stop" | "length" | "error", "tokens": N}
    {"event": "ignored", "id": R, "op": OP}          a command for no running request

Driver -> engine (commands)::

    {"op": "go"}                      the answer to hello: start() returns. Until then
                                      the engine is not ready (a replica process stays
                                      loading), so a test can hold a start or restart
    {"op": "emit", "id": R, "n": N}   N tokens, one chunk each (" w1", " w2", ...); at
                                      max_tokens the request finishes with "length"
    {"op": "say", "id": R, "text": T}    T as one chunk, a token a word (at least
                                      one); cut to the words max_tokens leaves, which
                                      then finishes the request with "length". A
                                      constraint is not enforced: T is the test's to
                                      write as the grammar would (a tool call's JSON)
    {"op": "finish", "id": R, "reason": "stop" | "length"}
    {"op": "finish", "id": R, "stop": S}     the request ends on its stop string S
                                      (``stop_sequence``; S must be one of the
                                      request's ``stop``, else it ends as a plain stop)
    {"op": "eos", "id": R}            the model's end-of-sequence token: one more token,
                                      counted as a real engine counts it but with no
                                      text, and the request finishes with "stop"
    {"op": "fail", "id": R, "message": M}     EngineError mid-stream
    {"op": "stall"}                   the process stops answering anything, as in a
                                      hung native call (replica processes only)
    {"op": "crash", "code": C}        the process exits at once (replica processes only)

A request with no command holds its slot: that is how a test keeps one busy. Prompt
tokens are words: the prompt's (or the rendered messages') whitespace-separated
words. The KV cache in use (``health().kv_cache_usage``) is the running requests'
prompt and generated tokens over ``n_ctx``, as in one unified cache. When the driver
goes away, every running request fails, and a start still waiting for ``go`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.config import ScriptedDeployment
from tokenmill.engines.base import (
    Chunk,
    EngineHealth,
    FinishReason,
    GenerationRequest,
    PromptInfo,
    Usage,
    refuse_choices,
)
from tokenmill.engines.chunks import ChunkStream
from tokenmill.errors import ContextLengthError, EngineError, InvalidRequestError

# A stalled process sleeps in slices this long, forever: only a kill ends it.
STALL_SLICE_S = 3600.0


def prompt_text(request: GenerationRequest) -> str:
    if request.prompt is not None:
        return request.prompt
    if request.prompt_tokens is not None:  # its tokens are words: one word a token
        return " ".join(str(t) for t in request.prompt_tokens)
    assert request.messages is not None
    return "\n".join(f"{m.role}: {m.content}" for m in request.messages)


def count_words(text: str) -> int:
    return len(text.split())


@dataclass(eq=False)
class _Run:
    """One running request and its stream."""

    request: GenerationRequest
    prompt_tokens: int
    max_tokens: int
    stream: ChunkStream
    tokens: int = 0

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.tokens)


class ScriptedEngine:
    """An engine driven over a control socket. See the module docstring."""

    name = "scripted"

    def __init__(self, control: str, max_num_seqs: int = 1, n_ctx: int = 2048) -> None:
        self.control = str(control)
        self.max_num_seqs = max_num_seqs
        self.n_ctx = n_ctx
        self._writer: asyncio.StreamWriter | None = None
        self._commands: asyncio.Task[None] | None = None
        self._runs: dict[str, _Run] = {}
        self._tokens_generated = 0
        self._starting = asyncio.Lock()
        self._started = False
        # Resolved by the driver's "go" (or failed when the driver goes away first).
        self._go: asyncio.Future[None] | None = None

    @classmethod
    def from_config(cls, config: ScriptedDeployment) -> ScriptedEngine:
        return cls(str(config.control), max_num_seqs=config.max_num_seqs, n_ctx=config.n_ctx)

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        async with self._starting:
            if self._started:
                return
            try:
                reader, writer = await asyncio.open_unix_connection(self.control)
            except OSError as e:
                raise EngineError(
                    f"the scripted engine cannot reach its driver at {self.control}: {e}; "
                    "start the driver before the gateway"
                ) from None
            self._writer = writer
            self._go = asyncio.get_running_loop().create_future()
            self._send({"event": "hello", "pid": os.getpid()})
            self._commands = asyncio.create_task(self._read_commands(reader))
            try:
                await self._go
            except BaseException:
                await self.close()  # the next start() connects afresh
                raise
            self._started = True

    async def close(self) -> None:
        if self._commands is not None:
            self._commands.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._commands
            self._commands = None
        self._fail_all("the scripted engine is closing")
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._started = False

    def health(self) -> EngineHealth:
        in_cache = sum(run.prompt_tokens + run.tokens for run in self._runs.values())
        return EngineHealth(
            ready=self._started,
            slots=self.max_num_seqs,
            running=len(self._runs),
            tokens_generated=self._tokens_generated,
            kv_cache_usage=min(1.0, in_cache / self.n_ctx),
        )

    # -- requests -----------------------------------------------------------------

    async def prepare(self, request: GenerationRequest) -> PromptInfo:
        await self.start()
        refuse_choices(request, "the scripted engine")
        if request.sampling.echo:
            raise InvalidRequestError("the scripted engine does not echo", param="echo")
        n_prompt = count_words(prompt_text(request))
        if n_prompt == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        n_max = request.sampling.max_tokens
        if n_prompt + max(n_max, 1) > self.n_ctx:
            raise ContextLengthError(
                f"This model's maximum context length is {self.n_ctx} tokens. However, you "
                f"requested {n_prompt + n_max} tokens ({n_prompt} in the prompt, {n_max} for "
                "the completion). Shorten the prompt or lower max_tokens.",
                param="max_tokens",
            )
        return PromptInfo(prompt_tokens=n_prompt, context_length=self.n_ctx)

    def generate(self, request: GenerationRequest) -> ChunkStream:
        if not self._started:
            raise EngineError("the scripted engine is not started")
        rid = request.request_id
        text = prompt_text(request)
        n_prompt = count_words(text)
        n_max = request.sampling.max_tokens
        stream = ChunkStream(rid, self.cancel)
        run = _Run(request, n_prompt, n_max if n_max > 0 else self.n_ctx - n_prompt, stream)
        self._runs[rid] = run
        self._send(
            {
                "event": "started",
                "id": rid,
                "prompt": text,
                "prompt_tokens": n_prompt,
                "max_tokens": run.max_tokens,
                "constraint": None if (c := request.sampling.constraint) is None else c.kind,
                "messages": None
                if request.messages is None
                else [{"role": m.role, "content": m.content} for m in request.messages],
            }
        )
        return stream

    def cancel(self, request_id: str) -> None:
        run = self._runs.get(request_id)
        if run is not None:
            self._end(run, Chunk("", "abort", run.usage(), run.tokens), "aborted")

    def _run_command(self, run: _Run, command: dict[str, Any]) -> None:
        op = command["op"]
        if op == "emit":
            for _ in range(int(command.get("n", 1))):
                if run.tokens >= run.max_tokens:
                    break
                run.tokens += 1
                self._tokens_generated += 1
                run.stream.put(Chunk(f" w{run.tokens}", tokens=run.tokens))
            if run.tokens >= run.max_tokens:
                self._end(run, Chunk("", "length", run.usage(), run.tokens), "length")
        elif op == "say":
            text = str(command.get("text", ""))
            room = run.max_tokens - run.tokens
            if count_words(text) > room:
                text = " ".join(text.split()[:room])
            n = max(1, count_words(text))
            run.tokens += n
            self._tokens_generated += n
            run.stream.put(Chunk(text, tokens=run.tokens))
            if run.tokens >= run.max_tokens:
                self._end(run, Chunk("", "length", run.usage(), run.tokens), "length")
        elif op == "eos":  # max_tokens not reached yet: emit ended the run there
            run.tokens += 1
            self._tokens_generated += 1
            self._end(run, Chunk("", "stop", run.usage(), run.tokens), "stop")
        elif op == "finish":
            reason: FinishReason = "length" if command.get("reason") == "length" else "stop"
            stop = command.get("stop")
            matched = stop if reason == "stop" and stop in run.request.sampling.stop else None
            final = Chunk("", reason, run.usage(), run.tokens, stop_sequence=matched)
            self._end(run, final, reason)
        else:  # "fail"
            message = str(command.get("message", "the scripted engine failed"))
            self._end(run, EngineError(message), "error")

    def _end(self, run: _Run, final: Chunk | EngineError, how: str) -> None:
        """Put the final item and tell the driver: ``ended`` with a reason, or ``aborted``."""
        rid = run.request.request_id
        if self._runs.pop(rid, None) is None:
            return
        run.stream.put(final)
        if how == "aborted":
            self._send({"event": "aborted", "id": rid, "tokens": run.tokens})
        else:
            self._send({"event": "ended", "id": rid, "reason": how, "tokens": run.tokens})

    # -- the control channel --------------------------------------------------------

    def _send(self, event: dict[str, Any]) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(json.dumps(event).encode() + b"\n")

    async def _read_commands(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            command: dict[str, Any] = json.loads(line)
            op = command["op"]
            if op == "go":
                if self._go is not None and not self._go.done():
                    self._go.set_result(None)
                continue
            if op == "crash":
                os._exit(int(command.get("code", 1)))
            if op == "stall":
                while True:  # blocks the event loop: no frame, no pong, nothing
                    time.sleep(STALL_SLICE_S)  # noqa: ASYNC251 - the point of a stall
            run = self._runs.get(str(command.get("id")))
            if run is None or op not in ("emit", "say", "eos", "finish", "fail"):
                self._send({"event": "ignored", "id": command.get("id"), "op": op})
            else:
                self._run_command(run, command)
        if self._go is not None and not self._go.done():
            self._go.set_exception(
                EngineError("the scripted engine's driver went away before it said go")
            )
        self._fail_all("the scripted engine's driver went away")

    def _fail_all(self, message: str) -> None:
        for run in list(self._runs.values()):
            self._end(run, EngineError(message), "error")


__all__ = ["ScriptedEngine", "count_words", "prompt_text"]
