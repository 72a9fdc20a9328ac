"""The frames a replica and its gateway exchange, whatever carries them.

A replica that runs outside the gateway's process (a child process, a Ray actor) and
the gateway talk in frames: JSON objects with an ``op``, over a stream socket (a
process's socket pair, a Ray actor's TCP connection), each length-prefixed (4-byte
big-endian length, then UTF-8 JSON). Requests are multiplexed by request id. The
replica batches every chunk its engine produced in one decode step into one
``chunks`` frame, so the per-token cost is one small frame per step shared by all
running streams, not one message per token.

Frames, gateway -> replica: ``hello`` (the first on a Ray actor's connection: the
secret the gateway gave the actor, :mod:`tokenmill.replicas.rayactor`), ``prepare``,
``generate``, ``abort`` (by id: the one way to stop a request, answered by its final
``abort`` chunk), ``tokenize``, ``detokenize``, ``tokenizer_info``, ``embed_prepare``,
``embed``, ``kv_export``, ``kv_import``, ``kv_held`` (by call id), ``ping``, ``close``.
Replica -> gateway:
``ready`` / ``fatal`` (start-up), ``prepared``, ``chunks``, ``answer`` (to a
call: ``tokenize`` to ``kv_import``), ``error`` (by id), ``status`` (the health
snapshot, pushed when it changes), ``pong``, and from an engine that publishes its KV cache
(:mod:`tokenmill.kvblocks`): ``kv_all`` (every slot's block names, after ``ready``)
then ``kv`` (one slot's change). A frame may carry a ``blob`` of raw bytes after its
JSON (a sequence's KV state, moved between replicas: ``kv_export``'s answer and
``kv_import``), its length in the JSON's ``blob``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import struct
from typing import Any

from tokenmill import errors
from tokenmill.engines import (
    ChatMessage,
    Chunk,
    Constraint,
    EmbeddingRequest,
    GenerationRequest,
    SamplingParams,
    TokenizeRequest,
    TokenizerInfo,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    TopLogprob,
    Usage,
)
from tokenmill.errors import EngineError, ServiceError
from tokenmill.kvblocks import BlockSnapshot, BlockUpdate, CacheEvent

HEADER = struct.Struct(">I")


def encode_frame(message: dict[str, Any]) -> bytes:
    """A frame; a ``blob`` of bytes (a KV state) travels raw after the JSON, which
    says its length, not as JSON."""
    blob = message.get("blob")
    if isinstance(blob, bytes | bytearray):
        message = {**message, "blob": len(blob)}
    else:
        blob = b""
    payload = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()
    return HEADER.pack(len(payload)) + payload + blob


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next frame, or None at end of stream (the peer is gone)."""
    try:
        header = await reader.readexactly(HEADER.size)
        (size,) = HEADER.unpack(header)
        payload = await reader.readexactly(size)
        message: dict[str, Any] = json.loads(payload)
        blob = message.get("blob")
        if isinstance(blob, int):
            message["blob"] = await reader.readexactly(blob)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return message


def encode_request(r: GenerationRequest) -> dict[str, Any]:
    sampling = dataclasses.asdict(r.sampling)
    sampling["stop"] = list(r.sampling.stop)
    return {
        "id": r.request_id,
        "s": sampling,
        "p": r.prompt,
        "m": None if r.messages is None else [encode_message(m) for m in r.messages],
        "t": r.chat_template,
        "k": None if r.prompt_tokens is None else list(r.prompt_tokens),
        "ps": None
        if r.prompts is None
        else [p if isinstance(p, str) else list(p) for p in r.prompts],
        "n": r.n,
        "tl": None if r.tools is None else dataclasses.asdict(r.tools),
        "tk": None if r.tokenized is None else [list(p) for p in r.tokenized],
        "bg": r.background,
    }


def encode_message(m: ChatMessage) -> list[Any]:
    """``[role, content]``, and the turn's tool calls and call id when it has them."""
    if not (m.tool_calls or m.tool_call_id):
        return [m.role, m.content]
    calls = [[c.id, c.name, c.arguments] for c in m.tool_calls]
    return [m.role, m.content, calls, m.tool_call_id]


def decode_message(row: list[Any]) -> ChatMessage:
    role, content, *tool = row
    if not tool:
        return ChatMessage(role, content)
    calls, call_id = tool
    return ChatMessage(role, content, tuple(ToolCall(*c) for c in calls), call_id)


def encode_tokenize(r: TokenizeRequest) -> dict[str, Any]:
    messages = None if r.messages is None else [[m.role, m.content] for m in r.messages]
    return {
        "p": r.prompt,
        "m": messages,
        "t": r.chat_template,
        "g": r.add_generation_prompt,
        "s": r.add_special_tokens,
    }


def decode_tokenize(d: dict[str, Any]) -> TokenizeRequest:
    messages = d["m"]
    return TokenizeRequest(
        prompt=d["p"],
        messages=None if messages is None else tuple(ChatMessage(r, c) for r, c in messages),
        chat_template=d["t"],
        add_generation_prompt=bool(d["g"]),
        add_special_tokens=bool(d["s"]),
    )


def encode_tokenizer_info(info: TokenizerInfo) -> dict[str, Any]:
    return dataclasses.asdict(info)


