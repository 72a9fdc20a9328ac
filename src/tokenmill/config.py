"""One configuration object, filled the same way from the CLI, ``TOKENMILL_*`` variables
and a TOML file (``--config``). Precedence: CLI flag > environment > file > default.

A bad file stops start-up with a :class:`ConfigError` naming the file and the key.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

DEFAULT_DEPLOYMENT_ID = "smollm2"
# The embedded model was trained with 8k context; 2k per sequence keeps the KV cache
# for 16 slots under 1 GB while fitting every realistic chat turn.
DEFAULT_N_CTX = 2048
DEFAULT_MAX_NUM_SEQS = 16
# 1 MiB of JSON is far beyond any prompt that fits a 2k-token window.
DEFAULT_MAX_BODY_BYTES = 1 << 20
# At shutdown, open streams get this long to finish before they are aborted: enough
# for a typical answer to end, short enough for an orchestrator's kill timeout (30 s).
DEFAULT_DRAIN_S = 10.0
# A client gets this long to send a whole request (headers and body), and a reader
# this long to take a stalled write, before its connection is closed: far beyond any
# honest client, short enough that held connections cost little.
DEFAULT_CLIENT_TIMEOUT_S = 30.0


class ConfigError(Exception):
    """The configuration cannot be used; the message names the file and key."""


class Price(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_per_mtok: int = Field(default=0, ge=0)
    completion_per_mtok: int = Field(default=0, ge=0)


class DeploymentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    engine: Literal["llamacpp", "upstream", "scripted"] = "llamacpp"
    endpoint_type: Literal["chat", "completion"] = "chat"
    max_queue: int = Field(default=64, ge=0)
    queue_timeout_s: float = Field(default=30.0, gt=0)
    idle_unload_s: float | None = Field(default=None, gt=0)
    price: Price | None = None

    # llamacpp
    model: Path | None = None
    replicas: int = Field(default=1, ge=1, le=64)
    max_num_seqs: int = Field(default=DEFAULT_MAX_NUM_SEQS, ge=1, le=256)
    n_ctx: int = Field(default=DEFAULT_N_CTX, ge=64)
    n_threads: int | None = Field(default=None, ge=1)
    # Each replica is a supervised child process (tokenmill.gateway.process), so a crash
    # in native code takes down one replica, not the gateway. ``false`` runs the engine
    # in the gateway's process: for embedding tokenmill and for the benchmark's ceiling.
    isolated: bool = True
    # A replica process that answers no health probe for health_check_timeout_s (or
    # whose decode step runs that long) is wedged: it is killed and restarted.
    health_check_interval_s: float = Field(default=5.0, gt=0)
    health_check_timeout_s: float = Field(default=30.0, gt=0)
    # Fewer llama.cpp threads for a step when that is measured to be faster: where other
    # busy processes share the cores, threads that wait for each other at every barrier
    # lose to one (see tokenmill.engines.threads). false: always n_threads.
    adapt_threads: bool = True
    # Niceness of replica processes. 0 (the default) competes for the cores on equal
    # terms with everything else on the host; a higher value yields them to the gateway
    # but also to every other busy process, which starves the model on a shared host
    # (10 here: 1.4 tok/s beside two busy loops, against 12.6 at 0).
    replica_nice: int = Field(default=0, ge=0, le=19)

    # upstream
    url: str | None = None
    upstream_model: str | None = None
    api_key: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    timeout_s: float = Field(default=600.0, gt=0)
    # A GGUF file whose tokenizer and chat template match the upstream model ("embedded":
    # the embedded SmolLM2's), read without its weights. Prompts are then counted exactly
    # for admission and the credit hold, and completions when the upstream reports no
    # usage; without it both are estimated from the text (about 4 characters a token).
    tokenizer: str | None = None

    # scripted (tests only: tokenmill.engines.scripted): the driver's Unix socket
    control: Path | None = None

    @model_validator(mode="after")
    def _engine_fields(self) -> DeploymentConfig:
        if self.engine == "scripted" and self.control is None:
            raise ValueError("a scripted (test) deployment needs 'control', its driver's socket")
        if self.engine != "scripted" and self.control is not None:
            raise ValueError("'control' is only for scripted (test) deployments")
        if self.engine == "upstream":
            if not self.url:
                raise ValueError("an upstream deployment needs 'url'")
            if not self.url.rstrip("/").endswith("/v1"):
                raise ValueError("'url' must be an OpenAI-compatible base URL ending in /v1")
        elif self.tokenizer is not None:
            raise ValueError("'tokenizer' is for upstream deployments (llamacpp uses its model's)")
        return self

    @field_validator("model")
    @classmethod
    def _model_exists(cls, v: Path | None) -> Path | None:
        # A field validator, so the message names the key: deployments.N.model.
        if v is not None and not v.is_file():
            raise ValueError(f"model file not found: {v}")
        return v

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_exists(cls, v: str | None) -> str | None:
        if v is not None and v != "embedded" and not Path(v).is_file():
            raise ValueError(f'tokenizer file not found: {v} (a GGUF file, or "embedded")')
        return v


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
    drain_s: float = Field(default=DEFAULT_DRAIN_S, ge=0)
    client_timeout_s: float = Field(default=DEFAULT_CLIENT_TIMEOUT_S, gt=0)
    deployments: list[DeploymentConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_ids(self) -> Settings:
        seen: set[str] = set()
        for d in self.deployments:
            if d.id in seen:
                raise ValueError(f"duplicate deployment id {d.id!r}")
            seen.add(d.id)
        return self

    def with_default_deployment(self) -> Settings:
        if self.deployments:
            return self
        return self.model_copy(update={"deployments": [DeploymentConfig(id=DEFAULT_DEPLOYMENT_ID)]})


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
    "drain_s",
    "client_timeout_s",
)


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
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
