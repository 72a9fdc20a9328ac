"""The gateway's settings (:class:`Settings`), filled the same way from the CLI,
``TOKENMILL_*`` variables and a TOML file (``--config``). Precedence: CLI flag >
environment > file > default. A bad file stops start-up with a :class:`ConfigError`
naming the file and the key.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import quote

import platformdirs
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from tokenmill.config.deployments import (
    SECTION_BY_ENGINE,
    DeploymentCommon,
    DeploymentConfig,
    LlamaCppDeployment,
    ReplicatedDeployment,
    foreign_key_message,
)

DEFAULT_DEPLOYMENT_ID = "smollm2"
# 1 MiB of JSON is far beyond any prompt that fits a 2k-token window.
DEFAULT_MAX_BODY_BYTES = 1 << 20
# At shutdown, open streams get this long to finish before they are aborted: enough
# for a typical answer to end, short enough for an orchestrator's kill timeout (30 s).
DEFAULT_DRAIN_S = 10.0
# A client gets this long to send a whole request (headers and body), and a reader
# this long to take a stalled write, before its connection is closed: far beyond any
# honest client, short enough that held connections cost little.
DEFAULT_CLIENT_TIMEOUT_S = 30.0
# How long a stored response (the Responses API's ``store``) is kept: OpenAI's 30 days.
DEFAULT_RESPONSES_RETENTION_S = 30 * 24 * 3600.0
# The Batch API's files: OpenAI's own limits (200 MB a file, 50,000 lines a batch),
# kept as long as stored responses.
DEFAULT_FILES_MAX_BYTES = 200 * 1000 * 1000
DEFAULT_FILES_RETENTION_S = 30 * 24 * 3600.0
DEFAULT_BATCH_MAX_LINES = 50_000
# A stream that has sent nothing for this long sends a ping (and a request still
# waiting to open gets its response head): well inside the shortest idle limits met in
# front of servers (30 s to a first byte, 60 s idle), soon enough that a client can
# tell a waiting server from a dead one, and a ping is 8 bytes.
DEFAULT_STREAM_KEEPALIVE_S = 5.0
# A streamed Messages or Responses answer that has sent nothing but pings for this long
# (a long prefill) sends an event its client counts as activity: Claude Code gives up
# on a stream after 300 s without an event other than ping (and warns at half that),
# Codex after 300 s without an event (an SSE comment is none).
DEFAULT_STREAM_ACTIVITY_S = 120.0


class ConfigError(Exception):
    """The configuration cannot be used; the message names the file and key."""


def default_data_dir() -> Path:
    """Where tokenmill keeps its state when ``data_dir`` is unset: the user's data
    directory (``~/.local/share/tokenmill`` on Linux)."""
    return Path(platformdirs.user_data_dir("tokenmill", appauthor=False))


class ServeSettings(BaseModel):
    """``[serve]``: gateway cells on Ray Serve (``tokenmill serve --ray-serve``)."""

    model_config = ConfigDict(extra="forbid")

    # Gateway cells (Serve replicas), each a whole gateway with its deployments.
    cells: int = Field(default=1, ge=1, le=64)
    # Serve's HTTP proxy; default: the gateway's ``port``.
    port: int | None = Field(default=None, ge=0, le=65535)
    # Requests (streams included) one cell takes at once before Serve queues them in
    # its proxy. Serve's own default (5) would cap a gateway at five streams.
    max_ongoing_requests: int = Field(default=1024, ge=1)
    # CPUs each cell's actor reserves on the cluster (its deployments' replica
    # processes are its children and reserve nothing of their own).
    num_cpus: float = Field(default=0, ge=0, allow_inf_nan=False)


def is_postgres(url: str | None) -> bool:
    return url is not None and url.startswith(("postgresql://", "postgres://"))


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    data_dir: Path | None = None
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=1024)
    ledger: str | None = None
    admin_key: str | None = None
    log_level: str = "info"
    # Prometheus observer and GET /metrics; off, the hot path carries no observer at all.
    metrics: bool = True
    # Also count tokens served per account (one series per account and deployment:
    # opt in only where accounts are few). Off, tokens are counted by priority class.
    metrics_per_account: bool = False
    drain_s: float = Field(default=DEFAULT_DRAIN_S, ge=0)
    client_timeout_s: float = Field(default=DEFAULT_CLIENT_TIMEOUT_S, gt=0)
    # Stored responses (POST /v1/responses with ``store``) are deleted this long after
    # they were made; a conversation cannot continue from one past it.
    responses_retention_s: float = Field(
        default=DEFAULT_RESPONSES_RETENTION_S, gt=0, allow_inf_nan=False
    )
    # The Batch API (docs/api.md#batches): an uploaded file's size limit, how long
    # files (uploads and batch outputs) are kept, the most lines one batch may have.
    files_max_bytes: int = Field(default=DEFAULT_FILES_MAX_BYTES, ge=1024)
    files_retention_s: float = Field(default=DEFAULT_FILES_RETENTION_S, gt=0, allow_inf_nan=False)
    batch_max_lines: int = Field(default=DEFAULT_BATCH_MAX_LINES, ge=1)
    # Keep-alive pings of streamed responses (tokenmill.server.sse); 0 or None: none.
    stream_keepalive_s: float | None = Field(default=DEFAULT_STREAM_KEEPALIVE_S, ge=0)
    # Agent APIs' activity events on a quiet stream (tokenmill.server.sse.with_ticks);
    # 0 or None: none.
    stream_activity_s: float | None = Field(default=DEFAULT_STREAM_ACTIVITY_S, ge=0)
    # The Ray cluster of deployments with placement = "ray": "local" starts a private
    # Ray instance in this host (also what such deployments get when this is unset),
    # anything else is given to ray.init: "auto", "ray://head:10001", ...
    ray_address: str | None = Field(default=None, min_length=1)
    deployments: list[DeploymentConfig] = Field(default_factory=list)
    serve: ServeSettings = Field(default_factory=ServeSettings)

    @model_validator(mode="after")
    def _unique_ids(self) -> Settings:
        seen: set[str] = set()
        for d in self.deployments:
            if d.id in seen:
                raise ValueError(f"duplicate deployment id {d.id!r}")
            seen.add(d.id)
        return self

    def data_path(self) -> Path:
        """``data_dir``, or the user's data directory when unset."""
        return self.data_dir if self.data_dir is not None else default_data_dir()

    def with_data_dir(self, section: DeploymentConfig) -> DeploymentConfig:
        """``section`` with what its replicas keep under the data dir placed there, for
        a llama.cpp deployment: its converted weights (``weights_dir``, unless set) and
        its KV disk tier (``kv_disk_dir``, unless set: ``<data_dir>/kv/<id>``, so that a
        restarted server starts from the prefixes it had cached; not for a pool's
        replicas, which gateways with other data dirs share, nor without a host tier)."""
        if not isinstance(section, LlamaCppDeployment):
            return section
        update: dict[str, Path] = {}
        if section.weights_dir is None:
            update["weights_dir"] = self.data_path() / "weights"
        if section.kv_disk_dir is None and section.kv_host_bytes != 0 and section.pool is None:
            update["kv_disk_dir"] = self.data_path() / "kv" / quote(section.id, safe="")
        return section.model_copy(update=update) if update else section

    def with_default_deployment(self) -> Settings:
        if self.deployments:
            return self
        dep = LlamaCppDeployment(id=DEFAULT_DEPLOYMENT_ID)
        return self.model_copy(update={"deployments": [dep]})

    def for_cells(self, cells: int | None = None) -> Settings:
        """These settings for ``--ray-serve``, ``cells`` (the flag) over ``[serve]``'s;
        raises :class:`ConfigError` when the cells could not share one ledger."""
        serve = self.serve.model_copy(update={"cells": cells}) if cells else self.serve
        if serve.cells < 1:
            raise ConfigError(f"--cells must be at least 1, not {serve.cells}")
        if serve.cells > 1 and not is_postgres(self.ledger):
            raise ConfigError(
                f"{serve.cells} gateway cells need one shared ledger: SQLite is one file "
                "per host process, so each cell would keep its own books. Use PostgreSQL "
                "(--ledger postgresql://..., TOKENMILL_LEDGER or ledger = ...) or --cells 1"
            )
        return self.model_copy(update={"serve": serve})

    def ray_target(self) -> str | None:
        """The address to give ray.init: None when no deployment is placed on Ray,
        else ``ray_address``, "local" (a private local instance) when unset."""
        if not any(
            isinstance(d, ReplicatedDeployment) and d.placement == "ray" for d in self.deployments
        ):
            return None
        return self.ray_address or "local"


