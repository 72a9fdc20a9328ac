"""Tool calling: how a chat request with tools is rendered, constrained and read.

A chat template that knows tools (Hermes' markup, as Qwen's and Hermes' write it:
``<tool_call>{"name", "arguments"}</tool_call>``) renders the tools and the turns
itself (:class:`~tokenmill.engines.base.ToolSpec`), and its markup is read back out
of the text (:class:`~tokenmill.chat.toolcalls.MarkupReader`); ``required`` and a
named function constrain the output to that markup around valid calls (a Lark
grammar), ``auto`` leaves the model free. Which template: the request's
``chat_template``, else the model's own (the deployment's
:meth:`~tokenmill.gateway.deployment.Deployment.chat_template`).

SmolLM2's template (and many others) has no notion of tools, so for those tokenmill
does what llama-server does (its "generic" chat format):

* the tools are described in a system message (the first one, or one put first),
  with how to answer: one JSON object, ``{"tool_calls": [{"name", "arguments"}]}``
  to call tools or ``{"response": "..."}`` to answer the user;
* the output is constrained (:class:`~tokenmill.engines.base.Constraint`, a JSON
  Schema) to exactly that: a name from the list, arguments valid against that tool's
  ``parameters``, or an answer. ``tool_choice: "required"`` and a named function drop
  the answer branch (a named one allows one call of that tool); ``parallel_tool_calls:
  false`` allows one call; ``"none"`` leaves the output free and the tools out of
  the prompt;
* the turns of an earlier exchange are written the same way: an assistant turn's
  ``tool_calls`` as the JSON it would have generated, the ``tool`` results as a user
  turn holding ``{"tool_response": ...}`` (templates that alternate user and
  assistant accept that, and a model trained on neither reads it as well as any).

A deployment that proxies another server (``engine = "upstream"``) gets the fields
and the turns unchanged (:class:`~tokenmill.engines.base.ToolSpec`): that server
calls tools its own way, and its calls come back as the chunks' ``tool_calls``.

The description is part of the prompt, so its tokens are counted, held for and billed
like the rest of it. :mod:`tokenmill.chat.toolcalls` reads the calls back out of
the output as it streams; :mod:`tokenmill.chat.answers` turns them into the core's
events, which each API shapes its own way.

Refused with a 400 naming the field (as OpenAI's API spells it): ``tool_choice``
(other than ``none``/``auto``) without tools, or naming a tool not offered; two tools
of one name; ``parameters`` that is not an object schema; tools on a completion route;
log probabilities with tools; ``response_format`` other than a JSON schema or object
beside tools (the answer branch takes that schema).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tokenmill.chat.request import ChatRequest, FunctionTool, NamedTool, ToolChoice, Turn
from tokenmill.engines import ChatMessage, Constraint, ToolSpec, bound_numbers
from tokenmill.errors import InvalidRequestError

ToolOutput = Literal["text", "generic", "markup", "forwarded"]

# The schema of a function declared without ``parameters``: it takes no arguments.
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a chat request with tools (or with an earlier exchange of calls) is run."""

    messages: tuple[ChatMessage, ...]  # rendered for a template that knows no tools
    # The generic format's schema (replacing the request's own constraint, which
    # becomes its answer branch's); None: the request's constraint stands.
    constraint: Constraint | None
    # Where the answer's calls are: nowhere ("text"), in the generic format's JSON
    # ("generic"), in the template's markup ("markup"), in the engine's own calls
    # ("forwarded": an upstream's).
    output: ToolOutput
    # Tools the engine passes on unchanged (an upstream) or renders with the template.
    spec: ToolSpec | None = None


