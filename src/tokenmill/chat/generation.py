"""One generation through the gateway, read back as neutral events.

:func:`open_generation` turns a :class:`~tokenmill.chat.request.ChatRequest` into
the engine's :class:`~tokenmill.engines.base.GenerationRequest` (the turns rendered,
the tools described or handed to the template, the constraint set, the schema put in
the prompt) and opens it through the gateway; :class:`Generation` reads its chunks
back as :mod:`tokenmill.chat.events`, one answer a choice
(:mod:`tokenmill.chat.answers`).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import replace

from tokenmill.chat.answers import Answer, CallingAnswer, TextAnswer, ToolOutput
from tokenmill.chat.events import (
    ChoiceEnd,
    ChoiceResult,
    Event,
    Finished,
    Result,
    TextDelta,
    ToolCallEnd,
)
from tokenmill.chat.request import ChatRequest, Turn
from tokenmill.chat.structured import instruct
from tokenmill.chat.tools import plain, plan_tools, template_needed
from tokenmill.engines import (
    ChatMessage,
    GenerationRequest,
    TokenizeRequest,
    TokenLogprob,
    ToolCall,
    Usage,
)
from tokenmill.errors import ContextLengthError
from tokenmill.gateway import Deployment, Gateway, RequestStream
from tokenmill.identity import Caller

__all__ = ["Generation", "count_prompt", "open_generation"]


class Generation:
    """An open generation: iterate :meth:`events` or await :meth:`collect`, once;
    :meth:`aclose` always (it settles the bill, and is safe to call twice)."""

    def __init__(self, stream: RequestStream, output: ToolOutput = "text") -> None:
        self.stream = stream
        self._output = output

    @property
    def request_id(self) -> str:
        return self.stream.request_id

    @property
    def choices(self) -> int:
        """How many choices: ``n`` for each prompt."""
        return self.stream.request.choices

    @property
    def tool_calls(self) -> bool:
        """Whether the answer is read for tool calls (tools were offered and may be
        called); log probabilities are then not reported."""
        return self._output != "text"

    def _answers(self) -> dict[int, Answer]:
        echo = self.stream.request.sampling.echo
        if self.tool_calls:
            return {i: CallingAnswer.reading(i, self._output) for i in range(self.choices)}
        return {i: TextAnswer(i, prompt=echo) for i in range(self.choices)}

    async def events(self) -> AsyncIterator[Event]:
        """The events of every choice, then :class:`Finished` (see
        :mod:`tokenmill.chat.events`). An error after the stream began is raised."""
        answers = self._answers()
        async for chunk in self.stream:
            index = chunk.index
            answer = answers[index]
            events, ends = answer.take(chunk)
            for event in events:
                yield event
            if not ends:
                continue
            stop = chunk.stop_sequence
            if chunk.choice_finish is not None:
                for event in answer.end(chunk.choice_finish, stop):
                    yield event
            if chunk.finish_reason is not None:
                # The request's end: its last choice's, and any still open (an abort).
                for i in [index, *(i for i in answers if i != index)]:
                    if not answers[i].finished:
                        matched = stop if i == index else None
                        for event in answers[i].end(chunk.finish_reason, matched):
                            yield event
        yield Finished(self.usage())

    def usage(self) -> Usage:
        """The request's usage: the engine's count once it ended, else the prompt's."""
        return self.stream.usage or Usage(self.stream.prompt_tokens, 0)

    async def collect(self) -> Result:
        """Every choice, whole."""
        texts: dict[int, list[str]] = {i: [] for i in range(self.choices)}
        tokens: dict[int, list[TokenLogprob]] = {i: [] for i in range(self.choices)}
        calls: dict[int, list[ToolCall]] = {i: [] for i in range(self.choices)}
        ends: dict[int, ChoiceEnd] = {}
        usage = Usage(0, 0)
        async for e in self.events():
            if isinstance(e, TextDelta):
                texts[e.choice].append(e.text)
                tokens[e.choice].extend(e.logprobs)
            elif isinstance(e, ToolCallEnd):
                calls[e.choice].append(ToolCall(e.id, e.name, e.arguments))
            elif isinstance(e, ChoiceEnd):
                ends[e.choice] = e
            elif isinstance(e, Finished):
                usage = e.usage
        choices = tuple(
            ChoiceResult(
                text="".join(texts[i]),
                tool_calls=tuple(calls[i]),
                logprobs=tuple(tokens[i]),
                reason=ends[i].reason if i in ends else "stop",
                stop_sequence=ends[i].stop_sequence if i in ends else None,
            )
            for i in range(self.choices)
        )
        return Result(choices, usage)

    async def aclose(self) -> None:
        await self.stream.aclose()


