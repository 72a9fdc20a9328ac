"""A Responses conversation as items, and as the core's turns.

Items are what the API speaks and what is stored: messages, ``function_call`` and
``function_call_output`` items, each with an ``id``. :func:`stored_items` turns a
request's input into them (a string is one user message; a message's string content
becomes one text part); :func:`output_items` takes a response's output as the next
turn's history; :func:`turns` reads a conversation back as the core's
:class:`~tokenmill.chat.request.Turn` s: consecutive calls are one assistant turn,
each output a ``tool`` turn naming its call. Pure: no I/O, no generation.
"""

from __future__ import annotations

import secrets
from typing import Any

from tokenmill.chat import Turn
from tokenmill.engines import ToolCall
from tokenmill.errors import InvalidRequestError
from tokenmill.server.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
)

Item = dict[str, Any]
# Where each kind of item's id starts, as OpenAI's do.
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def stored_items(
    items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem],
) -> list[Item]:
    """A request's input items as they are stored and listed: each with its ``type``
    and an ``id``, a message's content as a list of parts."""
    out: list[Item] = []
    for item in items:
        data = item.model_dump(mode="json", by_alias=True, exclude_none=True)
        data["id"] = item.id or new_id(_ID_PREFIXES[item.type])
        if isinstance(item, MessageItem):
            kind = "output_text" if item.role == "assistant" else "input_text"
            data["content"] = [{"type": kind, "text": item.text()}]
        elif isinstance(item, FunctionCallOutputItem):
            data["output"] = item.text()
        out.append(data)
    return out


def output_items(response: dict[str, Any]) -> list[Item]:
    """A response's output, as the next request's history."""
    return [dict(item) for item in response["output"]]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or p.get("refusal") or "" for p in content)


def turns(items: list[Item], instructions: str | None) -> tuple[Turn, ...]:
    """The conversation as the core's turns, ``instructions`` first as the system's.

    A ``function_call_output`` whose call is not in the conversation is a 400 naming
    ``input``: the model would read a result of nothing.
    """
    out: list[Turn] = []
    if instructions:
        out.append(Turn("system", instructions))
    names: dict[str, str] = {}
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = item["role"]
            out.append(Turn("system" if role == "developer" else role, _text(item["content"])))
        elif kind == "function_call":
            call = ToolCall(item["call_id"], item["name"], item["arguments"])
            names[call.id] = call.name
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                # The calls of one answer (after its text, if any) are one turn.
                out[-1] = Turn("assistant", last.content, (*last.tool_calls, call))
            else:
                out.append(Turn("assistant", "", (call,)))
        elif kind == "function_call_output":
            call_id = item["call_id"]
            if call_id not in names:
                raise InvalidRequestError(
                    f"a function_call_output answers call_id {call_id!r}, but no "
                    "function_call with that call_id comes before it in the conversation; "
                    "send the call (or continue with previous_response_id)",
                    param="input",
                )
            out.append(
                Turn("tool", _text(item["output"]), tool_call_id=call_id, name=names[call_id])
            )
    return tuple(out)