def plan_tools(request: ChatRequest, engine: str, template: str | None = None) -> ToolPlan | None:
    """The plan of a request, or None when it involves no tools at all. ``engine``:
    the deployment's engine; ``template``: the chat template the turns are rendered
    with, when known. Raises :class:`InvalidRequestError` (a 400 naming the field) for
    what cannot be served."""
    tools = list(request.tools)
    choice = request.tool_choice
    parallel = request.parallel_tool_calls is not False
    messages = request.messages or ()
    constraint = request.sampling.constraint
    _check_tools(tools, choice)
    active = bool(tools) and choice != "none"
    history = any(m.tool_calls or m.role == "tool" for m in messages)
    if active and request.kind != "chat":
        raise InvalidRequestError(
            "tools are for chat: this request is a text completion (the deployment's "
            "endpoint_type, or the route asked for); send messages to a chat route",
            param="tools",
        )
    if engine == "upstream" and (tools or history):
        return _forwarded(request, tools, messages)
    if not active and not history:
        return None
    if active and request.sampling.logprobs is not None:
        raise InvalidRequestError(
            "log probabilities are not reported beside tools; leave 'logprobs' out or "
            "send tool_choice 'none'",
            param="logprobs",
        )
    offered = tools if active else []
    named = choice.name if isinstance(choice, NamedTool) else None
    if named is not None:  # one call of that function, as OpenAI makes it
        offered = [t for t in tools if t.name == named]
        parallel = False
    if knows_tools(template):
        if active and constraint is not None:
            # The template's markup and a response format cannot both hold the text.
            raise InvalidRequestError(
                "this model's template writes tool calls in its own markup, which a "
                f"{constraint.kind} constraint would forbid; send tools or the "
                "constraint, not both (or tool_choice 'none')",
                param=constraint.param,
            )
        return _templated(request, tools if active else [], messages, named, parallel)
    rendered = _render(messages)
    if not active:
        return ToolPlan(rendered, None, output="text")
    answer = None if choice == "required" or named else _answer_schema(constraint)
    schema = generic_schema(offered, answer=answer, parallel=parallel)
    prompt = describe_tools(
        offered, answer=answer is not None, parallel=parallel, named=named, answer_schema=answer
    )
    return ToolPlan(
        _with_system(rendered, prompt),
        Constraint("json_schema", json.dumps(schema), name="tool_calls", param="tools"),
        output="generic",
    )


def plain(turn: Turn) -> ChatMessage:
    """A turn as the engine's plain message: its role and text."""
    return ChatMessage(turn.role, turn.content)


def _turns(messages: Sequence[Turn]) -> tuple[ChatMessage, ...]:
    """The turns as they are, their calls and call ids included."""
    return tuple(
        ChatMessage(m.role, m.content, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id)
        for m in messages
    )


def _spec(request: ChatRequest, tools: list[FunctionTool]) -> ToolSpec:
    """The tools as an OpenAI-compatible server takes them (the engine's ToolSpec)."""
    choice = request.tool_choice
    return ToolSpec(
        tools=json.dumps([_openai_tool(t) for t in tools]),
        choice=None if choice is None else json.dumps(_openai_choice(choice)),
        parallel=request.parallel_tool_calls,
    )


