"""The queue discipline of admission: which waiting request gets the next free slots.

Pure: no event loop, no clock of its own (every call that needs the time is given
``now``), no I/O. :class:`~tokenmill.gateway.admission.Admission` is the mechanism
around it (futures, timeouts, 429s); this module only decides the order.

Three rules, applied in this order:

1. **Priority class.** ``interactive`` before ``default`` before ``batch``. A request
   that has waited ``promote_after_s`` (config, 10 s by default) is promoted one
   class, and one more for every further period, up to the highest class waiting:
   a lower class never starves, however busy the higher. (Never above it: a flood's
   requests that waited long must not overtake a light tenant's fresh request of
   their own class, which is rule 2's business.)
2. **Fair share within a class** (VTC, "Fairness in Serving Large Language Models",
   OSDI 2024). Every account has a virtual token counter per deployment: the prompt
   tokens computed and completion tokens generated for it, divided by its weight,
   counted as they happen (:meth:`FairQueue.serve`). The waiting account with the
   lowest counter goes first; on a tie, the one with fewer requests running. An
   account that returns after being idle starts at the lowest counter of the
   accounts still active, so idling banks no credit; when every account is idle the
   counters are forgotten.
3. **Arrival order within an account and class.** One account's requests of one
   class are served in the order they came.

Work-conserving: whenever slots are free, a request is granted if any may run, with
two exceptions, both by design. An account at its ``max_concurrent`` waits for one
of its own streams to end. A request that takes several slots (``n``) and is next by
the rules above holds the free slots until enough are free for it: nobody overtakes
it, so it never starves (the counters of the accounts served meanwhile rise, so it
becomes next soon, and promotion bounds its wait).

``fair = False`` is FIFO: one queue in arrival order, no classes, no caps, and a
heavy head blocks everyone behind it (what admission did before fair queuing).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tokenmill.config import DEFAULT_PROMOTE_AFTER_S
from tokenmill.errors import InvalidRequestError
from tokenmill.identity import PRIORITIES, Priority, Tenant, rank

T = TypeVar("T")

# What an account's virtual counter is charged per token: VTC's weights. Equal, as
# the tokens are billed: fair share follows the bill.
PROMPT_TOKEN_COST = 1.0
COMPLETION_TOKEN_COST = 1.0
# The account every request of a FIFO queue is filed under.
_FIFO = ""

# OpenAI's ``service_tier`` values, as classes. "auto" and "default" ask for nothing
# in particular: the key's own class.
SERVICE_TIERS: dict[str, Priority | None] = {
    "auto": None,
    "default": None,
    "flex": "batch",
    "priority": "interactive",
    "scale": "interactive",
}


def requested_priority(priority: int | str | None, service_tier: str | None) -> Priority | None:
    """The class a request asks for, or None for its key's own; raises a 400 naming
    the field for a value that is no class.

    ``priority`` is a class name, or vLLM's integer (lower is served earlier, 0 the
    default): below 0 is ``interactive``, 0 ``default``, above 0 ``batch``.
    ``service_tier`` is OpenAI's (:data:`SERVICE_TIERS`). Given both, ``priority``
    decides.
    """
    if priority is not None:
        if isinstance(priority, int):
            return "interactive" if priority < 0 else "batch" if priority > 0 else "default"
        for name in PRIORITIES:
            if priority == name:
                return name
        raise InvalidRequestError(
            f"unknown priority {priority!r}: use one of {', '.join(PRIORITIES)} "
            "(or vLLM's integer: below 0 interactive, 0 default, above 0 batch)",
            param="priority",
            code="invalid_priority",
        )
    if service_tier is not None:
        if service_tier not in SERVICE_TIERS:
            raise InvalidRequestError(
                f"unknown service_tier {service_tier!r}: use one of {', '.join(SERVICE_TIERS)}",
                param="service_tier",
                code="invalid_service_tier",
            )
        return SERVICE_TIERS[service_tier]
    return None


@dataclass(eq=False, slots=True)
class Entry(Generic[T]):
    """A waiting request: ``item`` is the mechanism's (admission's future)."""

    item: T
    tenant: Tenant
    slots: int
    arrived: float
    seq: int

    def klass(self, now: float, promote_after_s: float, top: int) -> int:
        """The rank it is served at now: its own, plus one per promotion period, at
        most ``top`` (the highest class waiting)."""
        own = rank(self.tenant.priority)
        return min(top, own + int((now - self.arrived) // promote_after_s))


@dataclass(slots=True)
class _Account:
    weight: float = 1.0
    counter: float = 0.0
    running: int = 0
    queued: int = 0
    max_concurrent: int | None = None

    @property
    def active(self) -> bool:
        return self.running > 0 or self.queued > 0


@dataclass(frozen=True, slots=True)
class AccountView:
    """One account as the deployments view shows it."""

    account: str
    weight: float
    running: int
    queued: dict[Priority, int]
    virtual_tokens: float
    # Its fair share of the deployment while every active account is backlogged.
    share: float


@dataclass
class FairQueue(Generic[T]):
    fair: bool = True
    promote_after_s: float = DEFAULT_PROMOTE_AFTER_S
    _queues: dict[tuple[str, int], collections.deque[Entry[T]]] = field(default_factory=dict)
    _accounts: dict[str, _Account] = field(default_factory=dict)
    _seq: Iterator[int] = field(default_factory=itertools.count)
    _size: int = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Entry[T]]:
        for q in self._queues.values():
            yield from q

    def running(self, account: str) -> int:
        acc = self._accounts.get(self._key(account))
        return 0 if acc is None else acc.running

    def queued(self, account: str) -> int:
        acc = self._accounts.get(self._key(account))
        return 0 if acc is None else acc.queued

    def counter(self, account: str) -> float:
        acc = self._accounts.get(self._key(account))
        return 0.0 if acc is None else acc.counter

    # -- arrivals and departures -----------------------------------------------------

    def push(self, item: T, tenant: Tenant, slots: int, now: float) -> Entry[T]:
        """Queue a request at the back of its account's (and class's) line."""
        entry = Entry(item, tenant, slots, now, next(self._seq))
        acc = self._activate(tenant)
        acc.queued += 1
        self._queues.setdefault(self._line(entry), collections.deque()).append(entry)
        self._size += 1
        return entry

    def remove(self, entry: Entry[T]) -> bool:
        """Take a waiting request out (it gave up); False if it is not waiting."""
        line = self._line(entry)
        q = self._queues.get(line)
        if q is None or entry not in q:
            return False
        q.remove(entry)
        if not q:
            del self._queues[line]
        self._size -= 1
        acc = self._accounts[self._key(entry.tenant.account)]
        acc.queued -= 1
        self._settle(acc)
        return True

    def start(self, tenant: Tenant) -> None:
        """A request of ``tenant`` runs without having queued (slots were free)."""
        self._activate(tenant).running += 1

    def finish(self, account: str) -> None:
        """A request of ``account`` ended: its slots are back."""
        acc = self._accounts.get(self._key(account))
        if acc is None or acc.running == 0:
            return
        acc.running -= 1
        self._settle(acc)

    def serve(self, account: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Count service for ``account``, as it happens."""
        acc = self._accounts.get(self._key(account))
        if acc is None or not self.fair:
            return
        served = prompt_tokens * PROMPT_TOKEN_COST + completion_tokens * COMPLETION_TOKEN_COST
        acc.counter += served / acc.weight

    # -- the decision ------------------------------------------------------------------

    def pop_next(self, free_slots: int, now: float) -> Entry[T] | None:
        """The request that gets slots now, taken out of the queue and counted as
        running; None if nothing may run (empty, capped, or the next one needs more
        than ``free_slots``)."""
        best: Entry[T] | None = None
        best_key: tuple[float, ...] = ()
        lines = [(line, q[0]) for line, q in self._queues.items() if self._may_go(q[0])]
        top = max((klass for (_, klass), _ in lines), default=0)
        for (account, _), head in lines:
            acc = self._accounts[account]
            key: tuple[float, ...]
            if self.fair:
                key = (
                    -head.klass(now, self.promote_after_s, top),
                    acc.counter,
                    acc.running,
                    head.seq,
                )
            else:
                key = (head.seq,)
            if best is None or key < best_key:
                best, best_key = head, key
        if best is None or best.slots > free_slots:
            return None
        line = self._line(best)
        q = self._queues[line]
        q.popleft()
        if not q:
            del self._queues[line]
        self._size -= 1
        acc = self._accounts[self._key(best.tenant.account)]
        acc.queued -= 1
        acc.running += 1
        return best

    def _may_go(self, head: Entry[T]) -> bool:
        """Whether a line's head may run now: its account is under its cap."""
        cap = head.tenant.max_concurrent
        if not self.fair or cap is None:
            return True
        return self._accounts[head.tenant.account].running < cap

    # -- the deployments view ----------------------------------------------------------

    def accounts(self) -> list[AccountView]:
        """The active accounts: waiting ones first, most waiting first."""
        active = {a: acc for a, acc in self._accounts.items() if acc.active}
        total = sum(acc.weight for acc in active.values()) or 1.0
        queued: dict[str, dict[Priority, int]] = {a: {} for a in active}
        for (account, klass), q in self._queues.items():
            queued[account][PRIORITIES[klass]] = len(q)
        views = [
            AccountView(
                account=a,
                weight=acc.weight,
                running=acc.running,
                queued=queued[a],
                virtual_tokens=round(acc.counter, 1),
                share=round(acc.weight / total, 4),
            )
            for a, acc in active.items()
        ]
        views.sort(key=lambda v: (-sum(v.queued.values()), v.account))
        return views

    # -- internals ---------------------------------------------------------------------

    def _key(self, account: str) -> str:
        return account if self.fair else _FIFO

    def _line(self, entry: Entry[T]) -> tuple[str, int]:
        if not self.fair:
            return (_FIFO, 0)
        return (entry.tenant.account, rank(entry.tenant.priority))

    def _activate(self, tenant: Tenant) -> _Account:
        """The account's record, its counter caught up if it was idle."""
        key = self._key(tenant.account)
        acc = self._accounts.get(key)
        if acc is None:
            acc = self._accounts[key] = _Account()
        if not acc.active:
            others = [a.counter for k, a in self._accounts.items() if k != key and a.active]
            if others:
                # Idle time is no credit: start no lower than the least-served active.
                acc.counter = max(acc.counter, min(others))
        # The ledger's latest say (a change reaches the next request).
        acc.weight = tenant.weight
        acc.max_concurrent = tenant.max_concurrent
        return acc

    def _settle(self, acc: _Account) -> None:
        if acc.active:
            return
        if not any(a.active for a in self._accounts.values()):
            # Nobody is owed anything when nobody waits or runs: start afresh.
            self._accounts.clear()
            return
        floor = min(a.counter for a in self._accounts.values() if a.active)
        # An idle account at or below the floor would be caught up to it on return
        # anyway: forgetting it changes nothing and keeps the table small.
        for k in [k for k, a in self._accounts.items() if not a.active and a.counter <= floor]:
            del self._accounts[k]
