"""API-key authentication: who is calling, resolved once per request.

With ``admin_key`` unset the gateway is open (local use): every caller is the
anonymous account. With it set, ``/v1``, ``/tokenize``, ``/detokenize`` and
``/tokenizer_info`` need ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``,
as Anthropic's clients send it) and ``/admin`` needs the admin key. Keys are looked
up by their SHA-256, cached for a moment to keep the hot path off the database;
revocation still bites at once where it matters, because every hold re-checks the
key inside its transaction.

A presented key is never compared with a secret character by character: the admin key
is compared as SHA-256 digests with :func:`hmac.compare_digest` (constant time, and
the same length whatever was sent), API keys are found by their digest. A key in the
query string is refused even where the header is right: URLs end up in proxy logs and
browser histories. This module never logs a key.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill import stages
from tokenmill.errors import ForbiddenError, ServiceError, UnauthenticatedError
from tokenmill.identity import ANONYMOUS, Caller
from tokenmill.ledger import ANONYMOUS_ACCOUNT, Actor, KeyInfo, SqlLedger, hash_key
from tokenmill.server.errors import error_response

CACHE_TTL_S = 2.0
_CACHE_MAX = 10_000
ADMIN = Caller(account_id=ANONYMOUS_ACCOUNT, is_admin=True)
# Query parameters that carry a key in other APIs; no tokenmill route takes one.
KEY_PARAMS = frozenset({"api_key", "api-key", "apikey", "key", "access_token", "token", "auth"})


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def same_key(presented: str, expected_digest: bytes) -> bool:
    """Whether ``presented`` is the key whose SHA-256 is ``expected_digest``.

    Constant time in the key: two 32-byte digests, compared with ``compare_digest``,
    so neither a matching prefix nor the presented key's length shows in the timing.
    """
    return hmac.compare_digest(digest(presented), expected_digest)


class KeyCache:
    """hash → key info (or None for unknown), for ``CACHE_TTL_S``."""

    def __init__(self, ledger: SqlLedger, ttl_s: float = CACHE_TTL_S) -> None:
        self.ledger = ledger
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[float, KeyInfo | None]] = {}

    async def lookup(self, plaintext: str) -> KeyInfo | None:
        digest = hash_key(plaintext)
        now = time.monotonic()
        hit = self._entries.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        info = await self.ledger.resolve_key(plaintext)
        if len(self._entries) >= _CACHE_MAX:
            self._entries.clear()
        self._entries[digest] = (now + self.ttl_s, info)
        return info

    def forget(self, key_id: str) -> None:
        """Drop a revoked key now (other gateways see it within the TTL)."""
        self._entries = {
            d: e for d, e in self._entries.items() if e[1] is None or e[1].id != key_id
        }

    def forget_account(self, account_id: str) -> None:
        """Drop an account's keys now: its settings changed (other gateways: the TTL)."""
        self._entries = {
            d: e for d, e in self._entries.items() if e[1] is None or e[1].account_id != account_id
        }


# The scope state entry where the caller's key (its KeyInfo) is left for what reads its
# limits afterwards (tokenmill.server.ratelimits).
KEY_STATE = "key_info"

# Outside /v1 and keyed like it: vLLM's paths for the model's tokenizer.
KEYED_ROOT_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


def needs_api_key(path: str) -> bool:
    """Whether ``path`` takes an API key when keys are on (``/admin`` takes the admin key)."""
    return path == "/v1" or path.startswith("/v1/") or path in KEYED_ROOT_PATHS


def _key_in_query(scope: Scope) -> bool:
    query: bytes = scope.get("query_string", b"")
    if not query:
        return False
    names = {name.lower() for name, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True)}
    return not names.isdisjoint(KEY_PARAMS)


def _presented_key(scope: Scope) -> str | None:
    """The key sent as ``Authorization: Bearer <key>`` or, as Anthropic's clients send
    it, ``x-api-key: <key>`` (the bearer wins if both are sent)."""
    bearer = api_key = None
    for name, value in scope["headers"]:
        if name == b"authorization" and bearer is None:
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                bearer = token.strip()
        elif name == b"x-api-key" and api_key is None:
            api_key = value.decode("latin-1").strip() or None
    return bearer or api_key


class Auth:
    """Pure ASGI middleware; runs inside RequestContext so errors carry the request id."""

    def __init__(self, app: ASGIApp, admin_key: str | None, keys: KeyCache) -> None:
        self.app = app
        self.admin_digest = None if admin_key is None else digest(admin_key)
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                caller = await self._caller(scope)
            except ServiceError as e:
                await error_response(e, scope["path"])(scope, receive, send)
                return
            if caller is not None:
                scope.setdefault("state", {})["caller"] = caller
            stages.mark("auth")
        await self.app(scope, receive, send)

    async def _caller(self, scope: Scope) -> Caller | None:
        path: str = scope["path"]
        is_admin_path = path == "/admin" or path.startswith("/admin/")
        if not (is_admin_path or needs_api_key(path)):
            return None
        if self.admin_digest is None:
            return ADMIN if is_admin_path else ANONYMOUS
        if _key_in_query(scope):
            raise UnauthenticatedError(
                "API keys are refused in the URL, where logs and histories keep them: "
                "send 'Authorization: Bearer <key>' and revoke the key you sent",
                code="api_key_in_query",
            )
        token = _presented_key(scope)
        if token is None:
            raise UnauthenticatedError(
                "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                code="missing_api_key",
            )
        if same_key(token, self.admin_digest):
            return ADMIN
        info = await self.keys.lookup(token)
        if info is None or info.revoked is not None:
            raise UnauthenticatedError("invalid or revoked API key")
        if is_admin_path:
            raise ForbiddenError("the admin API needs the admin key")
        scope.setdefault("state", {})[KEY_STATE] = info
        return caller_of(info)


def caller_of(info: KeyInfo) -> Caller:
    """Who calls with the key ``info`` describes: its account and the account's
    scheduling, its class both the requests' own and their ceiling."""
    return Caller(
        account_id=info.account_id,
        key_id=info.id,
        weight=info.weight,
        max_concurrent=info.max_concurrent,
        priority=info.priority,
        max_priority=info.priority,
    )


def actor_of(caller: Caller, request_id: str) -> Actor:
    """Who the audit log names for a change ``caller`` asks for: ``admin`` (the admin
    key, or anyone on an open gateway's ``/admin``), else the API key (``key:<id>``),
    else the account (an open gateway's anonymous caller)."""
    if caller.is_admin:
        name = "admin"
    elif caller.key_id is not None:
        name = f"key:{caller.key_id}"
    else:
        name = f"account:{caller.account_id}"
    return Actor(name, request_id)
