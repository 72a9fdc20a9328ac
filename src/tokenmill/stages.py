"""Where a request's first token goes: monotonic marks along its path, and the stages
between them.

Every HTTP request carries a :data:`Marks` dict (mark name -> ``time.monotonic()``),
made by the outermost middleware and found through a context variable by each layer
it crosses (auth, the route, the gateway's admission, prompt preparation and credit
hold), then kept on the request's record. A replica records its own marks of the
request's first token (queued, taken by the decode loop, its prompt decoded, sampled,
its frame written) and sends them in the frame carrying that token: a replica
process shares the host's monotonic clock, so they line up with the gateway's. The
first SSE event with text closes the list.

:data:`STAGES` are the differences between consecutive marks; together they add up
to the time from the first byte of the request to its first token on the wire. Each
request's stages are in its log line (``stages_ms``) and, with metrics on, in the
``tokenmill_first_token_stage_seconds`` histogram. Recording costs a few
``time.monotonic()`` calls and a small dict per request; nothing here can fail a
request.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Sequence
from contextvars import ContextVar

Marks = dict[str, float]

# Marks a replica sends with its first token, in this order (see ``REPLICA_MARKS``).
REPLICA_MARKS = ("queued", "picked", "decoded", "sampled", "sent")

# (stage, from mark, to mark), in the order a request meets them.
STAGES: tuple[tuple[str, str, str], ...] = (
    # uvicorn: from the request's first byte parsed to the ASGI app called.
    ("http", "arrive", "app"),
    # API key middleware (a cached key lookup).
    ("auth", "app", "auth"),
    # The body read and validated into the request model.
    ("parse", "auth", "parsed"),
    # The gateway's checks and the admission queue.
    ("admission", "parsed", "admitted"),
    # Chat template and tokenization, in the replica (a round trip to a replica
    # process): prepare_hop is the two crossings, prepare the replica's own work.
    ("prepare_hop", "admitted", "prepare_start"),
    ("prepare", "prepare_start", "prepare_end"),
    ("prepare_back", "prepare_end", "prepared"),
    # The credit hold in the ledger.
    ("hold", "prepared", "held"),
    # From the hold to the request handed to its replica.
    ("dispatch", "held", "dispatched"),
    # The generate frame written, read by the replica and queued for the decode loop.
    ("to_replica", "dispatched", "queued"),
    # Until the decode loop takes the request into a slot.
    ("engine_queue", "queued", "picked"),
    # The prompt decoded (prefill), to the step that gives its last row's logits.
    ("prefill", "picked", "decoded"),
    # Sampling the first token and its text.
    ("sample", "decoded", "sampled"),
    # The step's frame built and written.
    ("frame", "sampled", "sent"),
    # The frame read by the gateway.
    ("to_gateway", "sent", "received"),
    # The first SSE event with text written to the client's socket.
    ("sse", "received", "written"),
)
STAGE_NAMES = tuple(name for name, _, _ in STAGES)

# The key under which the HTTP listener leaves the "arrive" mark in the ASGI scope's state.
ARRIVED = "tokenmill_arrived"

_current: ContextVar[Marks | None] = ContextVar("tokenmill_marks", default=None)


@functools.cache
def clock_id() -> str | None:
    """This host's monotonic clock: the kernel's boot id, the same for every process of
    one boot of one machine (Linux). Two processes whose ids are equal read the same
    ``time.monotonic()`` (unless one runs in a time namespace of its own, which offsets
    it: its stages would be off, never a request); None where it cannot be read (no
    marks are then compared)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def begin(marks: Marks) -> object:
    """Make ``marks`` the current request's (returns the token for :func:`end`)."""
    return _current.set(marks)


def end(token: object) -> None:
    _current.reset(token)  # type: ignore[arg-type]


def current() -> Marks | None:
    """The current request's marks, if it has any."""
    return _current.get()


def mark(name: str, at: float | None = None) -> None:
    """Record ``name`` now (or ``at``) on the current request's marks, if any."""
    marks = _current.get()
    if marks is not None:
        marks[name] = time.monotonic() if at is None else at


def take_first(
    pending: dict[str, tuple[float, ...]], rids: Iterable[str]
) -> dict[str, list[float]] | None:
    """The first-token marks an engine keeps in ``pending`` (request id -> queued,
    picked, decoded, sampled) of the requests among ``rids`` (one step's events),
    removed from ``pending``, each with the time it leaves now (``sent``)."""
    if not pending:
        return None
    now = time.monotonic()
    out = {rid: [*m, now] for rid in rids if (m := pending.pop(rid, None)) is not None}
    return out or None


def received(values: Sequence[float], at: float) -> Marks:
    """The marks of a first token sent as ``REPLICA_MARKS`` values, read at ``at``."""
    marks = {name: float(v) for name, v in zip(REPLICA_MARKS, values, strict=False)}
    marks["received"] = at
    return marks


def durations(marks: Marks) -> dict[str, float]:
    """Seconds spent in each stage both of whose marks were recorded."""
    out: dict[str, float] = {}
    for name, start, stop in STAGES:
        a, b = marks.get(start), marks.get(stop)
        if a is not None and b is not None:
            out[name] = b - a
    return out
