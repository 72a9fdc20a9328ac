"""Reading a server-sent event stream in tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

DONE = "[DONE]"
Event = dict[str, Any] | str  # a JSON event, or DONE


def events(r: httpx.Response) -> Iterator[Event]:
    """The ``data:`` events of a streamed response: each JSON one decoded, then DONE.

    Keep the iterator referenced while the stream should stay open: a dropped one
    closes the connection, which the server sees as the client leaving.
    """
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield DONE if data == DONE else json.loads(data)


def text(event: Event) -> str:
    """The text an event carries (chat delta or completion), '' for any other event."""
    if not isinstance(event, dict) or not event.get("choices"):
        return ""
    choice = event["choices"][0]
    return str(choice.get("text") or choice.get("delta", {}).get("content") or "")
