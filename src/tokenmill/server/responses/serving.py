"""Serving OpenAI's Responses API: a request in, one generation of the core, a
response (streamed as events, or whole) out, stored when asked.

:func:`open_response` reads the conversation (the stored one of
``previous_response_id``, owned by the caller's account, then the request's input),
turns it into the core's :class:`~tokenmill.chat.request.ChatRequest` and opens it
with :func:`tokenmill.chat.open_generation`: the gateway admits, holds credit and
meters it exactly as any chat (the replayed history is prompt tokens). The returned
:class:`ResponseRun` is sent by the router as events or as one body; either way the
response is stored (``store``, the default) before its last event or its body leaves,
so a client that continues at once finds it. :data:`RESPONSES` is the endpoint its
route and the Batch API's lines serve through. Knows nothing of routes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from tokenmill.chat import (
    ChatRequest,
    FunctionTool,
    Generation,
    NamedTool,
    ResponseFormat,
    ToolChoice,
    open_generation,
)
from tokenmill.chat.hosted import hosted_tools
from tokenmill.engines import SamplingParams
from tokenmill.errors import InvalidRequestError, ResourceNotFoundError, ServiceError
from tokenmill.gateway import Deployment, Gateway
from tokenmill.identity import Caller
from tokenmill.ledger import ResponseStore
from tokenmill.server.endpoint import Call, Endpoint
from tokenmill.server.responses.events import ResponseEncoder, opening_failed
from tokenmill.server.responses.items import new_id, output_items, stored_items, turns
from tokenmill.server.responses.protocol import (
    TAGS,
    BuiltinToolParam,
    InputItemsQuery,
    NamedFunctionChoice,
    ResponsesRequest,
)
from tokenmill.server.sse import InBand, encode_typed_event, with_ticks


def not_found(response_id: str) -> ResourceNotFoundError:
    return ResourceNotFoundError(
        f"no response {response_id!r}: it was never stored (store: false), was deleted, "
        "has expired, or belongs to another account",
        code="response_not_found",
    )


@dataclass
class ResponseRun:
    """One response being generated: send :meth:`events` or await :meth:`collect`, and
    :meth:`aclose` always (it settles the bill)."""

    generation: Generation
    encoder: ResponseEncoder
    store: ResponseStore | None  # None: not stored (store: false)
    account_id: str
    conversation: list[dict[str, Any]]  # the input items, history first
    omitted_tools: tuple[str, ...] = ()  # hosted tools left out of the prompt
    # A quiet stream sends response.in_progress again this often (stream_activity_s).
    activity_s: float | None = None

    @property
    def request_id(self) -> str:
        return self.generation.request_id

    async def _stored(self) -> None:
        if self.store is not None:
            await self.store.put(
                self.encoder.response["id"], self.account_id, self.conversation,
                self.encoder.response,
            )  # fmt: skip

    async def events(self) -> AsyncIterator[bytes]:
        """The response's events; an error after streaming began ends it ``failed``."""
        encoder = self.encoder
        try:
            for event in encoder.start():
                yield encode_typed_event(event)
            async for e in with_ticks(self.generation.events(), self.activity_s):
                out = encoder.activity() if e is None else encoder.feed(e)
                if out and out[-1]["type"] in ("response.completed", "response.incomplete"):
                    await self._stored()
                for event in out:
                    yield encode_typed_event(event)
        except ServiceError as e:
            for event in encoder.fail(e):
                yield encode_typed_event(event)

    async def collect(self) -> dict[str, Any]:
        """The whole response (its status ``failed`` if the replica failed midway)."""
        encoder = self.encoder
        encoder.start()
        try:
            async for e in self.generation.events():
                encoder.feed(e)
        except ServiceError as e:
            encoder.fail(e)
            raise
        await self._stored()
        return encoder.response

    async def aclose(self) -> None:
        await self.generation.aclose()


def _tool_choice(
    choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None,
) -> ToolChoice | None:
    if isinstance(choice, NamedFunctionChoice):
        return NamedTool(choice.name)
    return choice


