"""Wire models every API of the server shares: the field types (integers JSON may
write as 16.0, token ids), the error body and where a validation error points, and the
server's own answers (models, deployments, health).

API-specific wire models live with their API (:mod:`tokenmill.server.openai`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

Number = Annotated[float, Field(allow_inf_nan=False)]


def _integral(value: Any) -> Any:
    # JSON has one number type: 16.0 is the integer 16 to JSON Schema (and to a Python
    # client that computed it), while 16.5, "16" and true are still refused.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]

# Strict: JSON's true is no token id (lax pydantic would read it as 1).
TokenId = Annotated[int, BeforeValidator(_integral), Field(ge=0, strict=True)]


def error_param(loc: tuple[Any, ...]) -> str | None:
    """The OpenAI ``param`` for a pydantic error location, e.g. ``messages.0.role``."""
    parts: list[str] = []
    for p in loc:
        text = str(p)
        # Union members show up in locations as type tags ("str", "list[str]").
        if text in _TYPE_TAGS or "[" in text or text == "body":
            continue
        parts.append(text)
    return ".".join(parts) if parts else None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"})


# -- responses ------------------------------------------------------------------------
# ``extra="forbid"``: the served schema says that nothing else is sent.


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Response):
    """OpenAI's error body: every 4xx and 5xx, and the in-band error event of a stream."""

    error: ErrorDetail


class ModelCard(_Response):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelCard]


class ReplicaInfo(BaseModel):
    # The gateway describes itself; fields it adds later pass through.
    model_config = ConfigDict(extra="allow")
    index: int
    # Where it runs: "local" (the gateway's process), "process" or "ray".
    host: Literal["local", "process", "ray"]
    pid: int | None
    # On Ray: the node the replica's actor runs on.
    node_id: str | None = None
    node_address: str | None = None
    state: Literal["unloaded", "loading", "ready", "restarting", "unhealthy"]
    # "active" serves; "draining" finishes its streams before it stops; "off" is an
    # autoscaled deployment's spare (docs/autoscaling.md).
    phase: Literal["active", "draining", "off"] = "active"
    in_flight: int
    queued: int
    slots: int
    restarts: int
    tokens_generated: int
    threads: int | None = None


class AccountShare(_Response):
    """An account waiting or running on a deployment, and the share it is owed."""

    account: str
    weight: float
    running: int
    queued: dict[Literal["batch", "default", "interactive"], int]
    virtual_tokens: float
    share: float


class ScaleEventInfo(BaseModel):
    at: float  # Unix time
    direction: Literal["up", "down"]
    replicas_from: int
    replicas_to: int
    ongoing: float
    ttft_p90_s: float | None


class AutoscaleInfo(BaseModel):
    """An autoscaled deployment's bounds, the count it wants now, and its last changes."""

    min_replicas: int
    max_replicas: int
    desired_replicas: int
    target_ongoing_requests: float
    target_ttft_p90_s: float | None
    replica_seconds: float
    events: list[ScaleEventInfo]


class DeploymentInfo(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["deployment"]
    engine: str
    endpoint_type: Literal["chat", "completion"]
    in_flight: int
    queued: int
    replicas: list[ReplicaInfo]
    admission: Literal["fair", "fifo"] = "fair"
    accounts: list[AccountShare] = []
    autoscale: AutoscaleInfo | None = None


class DeploymentList(_Response):
    object: Literal["list"]
    data: list[DeploymentInfo]


class Health(_Response):
    status: Literal["ok", "loading", "draining", "failed"]


class HealthDetail(_Response):
    ready: bool
    deployments: dict[str, DeploymentInfo]
