"""Where a system prompt's per-session lines go: after what every session shares.

An agent CLI's first request is mostly the same from one session to the next (its
system prompt and its tools: Claude Code's ~20,000 tokens), but a few lines change
with the session: the working directory, the git status, a header that follows the
first user message. A replica's prefix cache serves the longest prefix a prompt shares
with one computed before, so where those lines sit decides what a new session finds
cached: everything after the first changed token is computed again. Claude Code
2.1.197 writes them at the very start of its system prompt (its billing header) and
in its middle (its memory directory, its environment), before the tools' description
the generic tool format puts at the end of the system turn: a second session found
nothing cached (docs/agent-apis.md).

:func:`split_system` takes those lines out of the system text, in order, for the core
to place at the end of the system turn, after everything else it holds (the tools'
description, a JSON schema: :attr:`~tokenmill.chat.request.ChatRequest.session_lines`).
The text is the same; only these pieces move, and only within the system turn, in
their order, except that a piece that changes with every first message (the billing
header) goes after those that change only with the project (a new session in the same
directory then finds the memory, environment and git sections cached too):

* the blocks after the last one marked with ``cache_control``, where some are (a
  Messages request's breakpoints: the client says where its stable prefix ends, and
  what follows the last one it expects to change);
* the sections Claude Code writes per session, found by their opening words (as
  2.1.197 writes them): the ``x-anthropic-billing-header:`` block (its ``cc_version``
  changes with the first user message), the ``# Memory`` section (it names the
  project's memory directory), the ``# Environment`` section (working directory, git
  or not, OS) and the ``gitStatus:`` snapshot. A section runs to the next ``# ``
  heading or the end of its block.

The messages keep their order and their text. A chat template that renders tools
itself keeps them where it puts them (Hermes' and Qwen's put them after the system
text, so there the per-session lines still come before the tools).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["SESSION_SECTIONS", "PromptOrder", "SystemBlock", "SystemSplit", "split_system"]

# A deployment's ``prompt_order``: "stable_first" places the per-session lines after
# what sessions share (this module); "as_sent" keeps the system text as it came.
PromptOrder = Literal["stable_first", "as_sent"]

# How blocks of a system prompt are joined (as Anthropic's ``system`` blocks are).
JOIN = "\n\n"
# The openings of the sections Claude Code (2.1.197) writes per session, each at the
# start of a line.
SESSION_SECTIONS = (
    "x-anthropic-billing-header:",
    "# Memory\n\nYou have a persistent file-based memory at ",
    "# Environment\nYou have been invoked in the following environment",
    "gitStatus: ",
)
_OPENING = re.compile("^(?:" + "|".join(re.escape(s) for s in SESSION_SECTIONS) + ")", re.M)
# Of those, the ones that change with every session's first message (Claude Code's
# ``cc_version`` suffix), not only with its directory: they go last, so a new session
# in the same project still finds the memory, environment and git sections cached.
PER_MESSAGE = ("x-anthropic-billing-header:",)
# A section ends where the next top-level markdown heading starts.
_HEADING = re.compile(r"^# ", re.M)


@dataclass(frozen=True, slots=True)
class SystemBlock:
    """One block of a system prompt; ``breakpoint``: marked with ``cache_control``."""

    text: str
    breakpoint: bool = False


@dataclass(frozen=True, slots=True)
class SystemSplit:
    """A system prompt as what every session shares (``stable``) and the lines of this
    session (``session``), each joined as the blocks are."""

    stable: str
    session: str


def split_system(blocks: Sequence[SystemBlock]) -> SystemSplit:
    """The blocks' text with the per-session pieces taken out, and those pieces, in
    their order (see the module docstring)."""
    marked = [i for i, b in enumerate(blocks) if b.breakpoint]
    last = marked[-1] if marked else len(blocks)
    stable: list[str] = []
    session: list[str] = []
    for i, block in enumerate(blocks):
        if i > last:
            session.append(block.text)
            continue
        rest, moved = _sections(block.text)
        if rest:
            stable.append(rest)
        session.extend(moved)
    session.sort(key=lambda piece: piece.startswith(PER_MESSAGE))  # stable: in order
    return SystemSplit(JOIN.join(stable), JOIN.join(session))


def _sections(text: str) -> tuple[str, list[str]]:
    """``text`` without its per-session sections, and those sections."""
    kept: list[str] = []
    moved: list[str] = []
    at = 0  # where the text not yet kept or moved starts
    for opening in _OPENING.finditer(text):
        start = opening.start()
        if start < at:
            continue  # inside a section already moved
        heading = _HEADING.search(text, opening.end())
        end = heading.start() if heading is not None else len(text)
        kept.append(text[at:start])
        moved.append(text[start:end].rstrip())
        at = end
    kept.append(text[at:])
    rest = "".join(kept)
    # A section cut from the end leaves the separator that came before it.
    return (rest.rstrip() if at == len(text) and moved else rest), moved