def decode_tokenizer_info(d: dict[str, Any]) -> TokenizerInfo:
    def text(v: Any) -> str | None:
        return None if v is None else str(v)

    return TokenizerInfo(
        tokenizer_class=str(d["tokenizer_class"]),
        eos_token=text(d["eos_token"]),
        bos_token=text(d["bos_token"]),
        pad_token=text(d["pad_token"]),
        chat_template=text(d["chat_template"]),
        model_max_length=int(d["model_max_length"]),
    )


# An embedding request: text inputs as strings, token-id inputs as lists.
def encode_embedding(r: EmbeddingRequest) -> dict[str, Any]:
    inputs = [x if isinstance(x, str) else list(x) for x in r.inputs]
    return {"id": r.request_id, "i": inputs, "d": r.dimensions}


def decode_embedding(d: dict[str, Any]) -> EmbeddingRequest:
    inputs = tuple(x if isinstance(x, str) else tuple(int(t) for t in x) for x in d["i"])
    return EmbeddingRequest(request_id=d["id"], inputs=inputs, dimensions=d["d"])


def decode_request(d: dict[str, Any]) -> GenerationRequest:
    s = dict(d["s"])
    s["stop"] = tuple(s["stop"])
    s["logit_bias"] = tuple((int(t), float(b)) for t, b in s["logit_bias"])
    constraint = s.get("constraint")
    s["constraint"] = None if constraint is None else Constraint(**constraint)
    messages = d["m"]
    tokens = d.get("k")
    prompts = d.get("ps")
    tokenized = d.get("tk")
    return GenerationRequest(
        request_id=d["id"],
        sampling=SamplingParams(**s),
        prompt=d["p"],
        messages=None if messages is None else tuple(decode_message(m) for m in messages),
        chat_template=d["t"],
        prompt_tokens=None if tokens is None else tuple(int(t) for t in tokens),
        prompts=None
        if prompts is None
        else tuple(p if isinstance(p, str) else tuple(int(t) for t in p) for p in prompts),
        n=int(d.get("n", 1)),
        tools=None if d.get("tl") is None else ToolSpec(**d["tl"]),
        tokenized=None if tokenized is None else tuple(tuple(p) for p in tokenized),
        background=bool(d.get("bg", False)),
    )


def encode_cache_event(event: CacheEvent) -> dict[str, Any]:
    if isinstance(event, BlockSnapshot):
        frame: dict[str, Any] = {"op": "kv_all", "c": [list(names) for names in event.slots]}
        frame["n"] = event.n_slots
        if event.disk:
            frame["d"] = list(event.disk)
        return frame
    update: dict[str, Any] = {"op": "kv", "s": event.slot, "k": event.kept}
    update["a"] = list(event.added)
    if event.disk:
        update["d"] = 1
    return update


def decode_cache_event(msg: dict[str, Any]) -> CacheEvent:
    """A ``kv_all`` or ``kv`` frame."""
    if msg["op"] == "kv_all":
        n_slots = msg.get("n")
        return BlockSnapshot(
            tuple(tuple(int(n) for n in names) for names in msg["c"]),
            None if n_slots is None else int(n_slots),
            tuple(int(lane) for lane in msg.get("d", ())),
        )
    added = tuple(int(n) for n in msg["a"])
    return BlockUpdate(int(msg["s"]), int(msg["k"]), added, bool(msg.get("d")))


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
    if isinstance(e, ServiceError):
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


def decode_error(d: dict[str, Any]) -> ServiceError:
    cls = getattr(errors, str(d.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, ServiceError)):
        cls = EngineError
    message = str(d.get("message", "the replica failed"))
    if cls is errors.OverloadedError:
        return errors.OverloadedError(
            message, retry_after=float(d.get("retry_after", 1.0)), code=d.get("code")
        )
    return cls(message, param=d.get("param"), code=d.get("code"))


def chunk_row(rid: str, chunk: Chunk) -> list[Any]:
    """One row of a ``chunks`` frame: ``[rid, text, finish, usage, tokens, logprobs]``,
    then, only when needed, ``index, choice_finish``, then ``tool_calls``, then the
    matched ``stop_sequence`` (rows without the later fields stay short; a decoder
    reads any of these lengths)."""
    usage = encode_usage(chunk.usage)
    logprobs = encode_logprobs(chunk.logprobs)
    row = [rid, chunk.text, chunk.finish_reason, usage, chunk.tokens, logprobs]
    stop = chunk.stop_sequence
    if chunk.index or chunk.choice_finish or chunk.tool_calls or stop is not None:
        row += [chunk.index, chunk.choice_finish]
    if chunk.tool_calls or stop is not None:
        row.append([[c.index, c.id, c.name, c.arguments] for c in chunk.tool_calls])
    if stop is not None:
        row.append(stop)
    return row


def decode_chunk_row(row: list[Any]) -> tuple[str, Chunk]:
    rid, text, reason, usage, tokens, logprobs, *more = row
    index, choice_finish, *rest = more or (0, None)
    calls = rest[0] if rest else None
    stop = rest[1] if len(rest) > 1 else None
    tool_calls = tuple(ToolCallDelta(*c) for c in calls) if calls else ()
    chunk = Chunk(
        text,
        reason,
        decode_usage(usage),
        tokens,
        decode_logprobs(logprobs),
        index,
        choice_finish,
        tool_calls,
        stop,
    )
    return rid, chunk
