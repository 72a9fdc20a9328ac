"""The one engine interface every inference backend implements.

An engine turns a :class:`GenerationRequest` into an async stream of :class:`Chunk`
objects. It knows prompts, token ids and text; it never knows HTTP, API keys or
money. Usage (prompt and completion token counts) travels on the last chunk, which
is the only chunk with a ``finish_reason``.

Contract every implementation keeps:

* ``generate`` returns a :class:`~tokenmill.engines.chunks.ChunkStream` at once and
  fills it: text deltas that are whole UTF-8 characters and never contain (part of) a
  stop string, then exactly one final item: a chunk with ``finish_reason`` and
  ``usage``, or an exception. ``completion_tokens`` never exceeds ``max_tokens``.
* ``cancel`` is the one way to stop a request early. It returns at once; within a
  step or two the engine ends the stream with a final ``abort`` chunk whose usage
  counts the tokens really produced (which the caller pays for) and frees the
  request's capacity. An unknown or finished request id is ignored.
* A request with several choices (``n``, several ``prompts``) still has one stream
  and one final chunk, whose usage covers every choice; chunks carry their choice's
  ``index``, and a choice ending before the last says so with ``choice_finish``. An
  engine that generates one choice only refuses more in ``prepare``
  (``InvalidRequestError`` naming ``n``, or ``prompt`` for several prompts).
* The chunk that ends a choice on one of the request's stop strings names it in
  ``stop_sequence`` (finish reason ``stop``); an engine that cannot tell which
  matched (an OpenAI-compatible upstream) leaves it None.
* Errors are raised as :mod:`tokenmill.errors` exceptions: by ``prepare`` (or
  ``generate``) when they concern the request (context too long), as the stream's
  final item otherwise.

A new backend (vLLM, say) is one more class with these methods and a
``from_config`` constructor taking its deployment's config section; where it runs
(the gateway's process, a child process, a Ray actor) is the replica host's business
(:mod:`tokenmill.replicas.host`), not the engine's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar, runtime_checkable

from tokenmill.engines.chunks import ChunkStream
from tokenmill.engines.results import (
    Chunk,
    FinishReason,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from tokenmill.kvblocks import CacheEvent

__all__ = [
    "PREPARED_CACHE",
    "CachePublishing",
    "ChatMessage",
    "Chunk",
    "ChunkStream",
    "Constraint",
    "ConstraintKind",
    "Engine",
    "EngineHealth",
    "FinishReason",
    "GenerationRequest",
    "KvMoving",
    "KvState",
    "Prepared",
    "PromptInfo",
    "PromptItem",
    "SamplingParams",
    "StepSink",
    "SteppedEngine",
    "TokenLogprob",
    "TokenizeRequest",
    "TokenizerInfo",
    "TokenizingEngine",
    "ToolCall",
    "ToolCallDelta",
    "ToolSpec",
    "TopLogprob",
    "Usage",
    "refuse_choices",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int  # 0: until the context window is full
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    # Keep generating past end-of-sequence until max_tokens (benchmarks, load tests).
    ignore_eos: bool = False
    # Speculative decoding for this request: None, the deployment's ``speculative``.
    speculative: bool | None = None
    # (token id, bias) added to the logits before sampling; -100 bans a token, 100
    # all but forces it (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Report each token's log probability and this many most likely alternatives
    # (None: no log probabilities).
    logprobs: int | None = None
    # The first chunk is the prompt: its text and, with ``logprobs``, its tokens'
    # (the first token's log probability is None: nothing came before it).
    echo: bool = False
    # The output must match this grammar (structured outputs, tool calls).
    constraint: Constraint | None = None


ConstraintKind = Literal["json_object", "json_schema", "gbnf", "lark", "regex", "choice"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a generation's text must match. An engine that supports it masks each
    sequence's logits before sampling so that only tokens the grammar allows can be
    drawn, sequence by sequence inside its batch; one that cannot refuses it in
    ``prepare`` (``InvalidRequestError`` naming ``param``), never ignores it.

    ``kind`` and ``text``:

    * ``json_object``: any JSON object (``text`` unused);
    * ``json_schema``: ``text`` is a JSON Schema as JSON text; ``name`` is its name
      (OpenAI's ``json_schema.name``, forwarded to an upstream);
    * ``gbnf``: a llama.cpp GBNF grammar; ``lark``: a Lark grammar (llguidance's);
    * ``regex``: a regular expression the whole output matches;
    * ``choice``: a JSON list of strings, the output being exactly one of them.

    A grammar the engine cannot compile is an ``InvalidRequestError`` naming
    ``param``, the request field the constraint came from (``response_format``,
    ``grammar``, ``tools``...). Generation ends (``stop``) when the grammar is
    complete and allows nothing more, or at end-of-sequence once it is complete;
    ``max_tokens`` cutting it short is ``length``, as always.
    """

    kind: ConstraintKind
    text: str = ""
    name: str = ""
    strict: bool | None = None  # json_schema's ``strict``, forwarded to an upstream
    param: str = "response_format"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call an assistant turn made: its id, the function's name, the arguments as
    JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    # An assistant turn's calls; a tool turn's answer names its call (``tool_call_id``).
    # Set with ``GenerationRequest.tools`` only: otherwise the server has written calls
    # and results into ``content``.
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """OpenAI's ``tools`` and ``tool_choice`` as JSON text, and ``parallel_tool_calls``:
    for an engine that passes them on to a server that calls tools itself (an
    upstream; its calls come back as ``Chunk.tool_calls``), or that renders them with
    a chat template that knows tools (the server reads the template's markup back out
    of the text)."""

    tools: str
    choice: str | None = None
    parallel: bool | None = None


