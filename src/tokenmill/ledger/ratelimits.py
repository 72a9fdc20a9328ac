"""A key's rate limits: requests (``rpm``) and tokens (``tpm``) a minute, counted in
fixed windows of :data:`RATE_WINDOW_S` in the ``rate_windows`` table.

Each function runs inside the caller's transaction (:class:`~tokenmill.ledger.database.Tx`),
so a hold's admission, its credit and its rate count commit or fail together. A hold
counts its request and its prompt + ``max_tokens`` in the window it started in
(:func:`admit_key`); its settlement gives back the tokens it did not use
(:func:`give_back`); the sweeper forgets windows past (:func:`forget_before`); what a
key has left is read back by :func:`rate_state`. What a hold costs in money is the
books' business (:mod:`tokenmill.ledger.sql`), not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.errors import InvalidRequestError, OverloadedError, UnauthenticatedError
from tokenmill.ledger.base import HoldSpec
from tokenmill.ledger.database import Tx

RATE_WINDOW_S = 60


@dataclass(frozen=True, slots=True)
class RateState:
    """A key's per-minute limits and what its current window holds: the requests
    admitted, and their prompt + ``max_tokens`` (less what settled requests gave back)."""

    rpm: int | None
    tpm: int | None
    requests: int
    tokens: int
    now: float
    window_end: float  # when the current window ends and its counts start from 0

    @property
    def remaining_requests(self) -> int | None:
        return None if self.rpm is None else max(0, self.rpm - self.requests)

    @property
    def remaining_tokens(self) -> int | None:
        return None if self.tpm is None else max(0, self.tpm - self.tokens)

    def requests_reset_s(self) -> float:
        """Seconds until the requests count is back at 0 (0: nothing counted)."""
        return self.window_end - self.now if self.requests > 0 else 0.0

    def tokens_reset_s(self) -> float:
        """Seconds until the tokens count is back at 0 (0: nothing counted)."""
        return self.window_end - self.now if self.tokens > 0 else 0.0


def rate_state(tx: Tx, key_id: str, now: float) -> RateState | None:
    """What key ``key_id`` may still do this minute; None for a key without limits (or
    no such key)."""
    window = window_of(now)
    row = tx.one(
        "SELECT k.rpm, k.tpm, w.requests, w.tokens FROM api_keys k LEFT JOIN rate_windows w "
        "ON w.key_id = k.id AND w.rate_window = ? WHERE k.id = ?",
        (window, key_id),
    )
    if row is None or (row[0] is None and row[1] is None):
        return None
    rpm, tpm = row[0], row[1]
    requests, tokens = int(row[2] or 0), max(0, int(row[3] or 0))
    return RateState(rpm, tpm, requests, tokens, now, float((window + 1) * RATE_WINDOW_S))


def window_of(now: float) -> int:
    """The number of the rate window that ``now`` (seconds since the epoch) falls in."""
    return int(now // RATE_WINDOW_S)


def admit_key(tx: Tx, spec: HoldSpec, now: float, window: int) -> None:
    """Refuse a revoked key or one over its limits; otherwise count the request in
    ``window``."""
    key = tx.one("SELECT rpm, tpm, revoked FROM api_keys WHERE id = ?", (spec.key_id,))
    if key is None or key[2] is not None:
        raise UnauthenticatedError("this API key has been revoked")
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
