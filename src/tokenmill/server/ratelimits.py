"""Rate-limit headers: what a caller's key may still do this minute, on every response
of the OpenAI-shaped routes (``x-ratelimit-*``) and of the Messages API
(``anthropic-ratelimit-*``), so that clients and proxies pace themselves before they
meet a 429.

The numbers are read from the ledger when the response head is sent: the key's
``rpm`` and ``tpm`` and its current window's counts, which every gateway on one
PostgreSQL ledger shares, so they are true across gateways. A request that was held
is already counted. Only a key with a limit gets them; a 429 keeps its
``Retry-After`` beside them.

tokenmill has one token limit a key (``tpm``, prompt + ``max_tokens``): Anthropic's
``input-tokens`` and ``output-tokens`` headers repeat it, as each is bounded by it.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.ledger import KeyInfo, RateState, SqlLedger
from tokenmill.server.auth import KEY_STATE
from tokenmill.server.errors import speaks_anthropic

log = logging.getLogger("tokenmill.server")


def go_duration(seconds: float) -> str:
    """``seconds`` as OpenAI writes a reset (Go's duration format, to the
    millisecond): ``20ms``, ``1s``, ``59.5s``, ``6m0s``, ``1h0m0s``."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, millis = divmod(rest, 1000)
    text = f"{secs}.{millis:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    if minutes:
        return f"{minutes}m{text}"
    return text


def rfc3339(at: float) -> str:
    """An instant as Anthropic writes a reset: ``2026-01-01T00:01:00Z``."""
    return datetime.fromtimestamp(round(at), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def openai_headers(state: RateState) -> list[tuple[str, str]]:
    headers = []
    if state.rpm is not None:
        headers += [
            ("x-ratelimit-limit-requests", str(state.rpm)),
            ("x-ratelimit-remaining-requests", str(state.remaining_requests)),
            ("x-ratelimit-reset-requests", go_duration(state.requests_reset_s())),
        ]
    if state.tpm is not None:
        headers += [
            ("x-ratelimit-limit-tokens", str(state.tpm)),
            ("x-ratelimit-remaining-tokens", str(state.remaining_tokens)),
            ("x-ratelimit-reset-tokens", go_duration(state.tokens_reset_s())),
        ]
    return headers


def anthropic_headers(state: RateState) -> list[tuple[str, str]]:
    headers = []
    if state.rpm is not None:
        headers += [
            ("anthropic-ratelimit-requests-limit", str(state.rpm)),
            ("anthropic-ratelimit-requests-remaining", str(state.remaining_requests)),
            ("anthropic-ratelimit-requests-reset", rfc3339(state.now + state.requests_reset_s())),
        ]
    if state.tpm is not None:
        reset = rfc3339(state.now + state.tokens_reset_s())
        for kind in ("tokens", "input-tokens", "output-tokens"):
            headers += [
                (f"anthropic-ratelimit-{kind}-limit", str(state.tpm)),
                (f"anthropic-ratelimit-{kind}-remaining", str(state.remaining_tokens)),
                (f"anthropic-ratelimit-{kind}-reset", reset),
            ]
    return headers


def carries_headers(path: str) -> bool:
    """The OpenAI-shaped routes (``/v1/...``) and the Messages API."""
    return path == "/v1" or path.startswith("/v1/")


class RateLimitHeaders:
    """Pure ASGI middleware, inside :class:`~tokenmill.server.auth.Auth` (which names
    the key): adds the key's rate-limit headers to the response head."""

    def __init__(self, app: ASGIApp, ledger: SqlLedger) -> None:
        self.app = app
        self.ledger = ledger

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not carries_headers(scope["path"]):
            await self.app(scope, receive, send)
            return
        anthropic = speaks_anthropic(scope["path"])

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                info: KeyInfo | None = scope.get("state", {}).get(KEY_STATE)
                if info is not None and (info.rpm is not None or info.tpm is not None):
                    await self._add(message, info, anthropic)
            await send(message)

        await self.app(scope, receive, send_with_limits)

    async def _add(self, message: Message, info: KeyInfo, anthropic: bool) -> None:
        try:
            state = await self.ledger.rate_state(info.id)
        except Exception:  # the headers are advice: never fail a response for them
            log.exception("could not read the rate limits of key %s", info.id)
            return
        if state is None:
            return
        pairs = anthropic_headers(state) if anthropic else openai_headers(state)
        message["headers"] = [
            *message.get("headers", []),
            *((name.encode(), value.encode()) for name, value in pairs),
        ]