# One prompt of several (``GenerationRequest.prompts``): its text or its token ids.
PromptItem = str | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation. Exactly one of ``prompt``, ``prompt_tokens``, ``messages`` and
    ``prompts`` is set.

    ``messages`` are rendered by the engine with ``chat_template`` (a Jinja string)
    when given, else with the model's own template. ``prompt_tokens`` is a prompt
    already tokenized (by ``/tokenize``, or by the client with the same tokenizer).
    ``prompts`` are several prompts (``/v1/completions`` takes a list), each text or
    token ids.

    Every prompt gets ``n`` choices, numbered prompt by prompt: choice ``p * n + i``
    is prompt ``p``'s ``i``-th (OpenAI's ``index``). Each choice samples on its own
    (with a ``seed``, choice ``i`` of a prompt uses ``seed + i``); a prompt is
    prefilled and counted once however many choices share it.
    """

    request_id: str
    sampling: SamplingParams
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    chat_template: str | None = None
    prompt_tokens: tuple[int, ...] | None = None
    prompts: tuple[PromptItem, ...] | None = None
    n: int = 1
    # Tools passed on, or rendered by the chat template (``ToolSpec``); None where the
    # server wrote them into the messages itself (a template that knows no tools).
    tools: ToolSpec | None = None
    # The prompts as token ids, as another replica of the same deployment prepared
    # them (``PromptInfo.tokens``): an engine may take them instead of tokenizing the
    # prompt again. Set by the gateway only; the prompt fields stay as they were.
    tokenized: tuple[tuple[int, ...], ...] | None = None
    # Background work (the ``batch`` class: a Batch API line): its sequences sit out
    # the decode steps that prefill another request's prompt, so that it never slows
    # another's first token. Set by the gateway from the caller's class.
    background: bool = False

    def __post_init__(self) -> None:
        given = (self.prompt, self.messages, self.prompt_tokens, self.prompts)
        if sum(x is not None for x in given) != 1:
            raise ValueError(
                "exactly one of prompt, prompt_tokens, messages and prompts must be set"
            )
        if self.n < 1 or (self.prompts is not None and not self.prompts):
            raise ValueError("a generation has at least one prompt and one choice")

    @property
    def choices(self) -> int:
        """How many sequences this request generates: ``n`` for each prompt."""
        return self.n * (1 if self.prompts is None else len(self.prompts))


def refuse_choices(request: GenerationRequest, who: str) -> None:
    """For an engine that generates one choice a request: refuse ``n`` > 1 and
    several prompts with a 400 naming the field (never answer one of several)."""
    from tokenmill.errors import InvalidRequestError

    if request.prompts is not None and len(request.prompts) > 1:
        raise InvalidRequestError(
            f"{who} takes one prompt per request; send the prompts one by one",
            param="prompt",
        )
    if request.n > 1:
        raise InvalidRequestError(
            f"{who} generates one choice per request; send n=1 (or leave it out)", param="n"
        )


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """Text to tokenize: exactly one of ``prompt`` and ``messages`` (rendered as for
    a generation, with the generation prompt unless ``add_generation_prompt`` is false).

    ``add_special_tokens``: the tokens the model's tokenizer adds around a text (BOS
    where the model wants one), as a generation's prompt has them; false: the text's
    own tokens only (control tokens written in the text are still parsed)."""

    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    chat_template: str | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages must be set")


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    """What a client needs to tokenize like the model (vLLM's ``/tokenizer_info``):
    its special tokens as text (None where the model has none), its own chat template
    and the tokens one sequence may hold."""

    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int


@dataclass(frozen=True, slots=True)
class PromptInfo:
    """What admission and metering need to know before generation starts."""

    prompt_tokens: int  # all prompts together, each counted once
    context_length: int
    # The longest prompt, when there are several (else ``prompt_tokens``): what a
    # choice's room in the context is measured against.
    longest_prompt: int | None = None
    # Each prompt's token ids, from an engine that tokenizes (None otherwise): what
    # cache-aware routing looks up, and what another replica is handed with the
    # request (``GenerationRequest.tokenized``) so that a prompt is tokenized once.
    tokens: tuple[tuple[int, ...], ...] | None = None


@dataclass(slots=True)
class EngineHealth:
    ready: bool
    slots: int
    running: int
    waiting: int = 0
    tokens_generated: int = 0
    kv_cache_usage: float = 0.0
    # Threads the last decode step used (engines that run the model here; else None).
    threads: int | None = None
    detail: dict[str, object] = field(default_factory=dict)
    # The KV pool and host-memory tier of engines that have them (llama.cpp's
    # kv_stats(): cells, bytes, entries, counters), for the deployment's describe.
    kv: dict[str, int] = field(default_factory=dict)
    # Whether the engine exports and imports KV state (KvMoving), for routing.
    moves_kv: bool = False
    # The weights a llama.cpp replica serves, where from and why, and the kernel path
    # they take on its CPU (tokenmill.engines.llamacpp.weights); empty elsewhere.
    weights: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """An inference backend. See the module docstring for the contract."""

    name: str

    async def start(self) -> None:
        """Load the model / open connections. Idempotent."""

    async def close(self) -> None:
        """Abort everything running and release the model."""

    async def prepare(self, request: GenerationRequest) -> PromptInfo:
        """Render and tokenize the prompt; raise ``ContextLengthError`` if it cannot fit."""
        ...

    def generate(self, request: GenerationRequest) -> ChunkStream:
        """Start the completion; its chunks arrive on the returned stream."""
        ...

    def cancel(self, request_id: str) -> None:
        """Stop a request: its stream ends with a final ``abort`` chunk and its usage."""
        ...

    def health(self) -> EngineHealth:
        """A cheap, non-blocking snapshot."""
        ...


@runtime_checkable
class TokenizingEngine(Protocol):
    """An optional capability: the model's own tokenizer (``/tokenize``, ``/detokenize``,
    ``/tokenizer_info``).

    Engines that run the model have it; a process replica forwards it to its child;
    an upstream proxy has it when its deployment names a ``tokenizer`` (else it raises
    ``InvalidRequestError`` naming ``model``).
    """

    async def tokenize(self, request: TokenizeRequest) -> list[int]:
        """The prompt's token ids, exactly as a generation would see them."""
        ...

    async def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``; ``InvalidRequestError`` naming ``tokens`` for an id
        outside the vocabulary."""
        ...

    def context_length(self) -> int:
        """Tokens one sequence may hold (prompt and completion)."""
        ...

    async def tokenizer_info(self) -> TokenizerInfo:
        """The tokenizer's special tokens, chat template and context length."""
        ...


