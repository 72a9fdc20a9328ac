"""Reading tool calls out of a model's JSON as it is generated, a piece at a time.

A model without a tool format of its own answers in the generic format
(:mod:`tokenmill.chat.tools`), one JSON object, either::

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]}

or::

    {"response": "an answer to the user"}

:class:`ToolCallReader` is fed the text as it arrives and reports what it has read,
without waiting for the end: a call's name once the name is whole
(:class:`CallOpened`), then its ``arguments`` as the fragments of JSON text that make
it up, exactly as generated (:class:`ArgumentsDelta`: their concatenation is the
arguments' JSON text); the ``response`` string decoded into plain text
(:class:`ContentDelta`), escapes and all, a character as soon as it is whole. A
``response`` that is not a string (a structured answer) is passed on as its JSON text.

Text that is not this format (an engine that did not constrain its output) is not
lost: whatever has not been reported when it stops making sense comes out as content,
and so does the rest. Text after the object is ignored (a grammar ends generation
there). The reader is pure: no I/O, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator
from dataclasses import dataclass

__all__ = [
    "ArgumentsDelta",
    "CallOpened",
    "ContentDelta",
    "MarkupReader",
    "ToolCallReader",
    "ToolEvent",
]


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallOpened:
    index: int
    name: str
    id: str | None = None  # the call's id, when it came with one (from an upstream)


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = ContentDelta | CallOpened | ArgumentsDelta

_WHITESPACE = frozenset(" \t\r\n")
_NUMBER = frozenset("+-0123456789.eE")
_LITERALS = ("true", "false", "null")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class _NotTheFormat(Exception):
    """The text stopped being the generic format's JSON."""


# The parsing coroutines: each is sent one character at a time; those that read a
# piece of text return it.
_Reads = Generator[None, str, str]
_Parses = Generator[None, str, None]


