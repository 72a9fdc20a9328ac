"""A key's rate limits: requests (``rpm``) and tokens (``tpm``) a minute, counted in
fixed windows of :data:`RATE_WINDOW_S` in the ``rate_windows`` table.

Each function runs inside the caller's transaction (:class:`~tokenmill.ledger.database.Tx`),
so a hold's admission, its credit and its rate count commit or fail together. A hold
counts its request and its prompt + ``max_tokens`` in the window it started in
(:func:`admit_key`); its settlement gives back the tokens it did not use
(:func:`give_back`); the sweeper forgets windows past (:func:`forget_before`). What a
hold costs in money is the books' business (:mod:`tokenmill.ledger.sql`), not this
module's.
"""

from __future__ import annotations

from tokenmill.errors import AuthenticationError, InvalidRequestError, OverloadedError
from tokenmill.ledger.base import HoldSpec
from tokenmill.ledger.database import Tx

RATE_WINDOW_S = 60


def window_of(now: float) -> int:
    """The number of the rate window that ``now`` (seconds since the epoch) falls in."""
    return int(now // RATE_WINDOW_S)


def admit_key(tx: Tx, spec: HoldSpec, now: float, window: int) -> None:
    """Refuse a revoked key or one over its limits; otherwise count the request in
    ``window``."""
    key = tx.one("SELECT rpm, tpm, revoked FROM api_keys WHERE id = ?", (spec.key_id,))
    if key is None or key[2] is not None:
        raise AuthenticationError("this API key has been revoked")
    rpm, tpm = key[0], key[1]
    if rpm is None and tpm is None:
        return
    tokens = spec.prompt_tokens + spec.max_tokens
    if tpm is not None and tokens > tpm:
        # No amount of waiting lets this request through: not a 429 to retry.
        raise InvalidRequestError(
            f"this request needs up to {tokens} tokens ({spec.prompt_tokens} of prompt "
            f"+ max_tokens {spec.max_tokens}) but this key may use {tpm} tokens per "
            "minute; lower max_tokens or shorten the prompt",
            param="max_tokens",
            code="request_too_large",
        )
    used = tx.one(
        "SELECT requests, tokens FROM rate_windows WHERE key_id = ? AND rate_window = ?",
        (spec.key_id, window),
    )
    used_requests, used_tokens = (int(used[0]), int(used[1])) if used else (0, 0)
    retry_after = (window + 1) * RATE_WINDOW_S - now
    if rpm is not None and used_requests + 1 > rpm:
        raise OverloadedError(
            f"rate limit reached: this key may make {rpm} requests per minute",
            retry_after=retry_after,
            code="rate_limit_exceeded",
        )
    if tpm is not None and used_tokens + tokens > tpm:
        raise OverloadedError(
            f"rate limit reached: this key may use {tpm} tokens per minute "
            f"(in flight and used: {used_tokens}; this request: up to {tokens}; "
            "lower max_tokens or wait)",
            retry_after=retry_after,
            code="rate_limit_exceeded",
        )
    tx.run(
        "INSERT INTO rate_windows (key_id, rate_window, requests, tokens) VALUES (?, ?, 1, ?) "
        "ON CONFLICT (key_id, rate_window) DO UPDATE SET "
        "requests = rate_windows.requests + 1, tokens = rate_windows.tokens + ?",
        (spec.key_id, window, tokens, tokens),
    )


def give_back(tx: Tx, key_id: str, window: int, unused: int) -> None:
    """Return the ``unused`` tokens of a settled hold to the window it was counted in.

    The window counted prompt + max_tokens in flight; it keeps only what was used.
    """
    tx.run(
        "UPDATE rate_windows SET tokens = tokens - ? WHERE key_id = ? AND rate_window = ?",
        (unused, key_id, window),
    )


def forget_before(tx: Tx, window: int) -> None:
    """Drop the counts of windows before ``window``: no hold is admitted into them."""
    tx.run("DELETE FROM rate_windows WHERE rate_window < ?", (window,))
