"""Upstream engine: any OpenAI-compatible endpoint (llama-server, vLLM, another tokenmill).

Chat requests (``messages``) go to ``{url}/chat/completions``, text prompts to
``{url}/completions``, always streamed, with ``stream_options.include_usage`` so the
upstream reports what it really counted. Each SSE chunk's text is yielded the moment
it arrives; nothing is buffered. What the bodies and events look like (OpenAI's wire
format) is :mod:`tokenmill.engines.upstream_wire`'s; this module owns the
connection, the retries, the token counts and the relay into a stream.

Retries: connect errors and 5xx answers are retried with backoff, but only before
the upstream's first chunk (so before a byte of the completion reached the client);
after that a failure ends the stream with :class:`EngineError`.

Token counts. The usage that is billed comes from the upstream's final usage
chunk. Before generation (admission and the credit hold) and when an upstream
reports no usage, tokens are counted with the deployment's ``tokenizer``: a GGUF
file matching the upstream model, read without its weights
(:class:`~tokenmill.engines.llamacpp.vocab.GgufTokenizer`), which renders chat messages with
that model's own template. Without one, an OpenAI-compatible API cannot tokenize
without generating, so the prompt is *estimated* (about 4 characters a token plus a
few tokens a message). Completion tokens without upstream usage are at least the
number of content chunks received (streaming servers send about one token a chunk).
A prompt is never refused as too long here: the upstream enforces its own window.
``context_length`` is the deployment's ``n_ctx``: the window assumed when a client
sends no ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from tokenmill.config import UpstreamDeployment
from tokenmill.engines.base import (
    Chunk,
    EngineHealth,
    FinishReason,
    GenerationRequest,
    Prepared,
    PromptInfo,
    TokenizeRequest,
    TokenizerInfo,
    TokenLogprob,
    Usage,
    refuse_choices,
)
from tokenmill.engines.chunks import ChunkStream
from tokenmill.engines.upstream_wire import (
    FORWARDED_CONSTRAINTS,
    answer_error,
    choice_finish,
    choice_logprobs,
    choice_text,
    choice_tool_calls,
    event_error,
    event_usage,
    request_body,
)
from tokenmill.errors import EngineError, InvalidRequestError, ServiceError

if TYPE_CHECKING:
    from tokenmill.engines.llamacpp.vocab import GgufTokenizer

log = logging.getLogger("tokenmill.engines.upstream")

# Retries before the first byte: 3 more attempts after 0.25 s, 0.5 s, 1 s (+ jitter).
MAX_RETRIES = 3
RETRY_BASE_S = 0.25
CONNECT_TIMEOUT_S = 10.0
CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
# Texts longer than this are tokenized off the event loop.
TOKENIZE_INLINE_CHARS = 16_384


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def estimate_prompt(request: GenerationRequest) -> int:
    if request.prompt_tokens is not None:
        return len(request.prompt_tokens)
    if request.prompt is not None:
        return max(1, estimate_tokens(request.prompt))
    assert request.messages is not None
    return max(
        1, sum(TOKENS_PER_MESSAGE + estimate_tokens(m.content) for m in request.messages) + 2
    )


@dataclass
class _Running:
    prompt_tokens: int
    tokenizer: GgufTokenizer | None
    chunks: int = 0
    chars: int = 0
    parts: list[str] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    def add(self, text: str) -> None:
        self.chunks += 1
        self.chars += len(text)
        self.parts.append(text)

    def usage(self) -> Usage:
        """What was produced, counted here (the upstream reported nothing)."""
        text = "".join(self.parts)
        if self.tokenizer is not None:
            counted = self.tokenizer.count_text(text)
        else:
            counted = estimate_tokens(text)
        return Usage(self.prompt_tokens, max(self.chunks, counted))


class UpstreamEngine:
    """Proxy to an OpenAI-compatible server. See the module docstring."""

    name = "upstream"

    def __init__(self, config: UpstreamDeployment) -> None:
        assert config.url is not None
        self.config = config
        self.url = config.url.rstrip("/")
        self.model = config.upstream_model or config.id
        self.slots = config.max_num_seqs
        headers = {"accept": "text/event-stream", **config.headers}
        if config.api_key:
            headers["authorization"] = f"Bearer {config.api_key}"
        self._headers = headers
        self._client: httpx.AsyncClient | None = None
        self._running: dict[str, _Running] = {}
        self._prepared: Prepared[int] = Prepared()
        self._tokenizer: GgufTokenizer | None = None
        self.tokens_generated = 0
        self.failures = 0

    @classmethod
    def from_config(cls, config: UpstreamDeployment) -> UpstreamEngine:
        return cls(config)

    async def start(self) -> None:
        if self.config.tokenizer and self._tokenizer is None:
            from tokenmill.engines.llamacpp.vocab import GgufTokenizer

            self._tokenizer = await asyncio.to_thread(GgufTokenizer, self.config.tokenizer)
            log.info("%s counts tokens with %s", self.config.id, self._tokenizer.path.name)
        if self._client is None:
            self._client = httpx.AsyncClient(
                headers=self._headers,
                timeout=httpx.Timeout(
                    self.config.timeout_s, connect=min(CONNECT_TIMEOUT_S, self.config.timeout_s)
                ),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=self.slots),
            )

    async def close(self) -> None:
        client, self._client = self._client, None
        tasks = [r.task for r in self._running.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if client is not None:
            await client.aclose()
        tokenizer, self._tokenizer = self._tokenizer, None
        if tokenizer is not None:
            tokenizer.close()

    async def prepare(self, request: GenerationRequest) -> PromptInfo:
        # Upstream choices would need their own index bookkeeping; not built (yet).
        refuse_choices(request, f"deployment {self.config.id!r} (a proxied server)")
        if request.sampling.echo:
            # Upstreams answer echo each their own way (or not at all).
            raise InvalidRequestError(
                f"deployment {self.config.id!r} proxies another server and cannot echo the "
                "prompt; leave 'echo' out or pick a llamacpp model",
                param="echo",
            )
        constraint = request.sampling.constraint
        if constraint is not None and constraint.kind not in FORWARDED_CONSTRAINTS:
            raise InvalidRequestError(
                f"deployment {self.config.id!r} proxies another server, which is sent "
                "response_format (JSON) and grammar (GBNF) constraints only; use one of "
                "those or pick a llamacpp model",
                param=constraint.param,
            )
        if self._client is None:
            await self.start()
        n = await self._count_prompt(request)
        self._prepared.put(request.request_id, n)
        return PromptInfo(n, self.config.n_ctx)

    async def _count_prompt(self, request: GenerationRequest) -> int:
        tokenizer = self._tokenizer
        if tokenizer is None or request.prompt_tokens is not None:
            return estimate_prompt(request)
        size = len(request.prompt or "") + sum(len(m.content) for m in request.messages or ())
        if size > TOKENIZE_INLINE_CHARS:
            return max(1, await asyncio.to_thread(tokenizer.count_prompt, request))
        return max(1, tokenizer.count_prompt(request))

    def _own_tokenizer(self) -> GgufTokenizer:
        if self._tokenizer is None:
            raise InvalidRequestError(
                f"deployment {self.config.id!r} proxies {self.url} and has no tokenizer to "
                "tokenize with; set its 'tokenizer' (a GGUF file matching the model) or "
                "pick a llamacpp model",
                param="model",
            )
        return self._tokenizer

    async def tokenize(self, request: TokenizeRequest) -> list[int]:
        if self._client is None:
            await self.start()
        vocab = self._own_tokenizer().vocab
        add = request.add_special_tokens
        return await asyncio.to_thread(lambda: vocab.tokenize(vocab.render(request), bos=add))

    async def detokenize(self, tokens: Sequence[int]) -> str:
        if self._client is None:
            await self.start()
        return self._own_tokenizer().vocab.detokenize(tokens)

    def context_length(self) -> int:
        return self.config.n_ctx

    async def tokenizer_info(self) -> TokenizerInfo:
        if self._client is None:
            await self.start()
        return self._own_tokenizer().vocab.info(self.config.n_ctx)

    def health(self) -> EngineHealth:
        return EngineHealth(
            ready=self._client is not None,
            slots=self.slots,
            running=len(self._running),
            tokens_generated=self.tokens_generated,
            detail={"url": self.url, "failures": self.failures},
        )

    async def _open(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """Send the request; retry connect errors and 5xx (nothing was streamed yet)."""
        if self._client is None:
            await self.start()
        assert self._client is not None
        attempt = 0
        while True:
            req = self._client.build_request("POST", self.url + path, json=body)
            try:
                resp = await self._client.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                if attempt >= MAX_RETRIES:
                    self.failures += 1
                    raise EngineError(f"the upstream {self.url} is unreachable: {e}") from None
            except httpx.HTTPError as e:
                self.failures += 1
                raise EngineError(f"the upstream request failed: {type(e).__name__}") from None
            else:
                if resp.status_code < 500 or attempt >= MAX_RETRIES:
                    if resp.status_code >= 400:
                        raise await self._error(resp)
                    return resp
                await resp.aclose()
            delay = RETRY_BASE_S * (2**attempt) * (1 + random.random() / 2)
            log.warning("upstream %s failed; retry %d in %.2fs", self.url, attempt + 1, delay)
            await asyncio.sleep(delay)
            attempt += 1

    async def _error(self, resp: httpx.Response) -> ServiceError:
        try:
            raw = await resp.aread()
        finally:
            await resp.aclose()
        self.failures += resp.status_code >= 500
        return answer_error(resp.status_code, raw, resp.headers.get("retry-after"))

    def generate(self, request: GenerationRequest) -> ChunkStream:
        rid = request.request_id
        stream = ChunkStream(rid, self.cancel)
        state = _Running(0, self._tokenizer)
        self._running[rid] = state
        state.task = asyncio.create_task(self._relay(request, state, stream))
        return stream

    def cancel(self, request_id: str) -> None:
        """Close the upstream request (the upstream sees a disconnect and stops)."""
        state = self._running.get(request_id)
        if state is not None and state.task is not None:
            state.task.cancel()

    async def _relay(
        self, request: GenerationRequest, state: _Running, stream: ChunkStream
    ) -> None:
        """Read the upstream's answer into ``stream``, up to exactly one final item."""
        rid = request.request_id
        usage: Usage | None = None
        try:
            prompt_tokens = self._prepared.take(rid)
            if prompt_tokens is None:
                prompt_tokens = await self._count_prompt(request)
            state.prompt_tokens = prompt_tokens
            finish, usage = await self._stream(request, state, stream)
            # The finish chunk comes before the usage chunk: it is sent once both are in.
            # Its stop_sequence stays None: an OpenAI-compatible server reports a stop
            # string's end as "stop", not which string matched (vLLM's extra
            # ``stop_reason`` is not read: other servers send nothing like it).
            stream.put(Chunk("", finish, usage or state.usage()))
        except asyncio.CancelledError:
            stream.put(Chunk("", "abort", usage or state.usage()))
        except ServiceError as e:
            stream.put(e)
        except json.JSONDecodeError:
            stream.put(EngineError("the upstream sent a malformed event"))
        except Exception as e:  # never leave a stream without its end
            log.exception("relaying %s failed", rid)
            stream.put(EngineError(f"the upstream relay failed: {type(e).__name__}"))
        finally:
            self._running.pop(rid, None)

    async def _stream(
        self, request: GenerationRequest, state: _Running, stream: ChunkStream
    ) -> tuple[FinishReason, Usage | None]:
        path, body = request_body(request, self.model)
        finish: FinishReason | None = None
        usage: Usage | None = None
        resp = await self._open(path, body)
        try:
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                failure = event_error(event)
                if failure is not None:
                    raise failure
                usage = event_usage(event) or usage
                for choice in event.get("choices") or ():
                    calls = choice_tool_calls(choice)
                    if calls:
                        for call in calls:
                            state.add(call.arguments)
                        stream.put(Chunk("", tool_calls=calls))
                    text = choice_text(choice)
                    logprobs: tuple[TokenLogprob, ...] = ()
                    if request.sampling.logprobs is not None and text:
                        logprobs = choice_logprobs(choice.get("logprobs"), state.chars)
                    if text:
                        state.add(text)
                        self.tokens_generated += 1
                        stream.put(Chunk(text, logprobs=logprobs))
                    finish = choice_finish(choice) or finish
        except httpx.HTTPError as e:
            raise EngineError(
                f"the upstream connection failed mid-stream: {type(e).__name__}"
            ) from None
        finally:
            await asyncio.shield(resp.aclose())
        return finish or "stop", usage
