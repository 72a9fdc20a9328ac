"""Who is asking: the :class:`Caller` the server's auth resolves from an API key, and
the classes of service (``priority``) a key's requests run in.

It stands below the gateway and the ledger, which both speak of callers (the gateway
admits and bills them, the ledger's holds name their account and key): it must import
neither, nor anything else of tokenmill but pure values.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

Priority = Literal["batch", "default", "interactive"]
# Lowest first: a class's rank is its index.
PRIORITIES: tuple[Priority, ...] = get_args(Priority)
DEFAULT_PRIORITY: Priority = "default"


def rank(priority: Priority) -> int:
    return PRIORITIES.index(priority)


def capped(asked: Priority | None, own: Priority, cap: Priority) -> Priority:
    """The class a request runs in: what it asked for (else ``own``), at most ``cap``."""
    wanted = own if asked is None else asked
    return wanted if rank(wanted) <= rank(cap) else cap


@dataclass(frozen=True, slots=True)
class Tenant:
    """Whom a request is served for, and how: its account's share and its class."""

    account: str = "anonymous"
    weight: float = 1.0
    priority: Priority = DEFAULT_PRIORITY
    # Streams this account may run at once on the deployment; None: no cap.
    max_concurrent: int | None = None


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is asking: resolved by the server's auth from the API key.

    The scheduling fields come from the ledger (docs/fairness.md): the account's
    ``weight`` and ``max_concurrent``, and the key's class, which is both the class of
    its requests (``priority``, until a request asks for another) and the highest
    one they may ask for (``max_priority``).
    """

    account_id: str
    key_id: str | None = None
    is_admin: bool = False
    weight: float = 1.0
    max_concurrent: int | None = None
    priority: Priority = DEFAULT_PRIORITY
    max_priority: Priority = "interactive"
    # The Batch API batch this request is a line of (None: not one): it runs in the
    # ``batch`` class and is priced at its deployment's batch discount.
    batch: str | None = None

    def asking(self, priority: Priority | None) -> Caller:
        """This caller for a request that asks for ``priority`` (None: the key's own)."""
        return replace(self, priority=capped(priority, self.priority, self.max_priority))

    def for_batch(self, batch_id: str) -> Caller:
        """This caller for a line of batch ``batch_id``: the lowest class, discounted."""
        return replace(self, batch=batch_id, priority="batch", max_priority="batch")

    def tenant(self) -> Tenant:
        """Whom admission serves this request for."""
        return Tenant(self.account_id, self.weight, self.priority, self.max_concurrent)


ANONYMOUS = Caller(account_id="anonymous")
