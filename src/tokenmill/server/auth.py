"""API-key authentication: who is calling, resolved once per request.

With ``admin_key`` unset the gateway is open (local use): every caller is the
anonymous account. With it set, ``/v1`` needs ``Authorization: Bearer <key>`` and
``/admin`` needs the admin key. Keys are looked up by their SHA-256, cached for a
moment to keep the hot path off the database; revocation still bites at once where
it matters, because every hold re-checks the key inside its transaction.
"""

from __future__ import annotations

import hmac
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.errors import AuthenticationError, PermissionDeniedError, TokenmillError
from tokenmill.gateway.metering import ANONYMOUS, Caller
from tokenmill.ledger.base import ANONYMOUS_ACCOUNT, KeyInfo, hash_key
from tokenmill.ledger.sql import SqlLedger
from tokenmill.server.errors import error_response

CACHE_TTL_S = 2.0
_CACHE_MAX = 10_000
ADMIN = Caller(account_id=ANONYMOUS_ACCOUNT, is_admin=True)


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


def _bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            text: str = value.decode("latin-1")
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


class Auth:
    """Pure ASGI middleware; runs inside RequestContext so errors carry the request id."""

    def __init__(self, app: ASGIApp, admin_key: str | None, keys: KeyCache) -> None:
        self.app = app
        self.admin_key = admin_key
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                caller = await self._caller(scope)
            except TokenmillError as e:
                await error_response(e)(scope, receive, send)
                return
            if caller is not None:
                scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)

    async def _caller(self, scope: Scope) -> Caller | None:
        path: str = scope["path"]
        is_admin_path = path == "/admin" or path.startswith("/admin/")
        if not (is_admin_path or path == "/v1" or path.startswith("/v1/")):
            return None
        if self.admin_key is None:
            return ADMIN if is_admin_path else ANONYMOUS
        token = _bearer(scope)
        if token is None:
            raise AuthenticationError(
                "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key"
            )
        if hmac.compare_digest(token.encode(), self.admin_key.encode()):
            return ADMIN
        info = await self.keys.lookup(token)
        if info is None or info.revoked is not None:
            raise AuthenticationError("invalid or revoked API key")
        if is_admin_path:
            raise PermissionDeniedError("the admin API needs the admin key")
        return Caller(account_id=info.account_id, key_id=info.id)
