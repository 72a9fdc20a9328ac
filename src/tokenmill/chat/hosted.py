"""Hosted tools: what a deployment does with the tools a provider's own servers run
(web search, file search, code execution...), which tokenmill cannot run.

Agent clients offer them by default (Codex CLI sends ``web_search`` in every request),
so a deployment chooses (its ``hosted_tools`` key): ``omit`` leaves them out of what
the model sees, and the API adapter says so in the response (the
``x-tokenmill-omitted-tools`` header); ``refuse`` answers a 400 naming the first one.
Pure policy: the adapters find the tools in their own wire format.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import quote

from tokenmill.errors import InvalidRequestError

__all__ = ["OMITTED_HEADER", "hosted_tools", "omitted_header"]

# The response header naming the hosted tools left out (comma-separated).
OMITTED_HEADER = "x-tokenmill-omitted-tools"


def omitted_header(names: Sequence[str]) -> str:
    """:data:`OMITTED_HEADER`'s value: the names, comma-separated, each percent-encoded
    (UTF-8) past letters, digits and ``_.-~`` (a header is ASCII, and a client may name
    its tools anything)."""
    return ", ".join(quote(name, safe="") for name in names)


def hosted_tools(
    policy: str, deployment: str, offered: Sequence[tuple[str, str]], advice: str
) -> tuple[str, ...]:
    """The names of the hosted tools ``offered`` (each ``(param, name)``: the field
    that names it, and its name) that ``deployment`` leaves out under ``policy`` (its
    ``hosted_tools``); raises the 400 of the first one where it refuses them.
    ``advice``: what to send instead."""
    if offered and policy == "refuse":
        param, name = offered[0]
        raise InvalidRequestError(
            f"tokenmill does not support the hosted tool {name!r} (deployment "
            f"{deployment!r} refuses hosted tools: its hosted_tools is 'refuse'); {advice}",
            param=param,
            code="unsupported_parameter",
        )
    return tuple(name for _, name in offered)
