"""Spend budgets that reset: per key and per account, one or more windows (``amount``
micro-units per ``duration``, on calendar boundaries in a time zone:
:mod:`tokenmill.ledger.windows`), in the ``budgets`` table, one row a window with
what the current window has spent.

Each function runs inside the caller's transaction, as the rate limits do
(:mod:`tokenmill.ledger.ratelimits`): a hold is admitted by every window of its key
and its account in the transaction that holds its credit (:func:`admit`), under the
account's row lock, so concurrent holds from any number of gateways can never
overshoot a window; the hold counts its whole amount in the windows it started in,
and its settlement gives back what it did not charge (:func:`give_back`). A hold
whose window has ended meanwhile keeps its charge in that window: the new window
starts from 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from tokenmill.errors import InvalidRequestError, OverloadedError
from tokenmill.ledger.base import HoldSpec
from tokenmill.ledger.database import Tx
from tokenmill.ledger.windows import Duration, window, zone

OwnerType = Literal["account", "key"]
# Windows one key or account may have: a few (a day, a week, a month) is the use.
MAX_WINDOWS = 8
_COLS = "owner_type, owner_id, duration, amount, timezone, window_start, spent"


@dataclass(frozen=True, slots=True)
class BudgetWindow:
    """What an admin sets: ``amount`` micro-units each ``duration`` in ``timezone``."""

    amount: int
    duration: str
    timezone: str = "UTC"

    def to_json(self) -> dict[str, Any]:
        return {"amount": self.amount, "duration": self.duration, "timezone": self.timezone}


@dataclass(frozen=True, slots=True)
class BudgetState:
    """A window as it stands: what its current window has spent (charged, and held
    for requests still running) and when it resets."""

    amount: int
    duration: str
    timezone: str
    spent: int
    window_start: float
    resets_at: float

    @property
    def remaining(self) -> int:
        return max(0, self.amount - self.spent)

    def to_json(self) -> dict[str, Any]:
        return {
            "amount": self.amount,
            "duration": self.duration,
            "timezone": self.timezone,
            "spent": self.spent,
            "remaining": self.remaining,
            "window_start": self.window_start,
            "resets_at": self.resets_at,
        }


def checked(windows: Sequence[BudgetWindow]) -> list[BudgetWindow]:
    """The windows, each valid and of its own duration; a 400 naming ``budget`` if not."""
    if len(windows) > MAX_WINDOWS:
        raise InvalidRequestError(f"at most {MAX_WINDOWS} budget windows", param="budget")
    seen = set()
    for i, w in enumerate(windows):
        try:
            Duration.parse(w.duration)
            zone(w.timezone)
        except ValueError as e:
            raise InvalidRequestError(str(e), param=f"budget.{i}") from None
        if w.amount < 0:
            raise InvalidRequestError("amount cannot be negative", param=f"budget.{i}.amount")
        if w.duration in seen:
            raise InvalidRequestError(
                f"two windows of {w.duration}: give each duration once", param=f"budget.{i}"
            )
        seen.add(w.duration)
    return list(windows)


def _state(row: Sequence[Any], now: float) -> BudgetState:
    start, end = window(Duration.parse(row[2]), zone(row[4]), now)
    spent = int(row[6]) if float(row[5]) == start else 0  # a new window starts from 0
    return BudgetState(int(row[3]), row[2], row[4], spent, start, end)


def _shortest_first(rows: list[Any]) -> list[Any]:
    return sorted(rows, key=lambda r: (r[0], r[1], Duration.parse(r[2]).nominal_s))


def configured(tx: Tx, owner_type: OwnerType, owner_id: str) -> list[BudgetWindow]:
    """The owner's windows as an admin set them, shortest first."""
    rows = tx.all(
        f"SELECT {_COLS} FROM budgets WHERE owner_type = ? AND owner_id = ?",
        (owner_type, owner_id),
    )
    return [BudgetWindow(int(r[3]), r[2], r[4]) for r in _shortest_first(rows)]