async def open_generation(
    gateway: Gateway,
    deployment: Deployment,
    request: ChatRequest,
    request_id: str,
    caller: Caller,
    *,
    session: str | None = None,
    up_to_window: bool = False,
) -> Generation:
    """Check, build and open the engine request (may raise: a 400 naming the field,
    or whatever the gateway refuses with before streaming). ``session`` is the
    routing's affinity hint (a conversation's id, or its user); ``up_to_window``
    serves a ``max_tokens`` past the context window up to it (:meth:`Gateway.open`)."""
    engine_request, output = await _engine_request(deployment, request, request_id)
    stream = await gateway.open(
        deployment, engine_request, caller, session=session, up_to_window=up_to_window
    )
    return Generation(stream, output)


async def count_prompt(deployment: Deployment, request: ChatRequest) -> int:
    """The prompt tokens a generation of ``request`` is billed for (its usage's
    ``prompt_tokens``: cached tokens included), counted as :func:`open_generation`
    counts them: the same rendering (tools, calls, constraint), and a replica's
    ``prepare`` of the same engine request. Checks the request as a generation would
    (may raise a 400 naming the field); admits, holds and generates nothing. A prompt
    longer than the context is counted all the same (a client counts to learn what
    to cut), by the replica's tokenizer over the same rendered turns."""
    request_id = f"count-{secrets.token_hex(8)}"  # what prepare() keeps ages out unused
    engine_request, _ = await _engine_request(deployment, request, request_id)
    host = await deployment.any_host()
    try:
        return (await host.prepare(engine_request)).prompt_tokens
    except ContextLengthError:
        # prepare() asks room for one token more; tokenize() renders the same turns
        # (the template's own tools aside: those only prepare() renders).
        if engine_request.messages is None or engine_request.tools is not None:
            raise
        rendered = TokenizeRequest(
            messages=engine_request.messages, chat_template=engine_request.chat_template
        )
        return len(await host.tokenize(rendered))


async def _engine_request(
    deployment: Deployment, request: ChatRequest, request_id: str
) -> tuple[GenerationRequest, ToolOutput]:
    """The engine's request for ``request`` and how its answer is read (may raise a
    400 naming the field)."""
    if request.kind == "chat" and request.messages is None:
        assert request.prompt is not None, "a chat has messages or a prompt"
        request = replace(request, messages=(Turn("user", request.prompt),), prompt=None)
    template = None  # the template the turns are rendered with, where tools need it
    if template_needed(request):
        template = request.chat_template
        if template is None:
            template = await deployment.chat_template()
    sampling = request.sampling
    plan = plan_tools(request, deployment.config.engine, template)
    chat: tuple[ChatMessage, ...] | None = None
    if plan is not None:
        chat = plan.messages
        if plan.constraint is not None:  # the tool format, the answer branch included
            sampling = replace(sampling, constraint=plan.constraint)
        elif sampling.constraint is not None:
            chat = instruct(chat, sampling.constraint)
    elif request.messages is not None:
        chat = tuple(plain(m) for m in request.messages)
        if sampling.constraint is not None:
            chat = instruct(chat, sampling.constraint)
    if chat is not None and request.session_lines:
        chat = _with_session_lines(chat, request.session_lines)
    engine_request = GenerationRequest(
        request_id=request_id,
        sampling=sampling,
        prompt=request.prompt,
        prompt_tokens=request.prompt_tokens,
        prompts=request.prompts,
        messages=chat,
        chat_template=request.chat_template,
        n=request.n,
        tools=None if plan is None else plan.spec,
    )
    return engine_request, "text" if plan is None else plan.output


def _with_session_lines(chat: tuple[ChatMessage, ...], lines: str) -> tuple[ChatMessage, ...]:
    """``chat`` with ``lines`` ending its first system message (or one put first)."""
    if chat and chat[0].role == "system":
        first = chat[0]
        content = f"{first.content}\n\n{lines}" if first.content else lines
        return (replace(first, content=content), *chat[1:])
    return (ChatMessage("system", lines), *chat)
