"""The Responses API's streaming events, from the core's neutral events.

:class:`ResponseEncoder` is a small state machine: it takes the events of one
generation (:mod:`tokenmill.chat.events`: text deltas, tool calls opening, their
arguments, their end, the choice's end, the usage) and gives the semantic events
OpenAI's SDK reads, numbered by ``sequence_number`` from 0::

    response.created, response.in_progress
    per output item, in order:
      a message:  response.output_item.added, response.content_part.added,
                  response.output_text.delta..., response.output_text.done,
                  response.content_part.done, response.output_item.done
      a call:     response.output_item.added,
                  response.function_call_arguments.delta...,
                  response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

and ``response.in_progress`` again wherever the stream was quiet a long while
(:meth:`ResponseEncoder.activity`: a long prefill).

The response object builds up as the events go: the non-streamed answer is the same
encoder's :attr:`response` once every event is fed, so a streamed response and an
unstreamed one cannot disagree. An error after streaming began is :meth:`fail`: an
``error`` event, then ``response.failed``. One choice only (the API has no ``n``).
"""

from __future__ import annotations

import secrets
from typing import Any

from tokenmill.chat import (
    ChoiceEnd,
    Event,
    Finished,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from tokenmill.engines import Usage
from tokenmill.errors import ServiceError


def item_id(prefix: str) -> str:
    """A new output item's id (``msg_…``, ``fc_…``), in OpenAI's form."""
    return f"{prefix}_{secrets.token_hex(16)}"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def opening_failed(error: ServiceError) -> dict[str, Any]:
    """The one event of a stream refused after its head went out (it waited behind
    keep-alive pings): no response was created, so there is no ``response.failed``."""
    code = error.code or error.type
    return {
        "type": "error",
        "sequence_number": 0,
        "code": code,
        "message": error.message,
        "param": error.param,
    }


class ResponseEncoder:
    """Neutral events in, Responses events out (see the module docstring).

    ``response`` is the response object as created (``status: "in_progress"``, no
    output yet); the encoder fills its ``output``, ``status``, ``usage`` and, when it
    ends short or fails, ``incomplete_details`` or ``error``.
    """

    def __init__(self, response: dict[str, Any], namespaces: dict[str, str] | None = None) -> None:
        self.response = response
        # function name -> the namespace tool it came from (its calls name it)
        self._namespaces = namespaces or {}
        self.output: list[dict[str, Any]] = response["output"]
        self._sequence = 0
        self._message: dict[str, Any] | None = None  # the message item being written
        self._parts: list[str] = []  # its text so far
        self._call: dict[str, Any] | None = None  # the function call being written
        self._reason: str | None = None

    @property
    def status(self) -> str:
        status: str = self.response["status"]
        return status

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        # Events carry the response as it is now; later changes must not reach them.
        return {**self.response, "output": [dict(i) for i in self.output]}

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def activity(self) -> list[dict[str, Any]]:
        """An event that says the response is under way and changes nothing: the
        response, still ``in_progress``, again. Codex (0.171.0) gives up on a stream
        after 300 s without an event, and an SSE comment (``: ping``) is none."""
        return [self._event("response.in_progress", response=self._snapshot())]

    def feed(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, TextDelta):
            return self._text(event.text)
        if isinstance(event, ToolCallStart):
            return [*self._close_message("completed"), *self._open_call(event)]
        if isinstance(event, ToolCallArguments):
            return self._arguments(event.text)
        if isinstance(event, ToolCallEnd):
            # A call cut by max_output_tokens is incomplete (its arguments no JSON).
            status = "completed" if event.complete else "incomplete"
            return self._close_call(event.arguments, status)
        if isinstance(event, ChoiceEnd):
            self._reason = event.reason
            return self._end_choice(event.reason)
        assert isinstance(event, Finished)
        return self._finish(event.usage)

    def fail(self, error: ServiceError) -> list[dict[str, Any]]:
        """An error after streaming began: the response failed."""
        self.response["status"] = "failed"
        # A failed response's code is one of OpenAI's few; the error event has ours.
        failed = "rate_limit_exceeded" if error.status == 429 else "server_error"
        self.response["error"] = {"code": failed, "message": error.message}
        code = error.code or error.type
        return [
            self._event("error", code=code, message=error.message, param=error.param),
            self._event("response.failed", response=self._snapshot()),
        ]

    # -- a message --------------------------------------------------------------------
    def _open_message(self) -> list[dict[str, Any]]:
        message = {
            "id": item_id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        self._message = message
        self.output.append(message)
        index = len(self.output) - 1
        return [
            self._event("response.output_item.added", output_index=index, item=dict(message)),
            self._event(
                "response.content_part.added",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                part=_text_part(""),
            ),
        ]

    def _text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = [] if self._message is not None else self._open_message()
        message = self._message
        assert message is not None
        self._parts.append(text)
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=message["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message = self._message
        if message is None:
            return []
        self._message = None
        text = "".join(self._parts)
        self._parts = []
        index = self.output.index(message)
        message["content"] = [_text_part(text)]
        message["status"] = status
        return [
            self._event(
                "response.output_text.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self._event(
                "response.content_part.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                part=_text_part(text),
            ),
            self._event("response.output_item.done", output_index=index, item=dict(message)),
        ]

    # -- a function call --------------------------------------------------------------
    def _open_call(self, start: ToolCallStart) -> list[dict[str, Any]]:
        call = {
            "id": item_id("fc"),
            "type": "function_call",
            "call_id": start.id,
            "name": start.name,
            "arguments": "",
            "status": "in_progress",
        }
        if start.name in self._namespaces:
            call["namespace"] = self._namespaces[start.name]
        self._call = call
        self.output.append(call)
        index = len(self.output) - 1
        return [self._event("response.output_item.added", output_index=index, item=dict(call))]

    def _arguments(self, text: str) -> list[dict[str, Any]]:
        call = self._call
        if call is None or not text:
            return []
        call["arguments"] += text
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=call["id"],
                output_index=len(self.output) - 1,
                delta=text,
            )
        ]

    def _close_call(self, arguments: str | None, status: str) -> list[dict[str, Any]]:
        call = self._call
        if call is None:
            return []
        self._call = None
        if arguments is not None:
            call["arguments"] = arguments
        call["status"] = status
        index = self.output.index(call)
        return [
            self._event(
                "response.function_call_arguments.done",
                item_id=call["id"],
                output_index=index,
                name=call["name"],
                arguments=call["arguments"],
            ),
            self._event("response.output_item.done", output_index=index, item=dict(call)),
        ]

    # -- the end ----------------------------------------------------------------------
    def _end_choice(self, reason: str) -> list[dict[str, Any]]:
        status = "incomplete" if reason == "length" else "completed"
        events = [*self._close_message(status), *self._close_call(None, status)]
        if not self.output:  # nothing generated: an empty answer, as OpenAI gives
            events += self._open_message()
            events += self._close_message(status)
        return events

    def _finish(self, usage: Usage) -> list[dict[str, Any]]:
        events = [] if self._reason is not None else self._end_choice("stop")
        self.response["usage"] = usage_body(usage)
        if self._reason == "length":
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            return [*events, self._event("response.incomplete", response=self._snapshot())]
        if self._reason == "error":
            events += self.fail(ServiceError("the generation failed", code="server_error"))
            return events
        self.response["status"] = "completed"
        return [*events, self._event("response.completed", response=self._snapshot())]