def states(tx: Tx, owner_type: OwnerType, owner_id: str, now: float) -> list[BudgetState]:
    """The owner's windows as they stand at ``now``, shortest first."""
    rows = tx.all(
        f"SELECT {_COLS} FROM budgets WHERE owner_type = ? AND owner_id = ?",
        (owner_type, owner_id),
    )
    return [_state(r, now) for r in _shortest_first(rows)]


def all_states(tx: Tx, now: float) -> list[tuple[str, str, BudgetState]]:
    """Every window of every key and account: (owner type, owner id, state)."""
    rows = tx.all(f"SELECT {_COLS} FROM budgets")
    return [(r[0], r[1], _state(r, now)) for r in _shortest_first(rows)]


def replace(
    tx: Tx, owner_type: OwnerType, owner_id: str, windows: Sequence[BudgetWindow], now: float
) -> None:
    """Set the owner's windows to ``windows``. A window kept (same duration and zone)
    keeps what its current window has spent; a new one starts from 0."""
    kept = {
        (r[2], r[4]): (r[5], r[6])
        for r in tx.all(
            f"SELECT {_COLS} FROM budgets WHERE owner_type = ? AND owner_id = ?",
            (owner_type, owner_id),
        )
    }
    tx.run("DELETE FROM budgets WHERE owner_type = ? AND owner_id = ?", (owner_type, owner_id))
    for w in windows:
        start, spent = kept.get((w.duration, w.timezone), (0.0, 0))
        tx.run(
            f"INSERT INTO budgets ({_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (owner_type, owner_id, w.duration, w.amount, w.timezone, start, spent),
        )


def _at(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def admit(tx: Tx, spec: HoldSpec, now: float) -> str | None:
    """Count the hold in every window of its key and account, or refuse it: 429
    ``budget_exceeded`` (``Retry-After``: when the last window it exceeds resets), or
    400 if it is more than a whole window allows. The caller holds the account's row
    lock. Returns the windows counted, for :func:`give_back` (None: none)."""
    rows = tx.all(
        f"SELECT {_COLS} FROM budgets WHERE (owner_type = 'account' AND owner_id = ?) "
        "OR (owner_type = 'key' AND owner_id = ?)",
        (spec.account_id, spec.key_id or ""),
    )
    if not rows:
        return None
    windows = [(r[0], r[1], _state(r, now)) for r in rows]
    exceeded = []
    for owner_type, _, state in windows:
        if spec.amount > state.amount:
            raise InvalidRequestError(
                f"this request may cost up to {spec.amount} micro-units but its {owner_type}'s "
                f"budget is {state.amount} per {state.duration}; lower max_tokens or shorten "
                "the prompt",
                param="max_tokens",
                code="request_too_large",
            )
        if state.spent + spec.amount > state.amount:
            exceeded.append((owner_type, state))
    if exceeded:
        owner_type, state = max(exceeded, key=lambda e: e[1].resets_at)
        raise OverloadedError(
            f"budget exceeded: this {owner_type} may spend {state.amount} micro-units per "
            f"{state.duration} ({state.spent} spent or held; this request may cost up to "
            f"{spec.amount}); it resets at {_at(state.resets_at)}",
            retry_after=state.resets_at - now,
            code="budget_exceeded",
        )
    counted = []
    for owner_type, owner_id, state in windows:
        tx.run(
            "UPDATE budgets SET window_start = ?, spent = ? "
            "WHERE owner_type = ? AND owner_id = ? AND duration = ?",
            (state.window_start, state.spent + spec.amount, owner_type, owner_id, state.duration),
        )
        counted.append([owner_type, owner_id, state.duration, state.window_start])
    return json.dumps(counted)


def give_back(tx: Tx, counted: str | None, unused: int) -> None:
    """Return the ``unused`` micro-units of a settled hold to the windows it was counted
    in, those that have not reset since (a reset one already starts from 0)."""
    if counted is None or unused <= 0:
        return
    for owner_type, owner_id, duration, start in json.loads(counted):
        tx.run(
            "UPDATE budgets SET spent = spent - ? WHERE owner_type = ? AND owner_id = ? "
            "AND duration = ? AND window_start = ?",
            (unused, owner_type, owner_id, duration, start),
        )
