"""Chat completions and completions over the generation core: a wire request in, the
core's events out as OpenAI's shapes.

:func:`open_generation` turns a validated body into the core's
:class:`~tokenmill.chat.ChatRequest` and opens it; the router sends the returned
:class:`OpenAIRun` as ``chat.completion.chunk`` / ``text_completion`` server-sent
events (``events``), or as one body (``collect``), each shaped by the route's pure
encoder (:mod:`tokenmill.server.openai.events`). :data:`CHAT` and :data:`COMPLETIONS`
are the two endpoints (:mod:`tokenmill.server.endpoint`) their routes and the Batch
API's lines both serve through. Knows nothing of routes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tokenmill import chat
from tokenmill.engines import PromptItem
from tokenmill.errors import InvalidRequestError, ServiceError
from tokenmill.gateway import Deployment, requested_priority
from tokenmill.server.endpoint import Call, Endpoint
from tokenmill.server.openai.events import ChatEncoder, CompletionEncoder
from tokenmill.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Message,
    SamplingFields,
)
from tokenmill.server.openai.tools import ToolFields, tool_choice
from tokenmill.server.sse import DONE, encode_event

Route = Literal["chat", "completion"]


@dataclass
class OpenAIRun:
    """One chat completion or completion being generated: send :meth:`events` or
    await :meth:`collect`, and :meth:`aclose` always (it settles the bill)."""

    generation: chat.Generation
    encoder: ChatEncoder | CompletionEncoder

    @property
    def request_id(self) -> str:
        return self.generation.request_id

    async def events(self) -> AsyncIterator[bytes]:
        """SSE frames ending ``data: [DONE]``; an error after streaming began is the
        error body as an event."""
        try:
            for chunk in self.encoder.start():
                yield encode_event(chunk)
            async for e in self.generation.events():
                for chunk in self.encoder.feed(e):
                    yield encode_event(chunk)
        except ServiceError as e:
            for chunk in self.encoder.fail(e):
                yield encode_event(chunk)
        yield DONE

    async def collect(self) -> dict[str, Any]:
        """The whole completion as one OpenAI response body."""
        return self.encoder.body(await self.generation.collect())

    async def aclose(self) -> None:
        await self.generation.aclose()


def chat_request(
    body: SamplingFields,
    route: Route,
    *,
    prompt: str | None = None,
    prompt_tokens: tuple[int, ...] | None = None,
    prompts: tuple[PromptItem, ...] | None = None,
    messages: Sequence[Message] | None = None,
) -> chat.ChatRequest:
    """The body as the core's neutral request."""
    tools: tuple[chat.FunctionTool, ...] = ()
    choice: chat.ToolChoice | None = None
    parallel = None
    if isinstance(body, ToolFields):
        tools = tuple(t.function_tool() for t in body.tools or ())
        choice = None if body.tool_choice is None else tool_choice(body.tool_choice)
        parallel = body.parallel_tool_calls
    return chat.ChatRequest(
        sampling=body.sampling_params(body.max_tokens or 0),
        kind=route,
        messages=None if messages is None else tuple(m.to_turn() for m in messages),
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        prompts=prompts,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        chat_template=body.chat_template,
        n=body.n,
    )


async def open_generation(
    call: Call,
    deployment: Deployment,
    body: SamplingFields,
    route: Route,
    *,
    prompt: str | None = None,
    prompt_tokens: tuple[int, ...] | None = None,
    prompts: tuple[PromptItem, ...] | None = None,
    messages: Sequence[Message] | None = None,
) -> OpenAIRun:
    """Open the generation through the core (may raise), in the class the body asks
    for (at most the caller's key's: docs/fairness.md), routed by the call's session
    (``x-session-id``), else the body's ``user``, as an affinity hint."""
    request = chat_request(
        body, route, prompt=prompt, prompt_tokens=prompt_tokens, prompts=prompts, messages=messages
    )
    caller = call.caller.asking(requested_priority(body.priority, body.service_tier))
    generation = await chat.open_generation(
        call.gateway,
        deployment,
        request,
        call.request_id,
        caller,
        session=call.session or body.user,
    )
    encoder = ChatEncoder if route == "chat" else CompletionEncoder
    return OpenAIRun(
        generation,
        encoder(
            generation.request_id,
            body.model or deployment.id,
            int(time.time()),
            choices=generation.choices,
            include_usage=body.include_usage,
            logprobs=body.logprob_alternatives() is not None and not generation.tool_calls,
        ),
    )


# A serving function refuses what it knows at once (an unknown model, a field it
# does not take) when called, and returns the opening: a refusal known before any
# wait keeps its HTTP status whatever a stream's keep-alive (tokenmill.server.sse).


def serve_chat(call: Call, body: ChatCompletionRequest) -> Coroutine[Any, Any, OpenAIRun]:
    """``POST /v1/chat/completions``."""
    deployment = call.gateway.deployment(body.model)
    return open_generation(call, deployment, body, "chat", messages=body.messages)


def serve_completion(call: Call, body: CompletionRequest) -> Coroutine[Any, Any, OpenAIRun]:
    """``POST /v1/completions``: one prompt, or several (each its own choices)."""
    if body.best_of is not None and body.best_of != body.n:
        # best_of = n returns every candidate: that is n. Ranking candidates is not built.
        raise InvalidRequestError(
            f"best_of {body.best_of} with n {body.n}: tokenmill returns every choice it "
            "generates and ranks none; send best_of equal to n, or leave it out",
            param="best_of",
            code="unsupported_parameter",
        )
    deployment = call.gateway.deployment(body.model)
    items = body.prompt_items()
    if len(items) > 1:
        return open_generation(call, deployment, body, "completion", prompts=items)
    (item,) = items
    if isinstance(item, str):
        return open_generation(call, deployment, body, "completion", prompt=item)
    return open_generation(call, deployment, body, "completion", prompt_tokens=item)


CHAT = Endpoint("/v1/chat/completions", ChatCompletionRequest, serve_chat)
COMPLETIONS = Endpoint("/v1/completions", CompletionRequest, serve_completion)
