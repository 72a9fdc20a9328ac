"""One configuration object, filled the same way from the CLI, ``TOKENMILL_*`` variables
and a TOML file (``--config``): the gateway's :mod:`.settings`, and a section per
deployment in :mod:`.deployments`. Precedence: CLI flag > environment > file > default.

A bad file stops start-up with a :class:`ConfigError` naming the file and the key.
"""

from tokenmill.config.deployments import (
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_N_CTX,
    DEFAULT_PROMOTE_AFTER_S,
    ENGINE_SECTIONS,
    POOL_NAME_PATTERN,
    WEIGHT_TYPES,
    Autoscale,
    DeploymentCommon,
    DeploymentConfig,
    EngineSection,
    LlamaCppDeployment,
    Placement,
    Price,
    ReplicatedDeployment,
    ScriptedDeployment,
    UpstreamDeployment,
    WeightsSetting,
    parse_section,
)
from tokenmill.config.settings import (
    DEFAULT_CLIENT_TIMEOUT_S,
    DEFAULT_DEPLOYMENT_ID,
    DEFAULT_DRAIN_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_RESPONSES_RETENTION_S,
    DEFAULT_STREAM_KEEPALIVE_S,
    ConfigError,
    ServeSettings,
    Settings,
    default_data_dir,
    is_postgres,
    load_settings,
)

__all__ = [
    "DEFAULT_CLIENT_TIMEOUT_S",
    "DEFAULT_DEPLOYMENT_ID",
    "DEFAULT_DRAIN_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_NUM_SEQS",
    "DEFAULT_N_CTX",
    "DEFAULT_PROMOTE_AFTER_S",
    "DEFAULT_RESPONSES_RETENTION_S",
    "DEFAULT_STREAM_KEEPALIVE_S",
    "ENGINE_SECTIONS",
    "POOL_NAME_PATTERN",
    "WEIGHT_TYPES",
    "Autoscale",
    "ConfigError",
    "DeploymentCommon",
    "DeploymentConfig",
    "EngineSection",
    "LlamaCppDeployment",
    "Placement",
    "Price",
    "ReplicatedDeployment",
    "ScriptedDeployment",
    "ServeSettings",
    "Settings",
    "UpstreamDeployment",
    "WeightsSetting",
    "default_data_dir",
    "is_postgres",
    "load_settings",
    "parse_section",
]