# Receives one decode step's chunks (or errors) by request id, on the engine's thread.
StepSink = Callable[[list[tuple[str, Chunk | BaseException]]], None]


@runtime_checkable
class SteppedEngine(Protocol):
    """An optional capability: chunks handed over per decode step, off the event loop.

    A replica process uses it to write each step's tokens straight to the gateway
    (see :mod:`tokenmill.replicas.runner`); everything else uses ``generate()``. Once a
    step sink is set, every request is started with ``submit`` (``generate`` refuses).
    """

    def set_step_sink(self, sink: StepSink) -> None:
        """Receive the chunks of :meth:`submit` requests, one call per step."""

    def submit(self, request: GenerationRequest) -> None:
        """Start ``request``; its chunks, up to a final one or an error, go to the sink."""

    def cancel(self, request_id: str) -> None:
        """Stop a request (``Engine.cancel``); its final chunk (``abort``) carries the usage."""


@runtime_checkable
class CachePublishing(Protocol):
    """An optional capability: the engine says what its KV cache holds, as chains of
    block names (:mod:`tokenmill.kvblocks`), for cache-aware routing.

    ``publish_cache(listener)`` calls ``listener`` with a ``BlockSnapshot`` of every
    slot, then with a ``BlockUpdate`` for every change of a slot's full blocks, in
    order, and again a snapshot whenever the engine (re)starts, until the function it
    returns is called. Calls may come from the engine's own thread: the listener must
    be quick and must not call the engine.
    """

    def publish_cache(self, listener: Callable[[CacheEvent], None]) -> Callable[[], None]: ...


