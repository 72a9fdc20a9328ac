"""Reading a server-sent event stream in tests: the one reader, strict about framing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

DONE = "[DONE]"
PING = ": ping"  # the keep-alive comment (stream_keepalive_s)
Event = dict[str, Any] | str  # a JSON event, or DONE


def lines(r: httpx.Response) -> Iterator[str]:
    """The lines of a streamed response as they arrive, blank ones left out: ``data:``
    lines and keep-alive pings. Checked: nothing else, and nothing after DONE."""
    done = False
    for line in r.iter_lines():
        if not line:
            continue
        assert not done, f"{line!r} after data: [DONE]"
        assert line == PING or line.startswith("data: "), f"not a server-sent line: {line!r}"
        done = line == f"data: {DONE}"
        yield line


def events(r: httpx.Response) -> Iterator[Event]:
    """The ``data:`` events of a streamed response: each JSON one decoded, then DONE.

    The framing is checked as the events are read: tokenmill sends nothing but
    ``data:`` lines, keep-alive pings (skipped here) and the blank lines between
    them, and nothing after DONE.

    Keep the iterator referenced while the stream should stay open: a dropped one
    closes the connection, which the server sees as the client leaving.
    """
    for line in lines(r):
        if line == PING:
            continue
        data = line.removeprefix("data: ")
        if data == DONE:
            yield DONE
        else:
            yield json.loads(data)


def to_done(r: httpx.Response) -> list[dict[str, Any]]:
    """Every JSON event of a stream read to its end, which must be DONE."""
    got = list(events(r))
    assert got and got[-1] == DONE, f"the stream ended without data: [DONE]: {got}"
    return [e for e in got[:-1] if isinstance(e, dict)]


def text(event: Event) -> str:
    """The text an event carries (chat delta or completion), '' for any other event."""
    if not isinstance(event, dict) or not event.get("choices"):
        return ""
    choice = event["choices"][0]
    return str(choice.get("text") or choice.get("delta", {}).get("content") or "")


def usage(event: Event) -> dict[str, Any] | None:
    """The usage an event carries (the last one, with ``include_usage``), else None."""
    if not isinstance(event, dict) or not event.get("usage"):
        return None
    return dict(event["usage"])