# Values arrive as strings; pydantic's lax mode reads "0"/"false"/"off"/"no" as False.
_ENV_KEYS = (
    "host",
    "port",
    "data_dir",
    "max_body_bytes",
    "ledger",
    "admin_key",
    "log_level",
    "metrics",
    "metrics_per_account",
    "drain_s",
    "client_timeout_s",
    "responses_retention_s",
    "files_max_bytes",
    "files_retention_s",
    "batch_max_lines",
    "stream_keepalive_s",
    "stream_activity_s",
    "ray_address",
)


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        path = list(e["loc"])
        section: type[DeploymentCommon] | None = None
        # pydantic puts the engine's tag after the index (deployments.0.llamacpp.model):
        # the file has no such level, so the location leaves it out.
        if len(path) >= 3 and path[0] == "deployments" and isinstance(path[1], int):
            section = SECTION_BY_ENGINE.get(str(path[2]))
            if section is not None:
                del path[2]
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
            if section is not None and len(path) == 3:
                # Another engine's key: say whose it is.
                msg = foreign_key_message(str(path[2]), section) or msg
        elif e["type"] == "union_tag_invalid":
            path.append("engine")
            ctx = e.get("ctx", {})
            msg = f"unknown engine {ctx.get('tag')!r} (one of {ctx.get('expected_tags')})"
        elif e["type"] == "missing" and section is not None and len(path) == 3:
            msg = section.MISSING_HINTS.get(str(path[2]), msg)
        loc = ".".join(str(p) for p in path)
        lines.append(f"  {loc or '(top level)'}: {msg}")
    return "\n".join(lines)


def load_settings(
    config_file: Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Settings:
    """Build the settings; raise :class:`ConfigError` with a readable message."""
    env = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    source = "command line and environment"
    if config_file is None and env.get("TOKENMILL_CONFIG"):
        config_file = Path(env["TOKENMILL_CONFIG"])
    if config_file is not None:
        source = str(config_file)
        try:
            with open(config_file, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {config_file}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{config_file}: not valid TOML: {e}") from None
        base = config_file.parent
        for d in data.get("deployments", []):
            for key in ("model", "tokenizer"):
                if isinstance(d, dict) and isinstance(d.get(key), str) and d[key] != "embedded":
                    p = Path(d[key]).expanduser()
                    d[key] = str(p if p.is_absolute() else base / p)
    for key in _ENV_KEYS:
        value = env.get(f"TOKENMILL_{key.upper()}")
        if value:
            data[key] = value
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None