@dataclass(frozen=True, slots=True)
class KvState:
    """One sequence's KV cells, as they move between replicas of a deployment: its
    tokens from position 0, the engine's saved state of them (opaque bytes) and what
    that state is valid for (``fingerprint``: the model file and the engine's state
    format; an engine takes only its own)."""

    tokens: tuple[int, ...]
    state: bytes
    fingerprint: str


@runtime_checkable
class KvMoving(Protocol):
    """An optional capability: the engine hands out, and takes in, the KV state of a
    sequence it holds, so that a replica can serve a prompt another one computed.

    ``export_kv(tokens)``: the sequence the engine holds (in a slot, or a tier of its
    cache) sharing the longest prefix with ``tokens``, at least ``min_tokens`` of it;
    None when it holds none. ``import_kv(state)``: keep ``state`` as a cached sequence
    (parked: the next prompt that continues it restores it); False when it was not
    taken (another fingerprint, no room). ``held_kv(min_tokens)``: the sequences it
    holds in its slots and host memory (each at least ``min_tokens``), most recently
    used first: what a replica about to stop hands to those that stay. None affects a
    running request.
    """

    async def export_kv(self, tokens: Sequence[int], min_tokens: int) -> KvState | None: ...

    async def held_kv(self, min_tokens: int) -> list[tuple[int, ...]]: ...

    async def import_kv(self, state: KvState) -> bool: ...


# Requests remembered between prepare() and generate() (a client that leaves in
# between never calls generate(): the oldest are dropped).
PREPARED_CACHE = 512


class Prepared(Generic[T]):
    """What ``prepare()`` worked out for a request, kept for its ``generate()``."""

    def __init__(self, limit: int = PREPARED_CACHE) -> None:
        self._items: OrderedDict[str, T] = OrderedDict()
        self._limit = limit

    def put(self, request_id: str, value: T) -> None:
        self._items[request_id] = value
        while len(self._items) > self._limit:
            self._items.popitem(last=False)

    def take(self, request_id: str) -> T | None:
        return self._items.pop(request_id, None)
