"""Chat templates: the model's (or the request's) Jinja template, rendered sandboxed.

Templates come from GGUF metadata or from callers (the ``chat_template`` field), so
they run in Jinja's immutable sandbox; a template that fails to compile or render is
the caller's 400, never a 500.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import jinja2
import jinja2.sandbox

from tokenmill.engines.base import ChatMessage
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
) -> str:
    """Render ``messages``, with a generation prompt appended unless told not to."""
    if not source:
        raise InvalidRequestError(
            "this model has no chat template; send 'chat_template' or use /v1/completions",
            param="chat_template",
        )
    try:
        return _compile_template(source).render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except jinja2.TemplateError as e:
        raise InvalidRequestError(
            f"the chat template failed to render: {e}", param="chat_template"
        ) from None
