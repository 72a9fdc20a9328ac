"""The generation core: what a chat (or a completion) turns into, and how the engine's
chunks turn back into text, tool calls or JSON. Every HTTP API is a thin adapter over it.

Interface changes since first published (the package's first commit): additions only,
``Generation.tool_calls`` (whether the answer is read for calls),
``Generation.usage()``, :func:`count_prompt` (which counts a prompt longer than the
context too), ``stop_sequence`` on :class:`ChoiceEnd` and :class:`ChoiceResult`, and
``complete`` on :class:`ToolCallEnd` (false: the call was cut by ``max_tokens``),
``ChatRequest.session_lines`` and :func:`split_system` (a system prompt's per-session
lines placed after what sessions share: :mod:`tokenmill.chat.layout`).

Layering: this package sits under ``server/`` and over ``gateway/``. It imports no
web framework and no ``tokenmill.server`` module; an API adapter imports it, never the
other way round. The model's own chat template comes down through the deployment
(:meth:`~tokenmill.gateway.deployment.Deployment.chat_template`), never up through
the HTTP layer.

What an adapter gives (:mod:`tokenmill.chat.request`, plain dataclasses):

* a :class:`ChatRequest`: the turns (:class:`Turn`, an assistant's
  :class:`~tokenmill.engines.base.ToolCall` s and the ``tool`` results included) or a
  prompt, the engine's :class:`~tokenmill.engines.base.SamplingParams` (its
  ``constraint`` is the structured output, from whatever field the API has: build a
  response format's with :meth:`ResponseFormat.constraint`), the
  :class:`FunctionTool` s offered (JSON-schema ``parameters``), the
  :data:`ToolChoice` (``"auto"``, ``"required"``, ``"none"``, or a
  :class:`NamedTool`), ``parallel_tool_calls``, ``n``, a chat template;
* the gateway, the deployment, the request id and the caller, to
  :func:`open_generation`.

:func:`open_generation` validates what only the core can judge (tool names, a named
tool that is not offered, a constraint beside a template's markup, tools on a
completion...) and raises :class:`~tokenmill.errors.InvalidRequestError` naming the
field as the OpenAI API spells it (``tools.1.function.name``, ``tool_choice``); an
adapter whose API names fields otherwise maps ``param``. It then opens the request
through the gateway (admission, the hold on credit: may raise) and returns a
:class:`Generation`.

What an adapter gets (:mod:`tokenmill.chat.events`): from :meth:`Generation.events`,
an async iterator of API-neutral events, every one naming its ``choice``:

* :class:`TextDelta`: text (the answer, or JSON under a response format; with
  ``echo``, first the prompt), with its tokens' log probabilities when asked for;
* :class:`ToolCallStart` (``call`` index, ``id``, ``name``), then
  :class:`ToolCallArguments` (fragments of the arguments' JSON text, in order), then
  :class:`ToolCallEnd` (the whole arguments text) once the call is complete;
* :class:`ChoiceEnd` with its :data:`FinishReason` (``stop``, ``length``,
  ``tool_calls``, ``error``), after every event of that choice, and the stop string
  that ended it (``stop_sequence``) where the engine reports one;
* :class:`Finished` with the request's :class:`~tokenmill.engines.base.Usage`, last.

An error after the stream began (a replica crash, a shutdown) is raised out of the
iterator as a :class:`~tokenmill.errors.ServiceError`: the adapter encodes it as
its API's in-band error event. Or :meth:`Generation.collect`: the same, whole, as a
:class:`Result` (one :class:`ChoiceResult` a choice, and the usage). Either way the
adapter must see :meth:`Generation.aclose` called (the gateway's stream settles the
bill there): the server's SSE response and ``run_until_disconnect`` do that.

:func:`count_prompt` counts a request's prompt as a generation of it would be billed
(the same rendering, tools and calls included), without generating: for a
count-tokens route.

How tools are served (rendering, the generic JSON format and Hermes' markup, what is
forwarded to an upstream server) is :mod:`tokenmill.chat.tools`' docstring.
"""

from __future__ import annotations

from tokenmill.chat.events import (
    ChoiceEnd,
    ChoiceResult,
    Event,
    Finished,
    FinishReason,
    Result,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from tokenmill.chat.generation import Generation, count_prompt, open_generation
from tokenmill.chat.layout import PromptOrder, SystemBlock, SystemSplit, split_system
from tokenmill.chat.request import (
    ChatRequest,
    FunctionTool,
    NamedTool,
    ResponseFormat,
    ToolChoice,
    Turn,
)

__all__ = [
    "ChatRequest",
    "ChoiceEnd",
    "ChoiceResult",
    "Event",
    "FinishReason",
    "Finished",
    "FunctionTool",
    "Generation",
    "NamedTool",
    "PromptOrder",
    "ResponseFormat",
    "Result",
    "SystemBlock",
    "SystemSplit",
    "TextDelta",
    "ToolCallArguments",
    "ToolCallEnd",
    "ToolCallStart",
    "ToolChoice",
    "Turn",
    "count_prompt",
    "open_generation",
    "split_system",
]