def _openai_tool(tool: FunctionTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    for key in ("description", "parameters", "strict"):
        value = getattr(tool, key)
        if value is not None:
            function[key] = value
    return {"type": "function", "function": function}


def _openai_choice(choice: ToolChoice) -> Any:
    if isinstance(choice, NamedTool):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _forwarded(
    request: ChatRequest, tools: list[FunctionTool], messages: Sequence[Turn]
) -> ToolPlan:
    """For a server that calls tools itself: the fields and the turns as they are."""
    if not tools:
        return ToolPlan(_turns(messages), None, output="text")
    return ToolPlan(_turns(messages), None, output="forwarded", spec=_spec(request, tools))


# How a template that knows tools writes a call: Hermes' markup (Qwen 2.5 and 3,
# Hermes 2 and 3, and many fine-tunes of them).
CALL_OPEN = "<tool_call>"


def knows_tools(template: str | None) -> bool:
    """Whether a chat template renders tools and writes calls in Hermes' markup."""
    return template is not None and CALL_OPEN in template and "tools" in template


def _templated(
    request: ChatRequest,
    tools: list[FunctionTool],
    messages: Sequence[Turn],
    named: str | None,
    parallel: bool,
) -> ToolPlan:
    """For a template that knows tools: it renders them and the turns; its markup is
    read back out of the text. ``required`` and a named function constrain the output
    to that markup around valid calls; ``auto`` leaves the model free to call."""
    if not tools:
        return ToolPlan(_turns(messages), None, output="text")
    constraint = None
    if request.tool_choice == "required" or named is not None:
        offered = [t for t in tools if named is None or t.name == named]
        constraint = Constraint("lark", markup_grammar(offered, parallel), param="tools")
    return ToolPlan(_turns(messages), constraint, output="markup", spec=_spec(request, tools))


def markup_grammar(tools: Sequence[FunctionTool], parallel: bool) -> str:
    """A Lark grammar (llguidance's) of one or more calls in Hermes' markup."""
    calls = generic_schema(tools, answer=None, parallel=True)["properties"]["tool_calls"]
    call = {
        "x-guidance": {
            "whitespace_flexible": False,
            "item_separator": ", ",
            "key_separator": ": ",
        },
        **bound_numbers(calls["items"]),
    }
    repeat = ' ("\\n" call)*' if parallel else ""
    return (
        f"start: call{repeat}\n"
        f'call: "{CALL_OPEN}\\n" args "\\n</tool_call>"\n'
        f"args: %json {json.dumps(call)}\n"
    )


def template_needed(request: ChatRequest) -> bool:
    """Whether serving ``request`` depends on its chat template (does it know tools?)."""
    return request.kind == "chat" and bool(request.tools)


def _check_tools(tools: list[FunctionTool], choice: ToolChoice | None) -> None:
    if not tools and choice not in (None, "none", "auto"):
        raise InvalidRequestError(
            "tool_choice asks for a tool call but no tools are given; send 'tools' or "
            "leave tool_choice out",
            param="tool_choice",
        )
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.name
        if name in seen:
            raise InvalidRequestError(
                f"two tools are named {name!r}; a call names its tool, so names must differ",
                param=f"tools.{i}.function.name",
            )
        seen.add(name)
        params = tool.parameters
        if params and params.get("type", "object") != "object":
            raise InvalidRequestError(
                f"the parameters of {name!r} are a schema of type {params['type']!r}; "
                "arguments are a JSON object, so parameters is an object schema "
                '({"type": "object", "properties": {...}})',
                param=f"tools.{i}.function.parameters",
            )
    if isinstance(choice, NamedTool) and choice.name not in seen:
        offered = ", ".join(sorted(seen))
        raise InvalidRequestError(
            f"tool_choice names {choice.name!r}, which is not among the tools "
            f"({offered}); name one of them",
            param="tool_choice",
        )


def _answer_schema(constraint: Constraint | None) -> dict[str, Any]:
    """The schema of a plain answer: text, or the request's own response_format."""
    if constraint is None:
        return {"type": "string"}
    if constraint.kind == "json_schema":
        schema: dict[str, Any] = json.loads(constraint.text)
        return schema
    if constraint.kind == "json_object":
        return {"type": "object"}
    raise InvalidRequestError(
        f"a {constraint.kind} constraint cannot be combined with tools: the answer "
        "beside a tool call is JSON; send a json_schema or json_object response_format, "
        "or tool_choice 'none'",
        param=constraint.param,
    )


def arguments_schema(tool: FunctionTool) -> dict[str, Any]:
    """A tool's ``parameters``, with no properties beyond those it declares (a small
    model otherwise invents some) unless it says otherwise."""
    params = tool.parameters
    if not params:
        return NO_ARGUMENTS
    params = dict(_without_string_keys(params))
    if "additionalProperties" in params or "properties" not in params:
        return params
    return {**params, "additionalProperties": False}


def _without_string_keys(schema: Any, names: bool = False) -> Any:
    """``schema`` without ``propertyNames: {"type": "string"}``, which every JSON
    object meets (its keys are strings) and which the grammar compiler does not
    implement (Claude Code's tools declare it); any other ``propertyNames`` stays.
    ``names``: ``schema`` maps property names to schemas (``properties``)."""
    if isinstance(schema, list):
        return [_without_string_keys(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        k: _without_string_keys(v, names=not names and k in ("properties", "$defs"))
        for k, v in schema.items()
        if names or not (k == "propertyNames" and v == {"type": "string"})
    }


def generic_schema(
    tools: Sequence[FunctionTool], *, answer: dict[str, Any] | None, parallel: bool
) -> dict[str, Any]:
    """The JSON Schema of the generic format: calls of ``tools`` (one, unless
    ``parallel``) or, with an ``answer`` schema, an answer."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "const": t.name},
                "arguments": arguments_schema(t),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    call = {
        "type": "object",
        "properties": {"tool_calls": array},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    if answer is None:
        return call
    response = {
        "type": "object",
        "properties": {"response": answer},
        "required": ["response"],
        "additionalProperties": False,
    }
    return {"anyOf": [call, response]}


def describe_tools(
    tools: Sequence[FunctionTool],
    *,
    answer: bool,
    parallel: bool,
    named: str | None,
    answer_schema: dict[str, Any] | None = None,
) -> str:
    """The system prompt's part that offers the tools and says how to answer (with
    ``answer_schema``, a reply that is JSON following it: a response_format)."""
    lines = [
        json.dumps(
            {
                "name": t.name,
                "description": t.description or "",
                "parameters": t.parameters or NO_ARGUMENTS,
            },
            ensure_ascii=False,
        )
        for t in tools
    ]
    shape = '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}'
    how = "one call" if not parallel else "one or more calls"
    if named is not None:
        ask = f"Call the tool {named!r}, answering with one JSON object: {shape}"
    elif answer:
        reply = '"<your reply>"'
        if answer_schema is not None and answer_schema != {"type": "string"}:
            schema = json.dumps(answer_schema, ensure_ascii=False)
            reply = f"<your reply, JSON following this schema: {schema}>"
        ask = (
            f"Answer with one JSON object: to call tools ({how}), {shape}; to reply to "
            f'the user directly, {{"response": {reply}}}.'
        )
    else:
        ask = f"Call tools ({how}), answering with one JSON object: {shape}"
    return (
        "You can call the following tools; each one's arguments follow the JSON Schema "
        "in its parameters:\n" + "\n".join(lines) + "\n\n" + ask
    )


def _with_system(messages: tuple[ChatMessage, ...], text: str) -> tuple[ChatMessage, ...]:
    """``messages`` with ``text`` ending the first system message (or one put first)."""
    if messages and messages[0].role == "system":
        first = messages[0]
        joined = f"{first.content}\n\n{text}" if first.content else text
        return (ChatMessage("system", joined), *messages[1:])
    return (ChatMessage("system", text), *messages)


def _render(messages: Sequence[Turn]) -> tuple[ChatMessage, ...]:
    """The conversation as plain turns: calls as the generic format's JSON, results as
    a user turn (consecutive results share one)."""
    names: dict[str, str] = {}  # tool_call_id -> the tool it called
    out: list[ChatMessage] = []
    results: list[str] = []  # the tool results of the turn being gathered

    def end_results() -> None:
        if results:
            out.append(ChatMessage("user", "\n".join(results)))
            results.clear()

    for m in messages:
        text = m.content
        if m.role == "tool":
            result: dict[str, Any] = {"name": m.name or names.get(m.tool_call_id or "", "")}
            if m.tool_call_id:
                result["tool_call_id"] = m.tool_call_id
            result["content"] = text
            results.append(json.dumps({"tool_response": result}, ensure_ascii=False))
            continue
        end_results()
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for call in m.tool_calls:
                if call.id:
                    names[call.id] = call.name
                calls.append({"name": call.name, "arguments": _json(call.arguments)})
            written = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            content = f"{text}\n{written}" if text else written
            out.append(ChatMessage("assistant", content))
        else:
            out.append(plain(m))
    end_results()
    return tuple(out)


def _json(text: str) -> Any:
    """Arguments as sent: their JSON value, or the text itself if it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text