class ToolCallReader:
    """Reads the generic tool format incrementally. See the module docstring."""

    def __init__(self, *, single_call: bool = False, first_index: int = 0) -> None:
        # ``single_call``: the text is one call object (``{"name", "arguments"}``, as
        # inside a template's ``<tool_call>`` markup), numbered ``first_index``.
        self._single = single_call
        self.calls = first_index  # calls opened so far (the next call's index)
        self.complete = False  # the object is closed: nothing more is read
        self.rest = ""  # the text fed after the object closed
        self._events: list[ToolEvent] = []
        self._raw: list[str] = []  # every character fed, while nothing was reported
        self._reported = False
        self._passthrough = False  # not the format: the text is content
        self._back: str | None = None  # a character read one too far (after a number)
        # A value reported as it is read (a call's arguments, a structured response):
        # its characters not yet reported, and where they go.
        self._capture: list[str] | None = None
        self._sink: Callable[[str], None] | None = None
        self._parser = self._root()
        next(self._parser)

    @property
    def passthrough(self) -> bool:
        """The text was not the format, and goes out as content."""
        return self._passthrough

    def feed(self, text: str) -> list[ToolEvent]:
        """What ``text`` (the next piece of the output) adds, adjacent pieces merged."""
        for i, ch in enumerate(text):
            if self._passthrough:
                self._content(text[i:])
                break
            if self.complete:
                self.rest += text[i:]
                break
            if not self._reported:
                self._raw.append(ch)
            try:
                self._parser.send(ch)
            except StopIteration:
                self.complete = True
            except _NotTheFormat:
                self._give_up(text[i:])
                break
        self._flush()
        return self._take()

    def close(self) -> list[ToolEvent]:
        """The output ended (complete or not): anything still to report."""
        self._flush()
        self._parser.close()
        return self._take()

    # -- events -----------------------------------------------------------------------

    def _take(self) -> list[ToolEvent]:
        events, self._events = self._events, []
        merged: list[ToolEvent] = []
        for e in events:
            last = merged[-1] if merged else None
            if isinstance(e, ContentDelta) and isinstance(last, ContentDelta):
                merged[-1] = ContentDelta(last.text + e.text)
            elif (
                isinstance(e, ArgumentsDelta)
                and isinstance(last, ArgumentsDelta)
                and last.index == e.index
            ):
                merged[-1] = ArgumentsDelta(e.index, last.text + e.text)
            else:
                merged.append(e)
        return merged

    def _emit(self, event: ToolEvent) -> None:
        if not self._reported:
            self._reported = True
            self._raw.clear()
        self._events.append(event)

    def _content(self, text: str) -> None:
        if text:
            self._emit(ContentDelta(text))

    def _flush(self) -> None:
        if self._sink is not None and self._capture:
            self._sink("".join(self._capture))
            self._capture.clear()

    def _give_up(self, rest: str) -> None:
        """Not the format: what was never reported, and all that follows, is content."""
        self._capture = self._sink = None
        self._passthrough = True
        if self._reported:
            self._content(rest)
        else:
            self._content("".join(self._raw) + rest[1:])

    # -- characters -------------------------------------------------------------------

    def _next(self) -> _Reads:
        if self._back is not None:
            ch, self._back = self._back, None
        else:
            ch = yield
        if self._capture is not None:
            self._capture.append(ch)
        return ch

    def _push_back(self, ch: str) -> None:
        # Only ever the character just read: it is still in the capture, unreported.
        self._back = ch
        if self._capture is not None:
            self._capture.pop()

    def _skip_space(self) -> _Reads:
        ch = yield from self._next()
        while ch in _WHITESPACE:
            ch = yield from self._next()
        return ch

    @staticmethod
    def _expect(ch: str, wanted: str) -> None:
        if ch != wanted:
            raise _NotTheFormat

    # -- the format -------------------------------------------------------------------

    def _root(self) -> _Parses:
        ch = yield from self._skip_space()
        self._expect(ch, "{")
        if self._single:
            yield from self._call()
        else:
            yield from self._members(self._root_member)

    def _members(self, member: Callable[[str], _Parses]) -> _Parses:
        """An object's members after its ``{``, each value read by ``member(key)``."""
        ch = yield from self._skip_space()
        if ch == "}":
            return
        while True:
            self._expect(ch, '"')
            key = yield from self._string()
            ch = yield from self._skip_space()
            self._expect(ch, ":")
            yield from member(key)
            ch = yield from self._skip_space()
            if ch == "}":
                return
            self._expect(ch, ",")
            ch = yield from self._skip_space()

    def _root_member(self, key: str) -> _Parses:
        ch = yield from self._skip_space()
        if key == "tool_calls" and ch == "[":
            ch = yield from self._skip_space()
            if ch == "]":
                return
            while True:
                self._expect(ch, "{")
                yield from self._call()
                ch = yield from self._skip_space()
                if ch == "]":
                    return
                self._expect(ch, ",")
                ch = yield from self._skip_space()
        elif key == "tool_call" and ch == "{":
            yield from self._call()
        elif key == "response" and ch == '"':
            yield from self._string(self._content)
        elif key == "response":
            # A structured answer: its JSON text is the content.
            yield from self._reported_value(ch, self._content)
        else:
            yield from self._value(ch)

    def _call(self) -> _Parses:
        """A call object after its ``{``: its name, then its arguments as they come."""
        index = self.calls
        name: str | None = None
        early: list[str] = []  # arguments read before the name (not the format's order)

        def arguments(text: str) -> None:
            self._emit(ArgumentsDelta(index, text))

        def member(key: str) -> _Parses:
            nonlocal name
            ch = yield from self._skip_space()
            if key == "name" and name is None:
                self._expect(ch, '"')
                name = yield from self._string()
                self.calls += 1
                self._emit(CallOpened(index, name))
                if early:
                    arguments("".join(early))
            elif key == "arguments" and name is not None:
                yield from self._reported_value(ch, arguments)
            elif key == "arguments":
                yield from self._reported_value(ch, early.append)
            else:
                yield from self._value(ch)

        yield from self._members(member)
        if name is None:
            raise _NotTheFormat  # a call without a name

    def _reported_value(self, first: str, sink: Callable[[str], None]) -> _Parses:
        """A JSON value starting with ``first``, its text going to ``sink`` as it is
        read (whatever a piece of output holds at once, in one call)."""
        self._capture, self._sink = [first], sink
        try:
            yield from self._value(first)
        finally:
            self._flush()
            self._capture = self._sink = None

    def _value(self, ch: str) -> _Parses:
        """The rest of a JSON value whose first character was ``ch``. Its inner
        structure is checked loosely: keeping it is the grammar's business."""
        depth: list[str] = []  # the open containers' closing brackets
        while True:
            if ch == '"':
                yield from self._string()
            elif ch in "{[":
                depth.append("}" if ch == "{" else "]")
            elif ch in "}]":
                if not depth or depth.pop() != ch:
                    raise _NotTheFormat
            elif ch in _NUMBER:
                number = [ch]
                ch = yield from self._next()
                while ch in _NUMBER:
                    number.append(ch)
                    ch = yield from self._next()
                try:
                    json.loads("".join(number))
                except ValueError:
                    raise _NotTheFormat from None
                self._push_back(ch)
            elif ch.isalpha():
                word = ch
                while any(lit.startswith(word) and lit != word for lit in _LITERALS):
                    word += yield from self._next()
                if word not in _LITERALS:
                    raise _NotTheFormat
            elif not (depth and (ch in _WHITESPACE or ch in ",:")):
                raise _NotTheFormat
            if not depth:
                return
            ch = yield from self._next()

    def _string(self, report: Callable[[str], None] | None = None) -> _Reads:
        """A string's value after its opening quote; with ``report``, its text goes
        there a character at a time, as soon as the character is whole."""
        out: list[str] = []
        put = out.append if report is None else report
        high: int | None = None  # a high surrogate waiting for its low half
        while True:
            ch = yield from self._next()
            if ch == '"':
                if high is not None:
                    put("\ufffd")
                return "".join(out)
            if ch == "\\":
                esc = yield from self._next()
                if esc == "u":
                    digits = ""
                    for _ in range(4):
                        digits += yield from self._next()
                    if not all(d in _HEX for d in digits):
                        raise _NotTheFormat
                    code = int(digits, 16)
                    if 0xDC00 <= code < 0xE000 and high is not None:
                        put(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
                        high = None
                        continue
                    if high is not None:
                        put("\ufffd")
                        high = None
                    if 0xD800 <= code < 0xDC00:
                        high = code
                        continue
                    text = "\ufffd" if 0xDC00 <= code < 0xE000 else chr(code)
                elif esc in _ESCAPES:
                    text = _ESCAPES[esc]
                else:
                    raise _NotTheFormat
            elif ch < " ":
                raise _NotTheFormat  # a raw control character: JSON escapes them
            else:
                text = ch
            if high is not None:
                put("\ufffd")
                high = None
            put(text)


class MarkupReader:
    """Reads a template's tool-call markup out of the text as it streams: Hermes'
    (Qwen's and others') ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``.

    Text outside the tags is content, but a piece that may be the start of a tag is
    held back, like a stop string, so no markup ever reaches the content; so is
    whitespace, until text follows it (the newlines between calls are no content).
    A tag whose inside is not a call is given back as the content it was.
    """

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        self.calls = 0
        self._held = ""  # text that may begin a tag, or only whitespace so far
        self._call: ToolCallReader | None = None
        self._closing = False  # a call was read: its closing tag comes next
        self._events: list[ToolEvent] = []

    @property
    def complete(self) -> bool:
        """Every call opened was read to its end."""
        return self._call is None and not (self._closing and self._held)

    def feed(self, text: str) -> list[ToolEvent]:
        buf = self._held + text
        self._held = ""
        while buf:
            if self._call is not None:
                buf = self._in_call(buf)
            elif self._closing:
                buf = self._close_tag(buf)
            else:
                buf = self._text(buf)
        events, self._events = self._events, []
        return events

    def close(self) -> list[ToolEvent]:
        if self._call is not None:
            self._events += self._call.close()
        elif not self._closing and self._held.strip():
            self._events.append(ContentDelta(self._held))
        self._held = ""
        events, self._events = self._events, []
        return events

    def _text(self, buf: str) -> str:
        at = buf.find(self.OPEN)
        if at >= 0:
            before = buf[:at]
            if before.strip():
                self._events.append(ContentDelta(before))
            self._call = ToolCallReader(single_call=True, first_index=self.calls)
            return buf[at + len(self.OPEN) :]
        keep = _tag_start(buf, self.OPEN)
        shown, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        if shown.strip():
            self._events.append(ContentDelta(shown))
        elif shown:
            self._held = shown + self._held
        return ""

    def _in_call(self, buf: str) -> str:
        call = self._call
        assert call is not None
        events = call.feed(buf)
        if call.passthrough:  # not a call after all: the tag and all are content
            self._call = None
            text = "".join(e.text for e in events if isinstance(e, ContentDelta))
            self._events.append(ContentDelta(self.OPEN + text))
            return ""
        self._events += events
        if not call.complete:
            return ""
        self.calls = call.calls
        self._call = None
        self._closing = True
        return call.rest

    def _close_tag(self, buf: str) -> str:
        rest = buf.lstrip()
        if rest.startswith(self.CLOSE):
            self._closing = False
            return rest[len(self.CLOSE) :]
        if self.CLOSE.startswith(rest):
            self._held = buf  # the tag may still be coming
            return ""
        self._closing = False  # no closing tag: what follows is text
        return rest


def _tag_start(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