def chat_request(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatRequest:
    """The core's request for ``body`` over ``conversation`` (history and input)."""
    fmt = body.text.format if body.text is not None else None
    constraint = None
    if fmt is not None:
        spec = ResponseFormat(fmt.type, fmt.schema_, fmt.name or "", fmt.strict)
        constraint = spec.constraint(param="text.format")
    sampling = SamplingParams(
        max_tokens=body.max_output_tokens or 0,  # 0: the rest of the context window
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        constraint=constraint,
    )
    # A namespace's functions are offered by their own names (the call's item names
    # the namespace again: ResponseEncoder).
    tools = tuple(
        FunctionTool(t.name, t.description, t.parameters, t.strict) for t, _ in body.functions()
    )
    return ChatRequest(
        sampling=sampling,
        messages=turns(conversation, body.instructions),
        tools=tools,
        tool_choice=_tool_choice(body.tool_choice) if tools else None,
        parallel_tool_calls=body.parallel_tool_calls,
    )


def _tool_params(body: ResponsesRequest) -> list[str]:
    """Where each function tool offered to the core is in the request (``tools.4``, or
    ``tools.4.tools.1`` in a namespace)."""
    where: list[str] = []
    for i, tool in enumerate(body.tools or []):
        if tool.type == "namespace":
            where += [f"tools.{i}.tools.{j}" for j in range(len(getattr(tool, "tools", [])))]
        elif tool.type == "function":
            where.append(f"tools.{i}")
    return where


def _param(param: str | None, body: ResponsesRequest) -> str | None:
    """A field's name as the core spells it (chat's), as this API spells it."""
    if param is None:
        return None
    if param.startswith("tools.") and ".function." in param:
        index, rest = param.split(".function.", 1)
        where = _tool_params(body)
        n = int(index.removeprefix("tools."))
        return f"{where[n]}.{rest}" if n < len(where) else f"{index}.{rest}"
    return {"response_format": "text.format", "max_tokens": "max_output_tokens"}.get(param, param)


def skeleton(body: ResponsesRequest, model: str, response_id: str) -> dict[str, Any]:
    """The response as it starts: in progress, no output; the request's settings."""
    text = body.text.model_dump(mode="json", by_alias=True, exclude_none=True) if body.text else {}
    text.setdefault("format", {"type": "text"})
    choice = body.tool_choice
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": model,
        "output": [],
        "usage": None,
        "incomplete_details": None,
        "error": None,
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "max_output_tokens": body.max_output_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        # The tools served: hosted ones left out are not (the omitted-tools header).
        "tools": [
            t.model_dump(mode="json", exclude_none=True)
            for t in body.tools or []
            if not isinstance(t, BuiltinToolParam)
        ],
        "tool_choice": choice.model_dump() if isinstance(choice, NamedFunctionChoice)
        else choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": text,
        "store": body.store,
        "metadata": body.metadata or {},
        "user": body.user,
        "background": False,
        # As asked (a model that does not reason does nothing with it).
        "reasoning": body.reasoning.model_dump(exclude_none=True) if body.reasoning else None,
        "truncation": "disabled",
    }  # fmt: skip


def check_tools(deployment: Deployment, body: ResponsesRequest) -> tuple[str, ...]:
    """The built-in tools the deployment leaves out (or a 400, where it refuses them)."""
    offered = [(f"tools.{i}.type", t.type) for i, t in body.builtin_tools()]
    policy = deployment.config.hosted_tools
    return hosted_tools(policy, deployment.id, offered, "offer function tools only")


async def open_response(
    gateway: Gateway,
    deployment: Deployment,
    body: ResponsesRequest,
    request_id: str,
    caller: Caller,
    store: ResponseStore,
) -> ResponseRun:
    """Read the conversation, open its generation through the gateway (may raise)."""
    omitted = check_tools(deployment, body)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = await store.get(body.previous_response_id, caller.account_id)
        if previous is None:
            error = not_found(body.previous_response_id)
            error.param = "previous_response_id"
            raise error
        history = [*previous.input_items, *output_items(previous.body)]
    conversation = [*history, *stored_items(body.items())]
    try:
        generation = await open_generation(
            gateway, deployment, chat_request(body, conversation), request_id, caller
        )
    except InvalidRequestError as e:
        e.param = _param(e.param, body)
        raise
    response = skeleton(body, body.model or deployment.id, new_id("resp"))
    return ResponseRun(
        generation=generation,
        encoder=ResponseEncoder(response, {t.name: ns for t, ns in body.functions() if ns}),
        store=store if body.store else None,
        account_id=caller.account_id,
        conversation=conversation,
        omitted_tools=omitted,
        activity_s=gateway.settings.stream_activity_s,
    )


def serve_response(call: Call, body: ResponsesRequest) -> Coroutine[Any, Any, ResponseRun]:
    """``POST /v1/responses``: an unknown model or a refused hosted tool at once (a 400
    before any stream), then the opening."""
    deployment = call.gateway.deployment(body.model)
    check_tools(deployment, body)
    return open_response(
        call.gateway, deployment, body, call.request_id, call.caller, call.responses
    )


# The Responses stream's pings are SSE comments (it has no ping event); a stream that
# waited behind them and is then refused ends with the API's error event.
IN_BAND = InBand(error=lambda error: encode_typed_event(opening_failed(error)))
RESPONSES = Endpoint("/v1/responses", ResponsesRequest, serve_response, TAGS, IN_BAND)


async def get_response(store: ResponseStore, response_id: str, caller: Caller) -> dict[str, Any]:
    stored = await store.get(response_id, caller.account_id)
    if stored is None:
        raise not_found(response_id)
    return stored.body


async def delete_response(store: ResponseStore, response_id: str, caller: Caller) -> dict[str, Any]:
    if not await store.delete(response_id, caller.account_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


async def input_items(
    store: ResponseStore, response_id: str, caller: Caller, query: InputItemsQuery
) -> dict[str, Any]:
    """A page of the response's input items (the conversation up to its input)."""
    stored = await store.get(response_id, caller.account_id)
    if stored is None:
        raise not_found(response_id)
    items = stored.input_items if query.order == "asc" else stored.input_items[::-1]
    if query.after is not None:
        ids = [i.get("id") for i in items]
        if query.after not in ids:
            raise InvalidRequestError(
                f"'after' is {query.after!r}, which is no input item of {response_id!r}; "
                "send the id of an item of the previous page",
                param="after",
            )
        items = items[ids.index(query.after) + 1 :]
    page = items[: query.limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }
