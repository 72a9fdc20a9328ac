"""Chat templates: the model's (or the request's) Jinja template, rendered sandboxed.

Templates come from GGUF metadata or from callers (the ``chat_template`` field), so
they run in Jinja's immutable sandbox; a template that fails to compile or render is
the caller's 400, never a 500.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.sandbox

from tokenmill.engines.base import ChatMessage, ToolCall, ToolSpec
from tokenmill.errors import InvalidRequestError


@lru_cache(maxsize=64)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
    )

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def render_chat(
    source: str | None,
    messages: Sequence[ChatMessage],
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool = True,
    tools: ToolSpec | None = None,
) -> str:
    """Render ``messages``, with a generation prompt appended unless told not to.

    ``tools`` (a template that knows tools: Hermes, Qwen...) are the template's
    ``tools``, and a turn's calls its ``tool_calls`` in OpenAI's shape (arguments as
    their JSON value, as Hugging Face templates read them)."""
    if not source:
        raise InvalidRequestError(
            "this model has no chat template; send 'chat_template' or use /v1/completions",
            param="chat_template",
        )
    try:
        return _compile_template(source).render(
            messages=[_message(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=None if tools is None else json.loads(tools.tools),
        )
    except jinja2.TemplateError as e:
        raise InvalidRequestError(
            f"the chat template failed to render: {e}", param="chat_template"
        ) from None


# Stand-ins for the contents of a rendered conversation: nothing a template writes.
_ANSWER = "\u2063tokenmill-answer\u2063"
_NEXT = "\u2063tokenmill-next\u2063"


def next_user_turn(source: str, bos_token: str, eos_token: str) -> str | None:
    """What the template writes between an assistant's answer and the next user
    message's text: for ChatML ``<|im_end|>\n<|im_start|>user\n``. None when the
    template does not write an answer as it is followed by that text (one that
    rewrites or drops earlier answers), or fails to render the probe. Renders the
    template each call: the engine keeps what it makes of the answer."""
    messages = [
        ChatMessage("user", "Hello."),
        ChatMessage("assistant", _ANSWER),
        ChatMessage("user", _NEXT),
    ]
    try:
        text = _compile_template(source).render(
            messages=[_message(m) for m in messages],
            add_generation_prompt=False,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=None,
        )
    except Exception:  # any template, any failure: no warm-up, nothing else
        return None
    start = text.find(_ANSWER)
    end = text.find(_NEXT)
    if start < 0 or end < start or text.count(_ANSWER) != 1:
        return None
    return text[start + len(_ANSWER) : end]


def _message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _value(c)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _value(call: ToolCall) -> Any:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments
