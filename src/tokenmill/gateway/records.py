"""What happened to one request: its record, the observers that watch it, and its one
log line (``tokenmill.requests``, one JSON object a request, written when it ends)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmill import stages
from tokenmill.gateway.routing import Decision
from tokenmill.identity import Caller
from tokenmill.kvblocks import BLOCK_TOKENS

log = logging.getLogger("tokenmill.requests")


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


@dataclass
class RequestRecord:
    """What happened to one request; handed to observers when it ends."""

    request_id: str
    deployment: str
    caller: Caller
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = "error"
    status: str = "ok"
    error_code: str | None = None
    charged: int = 0
    started: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.time)
    queue_s: float = 0.0
    ttft_s: float | None = None
    duration_s: float = 0.0
    # Monotonic marks along the first token's path (see tokenmill.stages).
    marks: stages.Marks = field(default_factory=dict)
    # The routing decision: which replica, why, how much of the prompt it had cached.
    route: Decision | None = None


class Observer(Protocol):
    """Hooks for metrics; every method must be cheap and never raise."""

    def on_start(self, record: RequestRecord) -> None: ...
    def on_tokens(self, record: RequestRecord, now: float) -> None: ...
    def on_finish(self, record: RequestRecord) -> None: ...


def finished(record: RequestRecord, observers: Iterable[Observer]) -> None:
    """The request ended, or was refused: its observers hear of it, and its log line
    is written."""
    for o in observers:
        o.on_finish(record)
    log_record(record)


def log_record(record: RequestRecord) -> None:
    """Write the request's one log line (``tokenmill.requests``), however it ended."""
    log.info(
        json.dumps(
            {
                "event": "request",
                "request_id": record.request_id,
                "deployment": record.deployment,
                "account": record.caller.account_id,
                # The class it was served in (docs/fairness.md).
                "priority": record.caller.priority,
                "prompt_tokens": record.prompt_tokens,
                "completion_tokens": record.completion_tokens,
                "cached_tokens": record.cached_tokens,
                "ttft_ms": None if record.ttft_s is None else round(record.ttft_s * 1000, 1),
                "duration_ms": round((time.monotonic() - record.started) * 1000, 1),
                "queue_ms": round(record.queue_s * 1000, 1),
                # Where the first token's time went, stage by stage (tokenmill.stages).
                "stages_ms": None
                if record.ttft_s is None
                else {k: round(v * 1000, 3) for k, v in stages.durations(record.marks).items()},
                "finish_reason": record.finish_reason,
                "status": record.status,
                "error_code": record.error_code,
                "charged": record.charged,
                "route": _route_fields(record.route),
            }
        )
    )


def _route_fields(route: Decision | None) -> dict[str, Any] | None:
    """The ``route`` field of a request's log line (docs/routing.md)."""
    if route is None:
        return None
    return {
        "replica": route.index,
        "reason": route.reason,
        "cached_blocks": route.cached_tokens // BLOCK_TOKENS,
        "cached_tokens": route.cached_tokens,
        "score_ms": None if route.score_s is None else round(route.score_s * 1000, 3),
        "continues": route.continues,
        "tier": route.tier,
        "moved_from": route.move_from,
        "moved": route.moved,
    }
