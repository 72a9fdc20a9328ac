"""The Batch API's batches, in the ledger's database (their files are
:mod:`tokenmill.ledger.files`').

A batch is its state and one row a line of its input (``batch_lines``), so that every
gateway on one PostgreSQL database shares a batch's lines and a gateway that starts
again resumes them. What makes that safe is done here, in single transactions:

- a line is *claimed* by one gateway (``FOR UPDATE SKIP LOCKED`` on PostgreSQL, the
  write lock on SQLite): pending -> running, with the request id it runs as;
- it is *finished* only by the gateway that holds it (running -> completed or failed,
  with its output line), so a line taken back from a gateway thought dead can never
  be written twice;
- a running line whose gateway stopped beating (the ledger's ``gateways`` table,
  as the sweeper reads it) is *taken back*: pending again for one more try, or failed;
- a batch is *finalized* once, when none of its lines is pending or running: its
  output and error files written (:meth:`~tokenmill.ledger.files.FileStore.write`)
  and its status set in the same transaction.

Another account's batch reads as absent, like an id that never existed.
This module knows JSON and rows; it never knows HTTP nor what a line's body means.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenmill.ledger.audit import SYSTEM, Actor, AuditTrail
from tokenmill.ledger.base import new_id
from tokenmill.ledger.files import FileStore, Page
from tokenmill.ledger.sql import SqlLedger, Tx

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
LineState = Literal["pending", "running", "completed", "failed", "expired", "cancelled"]
# A line whose gateway died is run at most this many times in all.
MAX_ATTEMPTS = 2
_BATCH_COLS = "id, account_id, key_id, status, created, deadline, total, body"
# The object fields a batch keeps in its ``body`` column (the rest are columns).
_TIMES = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class LineSpec:
    """One valid line of an input file, as the batch will run it."""

    line: int  # its index in the file, from 0
    custom_id: str
    deployment: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Batch:
    id: str
    account_id: str
    key_id: str | None
    status: BatchStatus
    created: float
    deadline: float
    total: int
    # The object's other fields: endpoint, input_file_id, completion_window,
    # metadata, errors, output_file_id, error_file_id and the status timestamps.
    fields: dict[str, Any]
    completed: int = 0
    failed: int = 0

    def to_json(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        f = self.fields
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": f["endpoint"],
            "errors": f.get("errors"),
            "input_file_id": f["input_file_id"],
            "completion_window": f["completion_window"],
            "status": self.status,
            "output_file_id": f.get("output_file_id"),
            "error_file_id": f.get("error_file_id"),
            "created_at": int(self.created),
            "expires_at": int(self.deadline),
            **{t: f.get(t) for t in _TIMES},
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": f.get("metadata"),
        }


@dataclass(frozen=True, slots=True)
class Claimed:
    """A line this gateway now runs, and whom for."""

    batch_id: str
    line: int
    custom_id: str
    deployment: str
    url: str
    body: str  # its request's body, JSON as stored: read once, into the route's model
    request_id: str
    account_id: str
    key_id: str | None
    attempts: int


@dataclass(slots=True)
class Finalized:
    batch_id: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    lines: dict[str, int] = field(default_factory=dict)


def output_line(
    custom_id: str,
    request_id: str | None,
    status_code: int | None,
    body: Any,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A line of an output or error file, in OpenAI's shape."""
    response = None
    if status_code is not None:
        response = {"status_code": status_code, "request_id": request_id, "body": body}
    return {
        "id": new_id("batch_req"),
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


def succeeded(result: dict[str, Any]) -> bool:
    """Whether an output line goes to the output file (else the error file)."""
    response = result.get("response")
    return response is not None and 200 <= int(response["status_code"]) < 300


class BatchStore:
    """Batches and their lines on ``ledger``'s database; ``files`` keeps their
    output and error files."""

    def __init__(self, ledger: SqlLedger, files: FileStore) -> None:
        self.ledger = ledger
        self.files = files

    # -- the API's side ------------------------------------------------------------
    async def create(
        self,
        account_id: str,
        key_id: str | None,
        fields: dict[str, Any],
        window_s: float,
        lines: Sequence[LineSpec],
        errors: list[dict[str, Any]] | None = None,
    ) -> Batch:
        """A batch of ``lines``, in progress; or, given validation ``errors``, failed
        with none of its lines stored (nothing will run)."""
        now = self.ledger.clock()
        fields = dict(fields)
        status: BatchStatus
        if errors:
            status = "failed"
            fields["errors"] = {"object": "list", "data": errors}
            fields["failed_at"] = int(now)
        else:
            status = "in_progress"
            fields["in_progress_at"] = int(now)
        batch = Batch(
            new_id("batch"), account_id, key_id, status, now, now + window_s,
            len(lines), fields,
        )  # fmt: skip

        def tx_fn(tx: Tx) -> None:
            tx.run(
                f"INSERT INTO batches ({_BATCH_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    batch.id, account_id, key_id, status, now, batch.deadline,
                    batch.total, _json(fields),
                ),
            )  # fmt: skip
            if status == "failed":
                return
            for spec in lines:
                tx.run(
                    "INSERT INTO batch_lines (batch_id, line, custom_id, deployment, url, body, "
                    "state) VALUES (?, ?, ?, ?, ?, ?, 'pending')",
                    (batch.id, spec.line, spec.custom_id, spec.deployment, spec.url,
                     _json(spec.body)),
                )  # fmt: skip

        await self.ledger.transact(tx_fn)
        return batch

    @staticmethod
    def _read(tx: Tx, row: Sequence[Any]) -> Batch:
        fields = json.loads(row[7])
        counts = fields.get("counts")  # an ended batch's, its lines deleted
        if counts is None:
            counts = dict(
                tx.all(
                    "SELECT state, COUNT(*) FROM batch_lines WHERE batch_id = ? GROUP BY state",
                    (row[0],),
                )
            )
        return Batch(
            row[0], row[1], row[2], row[3], float(row[4]), float(row[5]), int(row[6]),
            fields, int(counts.get("completed", 0)), int(counts.get("failed", 0)),
        )  # fmt: skip

    async def get(self, batch_id: str, account_id: str | None) -> Batch | None:
        """The batch, if ``account_id`` owns it (None: whoever does)."""

        def tx_fn(tx: Tx) -> Batch | None:
            row = tx.one(f"SELECT {_BATCH_COLS} FROM batches WHERE id = ?", (batch_id,))
            if row is None or (account_id is not None and row[1] != account_id):
                return None
            return self._read(tx, row)

        return await self.ledger.transact(tx_fn)

    async def page(
        self, account_id: str, *, limit: int = 20, after: str | None = None
    ) -> Page[Batch]:
        def tx_fn(tx: Tx) -> Page[Batch]:
            sql = f"SELECT {_BATCH_COLS} FROM batches WHERE account_id = ?"
            params: list[Any] = [account_id]
            if after is not None:
                cursor = tx.one(
                    "SELECT created FROM batches WHERE id = ? AND account_id = ?",
                    (after, account_id),
                )
                if cursor is not None:
                    sql += " AND (created < ? OR (created = ? AND id < ?))"
                    params += [cursor[0], cursor[0], after]
            rows = tx.all(sql + " ORDER BY created DESC, id DESC LIMIT ?", [*params, limit + 1])
            return Page([self._read(tx, r) for r in rows[:limit]], len(rows) > limit)

        return await self.ledger.transact(tx_fn)

    async def cancel(
        self, batch_id: str, account_id: str, *, actor: Actor = SYSTEM
    ) -> Batch | None:
        """Stop the batch: no line not yet started will run (nor cost anything); the
        lines running finish, then the batch is ``cancelled``. A batch that already
        ended is returned as it is. The cancellation is audited (``batch.cancelled``)."""
        now = self.ledger.clock()

        def tx_fn(tx: Tx, trail: AuditTrail) -> Batch | None:
            row = tx.one(
                f"SELECT {_BATCH_COLS} FROM batches WHERE id = ?{self.ledger.lock}", (batch_id,)
            )
            if row is None or row[1] != account_id:
                return None
            if row[3] == "in_progress":
                fields = json.loads(row[7])
                fields["cancelling_at"] = int(now)
                tx.run(
                    "UPDATE batches SET status = 'cancelling', body = ? WHERE id = ?",
                    (_json(fields), batch_id),
                )
                why = "the batch was cancelled before this request ran"
                unrun = self._end_pending(tx, batch_id, "cancelled", "batch_cancelled", why)
                row = tx.one(f"SELECT {_BATCH_COLS} FROM batches WHERE id = ?", (batch_id,))
                trail.record(
                    "batch.cancelled", "batch", batch_id,
                    {"account": account_id, "status": "in_progress"},
                    {"account": account_id, "status": "cancelling", "lines_not_run": unrun},
                )  # fmt: skip
            return self._read(tx, row)

        return await self.ledger.audited(actor, tx_fn)

    @staticmethod
    def _end_pending(tx: Tx, batch_id: str, state: LineState, code: str, message: str) -> int:
        """End every pending line of the batch unrun, with an error line each."""
        rows = tx.all(
            "SELECT line, custom_id FROM batch_lines WHERE batch_id = ? AND state = 'pending'",
            (batch_id,),
        )
        for line, custom_id in rows:
            result = output_line(custom_id, None, None, None, {"code": code, "message": message})
            tx.run(
                "UPDATE batch_lines SET state = ?, result = ? WHERE batch_id = ? AND line = ?",
                (state, _json(result), batch_id, line),
            )
        return len(rows)

    # -- the runner's side ---------------------------------------------------------
    async def claim(
        self, gateway_id: str, deployment: str, n: int, skip: Collection[str] = ()
    ) -> list[Claimed]:
        """Up to ``n`` pending lines for ``deployment`` (none of the batches in
        ``skip``), oldest batch first, now running on ``gateway_id``, each with a fresh
        request id."""
        if n <= 0:
            return []
        now = self.ledger.clock()
        lock = self.ledger.lock + " OF l SKIP LOCKED" if self.ledger.lock else ""
        skipped = list(skip)
        not_in = f" AND l.batch_id NOT IN ({', '.join('?' * len(skipped))})" if skipped else ""

        def tx_fn(tx: Tx) -> list[Claimed]:
            rows = tx.all(
                "SELECT l.batch_id, l.line, l.custom_id, l.url, l.body, l.attempts, "
                "b.account_id, b.key_id FROM batch_lines l JOIN batches b ON b.id = l.batch_id "
                "WHERE l.state = 'pending' AND l.deployment = ? AND b.status = 'in_progress' "
                f"AND b.deadline > ?{not_in} ORDER BY b.created, l.batch_id, l.line LIMIT ?{lock}",
                (deployment, now, *skipped, n),
            )
            claimed = []
            for batch_id, line, custom_id, url, body, attempts, account_id, key_id in rows:
                request_id = new_id("req")
                tx.run(
                    "UPDATE batch_lines SET state = 'running', gateway_id = ?, request_id = ?, "
                    "attempts = attempts + 1 WHERE batch_id = ? AND line = ?",
                    (gateway_id, request_id, batch_id, line),
                )
                claimed.append(
                    Claimed(
                        batch_id,
                        int(line),
                        custom_id,
                        deployment,
                        url,
                        body,
                        request_id,
                        account_id,
                        key_id,
                        int(attempts) + 1,
                    )
                )
            return claimed

        return await self.ledger.transact(tx_fn)

    async def finish(
        self, claimed: Claimed, gateway_id: str, state: LineState, result: dict[str, Any]
    ) -> bool:
        """Write a line's outcome, if ``gateway_id`` still holds it."""
        row = await self.ledger.transact(
            lambda tx: tx.one(
                "UPDATE batch_lines SET state = ?, result = ? WHERE batch_id = ? AND line = ? "
                "AND state = 'running' AND gateway_id = ? AND request_id = ? RETURNING line",
                (
                    state,
                    _json(result),
                    claimed.batch_id,
                    claimed.line,
                    gateway_id,
                    claimed.request_id,
                ),
            )
        )
        return row is not None

    async def unclaim(self, claimed: Claimed, gateway_id: str, *, counted: bool = False) -> bool:
        """Put a line ``gateway_id`` holds back to pending: one that did not run (no
        capacity, no credit yet, shutting down), its attempt not counted; or, with
        ``counted``, one that failed on the replica's side, for one more try."""
        attempts = "attempts" if counted else "attempts - 1"
        row = await self.ledger.transact(
            lambda tx: tx.one(
                "UPDATE batch_lines SET state = 'pending', gateway_id = NULL, request_id = NULL, "
                f"attempts = {attempts} WHERE batch_id = ? AND line = ? AND state = 'running' "
                "AND gateway_id = ? AND request_id = ? RETURNING line",
                (claimed.batch_id, claimed.line, gateway_id, claimed.request_id),
            )
        )
        return row is not None

    async def running(self, batch_id: str) -> int:
        row = await self.ledger.transact(
            lambda tx: tx.one(
                "SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND state = 'running'",
                (batch_id,),
            )
        )
        return int(row[0])

    async def end_pending(self, batch_id: str, code: str, message: str) -> int:
        """Fail every line of the batch not yet started (its account ran out of
        credit): they are reported, never run."""
        return await self.ledger.transact(
            lambda tx: self._end_pending(tx, batch_id, "failed", code, message)
        )

    async def take_back(self, gateway_id: str, stale_s: float) -> int:
        """Lines running on gateways silent for ``stale_s`` (or gone): pending again
        for one more try, or failed after ``MAX_ATTEMPTS``. Their holds are the
        sweeper's (settled on what they streamed)."""
        cutoff = self.ledger.clock() - stale_s

        def tx_fn(tx: Tx) -> int:
            rows = tx.all(
                "SELECT l.batch_id, l.line, l.custom_id, l.attempts, l.request_id, l.gateway_id "
                "FROM batch_lines l LEFT JOIN gateways g ON g.id = l.gateway_id "
                "WHERE l.state = 'running' AND l.gateway_id <> ? "
                "AND (g.heartbeat IS NULL OR g.heartbeat < ?)",
                (gateway_id, cutoff),
            )
            # Each update names the dead claim (its request id): a line another
            # gateway took back and claimed meanwhile is not touched.
            for batch_id, line, custom_id, attempts, request_id, holder in rows:
                if int(attempts) < MAX_ATTEMPTS:
                    tx.run(
                        "UPDATE batch_lines SET state = 'pending', gateway_id = NULL, "
                        "request_id = NULL WHERE batch_id = ? AND line = ? AND state = 'running' "
                        "AND gateway_id = ? AND request_id = ?",
                        (batch_id, line, holder, request_id),
                    )
                    continue
                result = output_line(
                    custom_id, request_id, None, None,
                    {"code": "gateway_lost",
                     "message": f"the gateway running this request stopped, {attempts} times"},
                )  # fmt: skip
                tx.run(
                    "UPDATE batch_lines SET state = 'failed', result = ? WHERE batch_id = ? "
                    "AND line = ? AND state = 'running' AND gateway_id = ? AND request_id = ?",
                    (_json(result), batch_id, line, holder, request_id),
                )
            return len(rows)

        return await self.ledger.transact(tx_fn)

    async def expire(self) -> list[str]:
        """End the pending lines of batches past their window, unrun; the batches
        expire once their running lines are done (``finalize``)."""
        now = self.ledger.clock()

        def tx_fn(tx: Tx) -> list[str]:
            rows = tx.all(
                f"SELECT {_BATCH_COLS} FROM batches WHERE status = 'in_progress' AND deadline <= ?"
                + self.ledger.lock,
                (now,),
            )
            for row in rows:
                why = "this request could not be run before the batch expired"
                self._end_pending(tx, row[0], "expired", "batch_expired", why)
                fields = json.loads(row[7])
                fields.setdefault("expired_at", int(now))
                tx.run("UPDATE batches SET body = ? WHERE id = ?", (_json(fields), row[0]))
            return [row[0] for row in rows]

        return await self.ledger.transact(tx_fn)

    async def finalize(self) -> list[Finalized]:
        """Every batch in progress or cancelling whose lines have all ended: its
        output and error files written and its final status set, in one transaction
        each (whichever gateway gets there first; the others find nothing to do)."""
        candidates = await self.ledger.transact(
            lambda tx: tx.all(
                "SELECT b.id FROM batches b WHERE b.status IN ('in_progress', 'cancelling') "
                "AND NOT EXISTS (SELECT 1 FROM batch_lines l WHERE l.batch_id = b.id "
                "AND l.state IN ('pending', 'running'))"
            )
        )
        done = []
        for (batch_id,) in candidates:
            result = await self.ledger.transact(
                functools.partial(self._finalize, batch_id=batch_id)
            )
            if result is not None:
                done.append(result)
        return done

    def _finalize(self, tx: Tx, batch_id: str) -> Finalized | None:
        row = tx.one(
            f"SELECT {_BATCH_COLS} FROM batches WHERE id = ?{self.ledger.lock}", (batch_id,)
        )
        if row is None or row[3] not in ("in_progress", "cancelling"):
            return None
        lines = tx.all(
            "SELECT state, result FROM batch_lines WHERE batch_id = ? ORDER BY line", (batch_id,)
        )
        if any(state in ("pending", "running") for state, _ in lines):
            return None
        now = self.ledger.clock()
        fields = json.loads(row[7])
        status: BatchStatus
        if row[3] == "cancelling":
            status = "cancelled"
        elif any(state == "expired" for state, _ in lines):
            status = "expired"
        else:
            status = "completed"
        out: list[str] = []
        err: list[str] = []
        counts: dict[str, int] = {}
        for state, result in lines:
            counts[state] = counts.get(state, 0) + 1
            (out if succeeded(json.loads(result)) else err).append(result)
        final = Finalized(batch_id, status, lines=counts)
        account = row[1]
        if out:
            f = self.files.write(tx, account, "batch_output", f"{batch_id}_output.jsonl",
                                "\n".join(out).encode() + b"\n")  # fmt: skip
            final.output_file_id = fields["output_file_id"] = f.id
        if err:
            f = self.files.write(tx, account, "batch_output", f"{batch_id}_error.jsonl",
                                "\n".join(err).encode() + b"\n")  # fmt: skip
            final.error_file_id = fields["error_file_id"] = f.id
        # The lines' outcomes now live in the files: the rows go, their counts stay.
        fields["counts"] = counts
        tx.run("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
        fields["finalizing_at"] = int(now)
        fields[f"{status}_at"] = fields.get(f"{status}_at") or int(now)
        tx.run(
            "UPDATE batches SET status = ?, body = ? WHERE id = ?",
            (status, _json(fields), batch_id),
        )
        return final

    async def active_deployments(self) -> list[str]:
        """The deployments that pending lines of batches in progress wait for."""
        rows = await self.ledger.transact(
            lambda tx: tx.all(
                "SELECT DISTINCT l.deployment FROM batch_lines l JOIN batches b "
                "ON b.id = l.batch_id WHERE l.state = 'pending' AND b.status = 'in_progress'"
            )
        )
        return [r[0] for r in rows]
