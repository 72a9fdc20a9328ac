"""A chat generation whose output is the generic tool format, served as OpenAI's
``tool_calls`` (:mod:`tokenmill.server.tools` says how the request was built).

Streamed, each choice's text goes through a :class:`~tokenmill.server.toolcalls.
ToolCallReader` as it arrives: a call goes out once its name is whole, as
``{"index", "id", "type": "function", "function": {"name", "arguments": ""}}``, then
its arguments as ``function.arguments`` fragments the moment they are generated; an
answer goes out as ordinary ``content`` deltas. A choice that called tools ends with
``finish_reason: "tool_calls"`` (``length`` if ``max_tokens`` cut it short). Not
streamed, the same reading gives ``message.tool_calls`` and ``content: null``.

A template that knows tools writes its calls in its own markup (``markup``: Hermes'
``<tool_call>``), read by a :class:`~tokenmill.server.toolcalls.MarkupReader` that
holds back anything that may be a tag, so no markup reaches the content. An upstream
server's calls (``forwarded``) arrive as the chunks' ``tool_calls`` already, with
their ids, and go out in the same shape; its text is the content.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engines.base import Chunk
from tokenmill.errors import TokenmillError
from tokenmill.server.serving import Generation, usage_body
from tokenmill.server.sse import DONE, encode_event
from tokenmill.server.toolcalls import (
    ArgumentsDelta,
    CallOpened,
    ContentDelta,
    MarkupReader,
    ToolCallReader,
    ToolEvent,
)
from tokenmill.server.tools import ToolOutput


def call_id() -> str:
    """A new call's id, in OpenAI's form (``call_`` and 24 characters)."""
    return "call_" + secrets.token_hex(12)


@dataclass
class _Answer:
    """One choice's answer while its text comes in. ``reader`` reads calls out of the
    text; without one (an engine that reports its calls) the text is the content."""

    reader: ToolCallReader | MarkupReader | None
    content: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)  # id, name, argument parts
    finished: bool = False
    reason: str | None = None

    def read(self, events: list[ToolEvent]) -> list[ToolEvent]:
        for e in events:
            if isinstance(e, ContentDelta):
                self.content.append(e.text)
            elif isinstance(e, CallOpened):
                self.calls.append({"id": e.id or call_id(), "name": e.name, "arguments": []})
            else:
                self.calls[e.index]["arguments"].append(e.text)
        return events

    def finish(self, engine_reason: str) -> str:
        """The choice's public finish reason, given the engine's."""
        if engine_reason == "length":
            return "length"
        if engine_reason == "error":
            return "error"
        if self.calls and (self.reader is None or self.reader.complete):
            return "tool_calls"
        return "stop"  # an abort too: OpenAI clients know "stop"

    def take(self, chunk: Chunk) -> list[ToolEvent]:
        """What ``chunk`` adds to the answer."""
        events: list[ToolEvent] = []
        if chunk.text:
            if self.reader is None:
                events.append(ContentDelta(chunk.text))
            else:
                events += self.reader.feed(chunk.text)
        for d in chunk.tool_calls:
            opened = sum(isinstance(e, CallOpened) for e in events)
            if d.index >= len(self.calls) + opened:
                events.append(CallOpened(d.index, d.name or "", d.id))
            if d.arguments:
                events.append(ArgumentsDelta(d.index, d.arguments))
        return events

    def close(self) -> list[ToolEvent]:
        """The choice ended: what its reader still held."""
        self.finished = True
        return [] if self.reader is None else self.reader.close()

    def message(self) -> dict[str, Any]:
        if not self.calls:
            return {"role": "assistant", "content": "".join(self.content)}
        calls = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": "".join(c["arguments"])},
            }
            for c in self.calls
        ]
        text = "".join(self.content)
        return {"role": "assistant", "content": text or None, "tool_calls": calls}


@dataclass
class ToolGeneration(Generation):
    """A chat :class:`Generation` whose answer may be tool calls: read out of the text
    (the generic format, or a template's markup), or reported by the engine
    (``forwarded``: an upstream's)."""

    output: ToolOutput = "generic"

    def _answers(self) -> dict[int, _Answer]:
        def reader() -> ToolCallReader | MarkupReader | None:
            if self.output == "markup":
                return MarkupReader()
            return None if self.output == "forwarded" else ToolCallReader()

        return {i: _Answer(reader()) for i in range(self.choices)}

    def _delta_frame(
        self, index: int, delta: dict[str, Any], finish_reason: str | None = None
    ) -> bytes:
        return self._frame(
            {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        )

    def _frames(self, index: int, answer: _Answer, events: list[ToolEvent]) -> list[bytes]:
        frames = []
        for e in answer.read(events):
            if isinstance(e, ContentDelta):
                delta: dict[str, Any] = {"content": e.text}
            elif isinstance(e, CallOpened):
                call = answer.calls[e.index]
                function = {"name": e.name, "arguments": ""}
                opened = {"index": e.index, "id": call["id"], "type": "function"}
                delta = {"tool_calls": [{**opened, "function": function}]}
            else:
                assert isinstance(e, ArgumentsDelta)
                delta = {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}
            frames.append(self._delta_frame(index, delta))
        return frames

    def _end(self, index: int, answer: _Answer, engine_reason: str) -> list[bytes]:
        frames = self._frames(index, answer, answer.close())
        answer.reason = answer.finish(engine_reason)
        return [*frames, self._delta_frame(index, {}, answer.reason)]

    async def events(self) -> AsyncIterator[bytes]:
        """SSE frames; an error after streaming began becomes an ``error`` event."""
        try:
            answers = self._answers()
            for index in answers:
                yield self._delta_frame(index, {"role": "assistant", "content": ""})
            async for chunk in self.stream:
                index = chunk.index
                answer = answers[index]
                for frame in self._frames(index, answer, answer.take(chunk)):
                    yield frame
                if chunk.choice_finish is not None:
                    for frame in self._end(index, answer, chunk.choice_finish):
                        yield frame
                if chunk.finish_reason is not None:
                    # The request's end: its last choice's, and any still open (an abort).
                    for i in [index, *(i for i in answers if i != index)]:
                        if not answers[i].finished:
                            for frame in self._end(i, answers[i], chunk.finish_reason):
                                yield frame
            if self.include_usage:
                yield encode_event(
                    {
                        "id": self.response_id,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": usage_body(self.stream.usage, self.stream.prompt_tokens),
                    }
                )
        except TokenmillError as e:
            yield encode_event(e.to_openai_body())
        yield DONE

    async def collect(self) -> dict[str, Any]:
        """The whole answer as one ``chat.completion`` body."""
        answers = self._answers()
        async for chunk in self.stream:
            answer = answers[chunk.index]
            answer.read(answer.take(chunk))
            ended = [chunk.index] if chunk.choice_finish is not None else []
            reason = chunk.choice_finish
            if chunk.finish_reason is not None:
                reason = chunk.finish_reason
                ended = [i for i, a in answers.items() if not a.finished]
            for i in ended:
                a = answers[i]
                a.read(a.close())
                a.reason = a.finish(reason or "stop")
        return {
            "id": self.response_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": i, "message": a.message(), "logprobs": None, "finish_reason": a.reason}
                for i, a in answers.items()
            ],
            "usage": usage_body(self.stream.usage, self.stream.prompt_tokens),
        }
