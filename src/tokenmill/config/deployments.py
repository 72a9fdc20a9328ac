"""The ``[[deployments]]`` sections: each table is the section of its ``engine``
(llamacpp when absent): :class:`LlamaCppDeployment`, :class:`UpstreamDeployment` or
:class:`ScriptedDeployment`, each with its own keys and ``engine_target()``, the engine
class that serves it. A section survives ``model_dump(mode="json")`` and
:func:`parse_section` unchanged: that is how a replica process or Ray actor receives it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self, TypeAlias

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

# The embedded model was trained with 8k context; 2k per sequence keeps the KV cache
# for 16 slots under 1 GB while fitting every realistic chat turn.
DEFAULT_N_CTX = 2048
DEFAULT_MAX_NUM_SEQS = 16
# A request waiting in admission moves up one priority class after this long (and
# one more after each further period): long enough that interactive traffic keeps
# its edge under a burst, short enough that batch work still moves when overloaded.
DEFAULT_PROMOTE_AFTER_S = 10.0
# What a llama.cpp deployment's ``weights`` key may name: llama.cpp types a model file
# is converted to (tokenmill.engines.llamacpp.weights), or "as-is".
WEIGHT_TYPES = ("q8_0", "q4_0", "q4_k_m", "f16")
WeightsSetting: TypeAlias = Literal["as-is", "q8_0", "q4_0", "q4_k_m", "f16"]


class Price(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_per_mtok: int = Field(default=0, ge=0)
    completion_per_mtok: int = Field(default=0, ge=0)


class DeploymentCommon(BaseModel):
    """What every deployment has, whatever its engine. Each engine's section adds its own
    keys (:class:`LlamaCppDeployment`, :class:`UpstreamDeployment`,
    :class:`ScriptedDeployment`); :data:`DeploymentConfig` is any of them."""

    model_config = ConfigDict(extra="forbid")

    # The class that serves this section, as "module:Class": the engine is found from
    # its section, so a new engine needs no name table.
    ENGINE_TARGET: ClassVar[str]
    # Messages for required keys that are missing, clearer than "Field required".
    MISSING_HINTS: ClassVar[dict[str, str]] = {}

    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    endpoint_type: Literal["chat", "completion"] = "chat"
    max_queue: int = Field(default=64, ge=0)
    queue_timeout_s: float = Field(default=30.0, gt=0)
    # "fair": priority classes, then fair share between accounts (docs/fairness.md);
    # "fifo": one queue in arrival order, as before fair queuing.
    admission: Literal["fair", "fifo"] = "fair"
    promote_after_s: float = Field(default=DEFAULT_PROMOTE_AFTER_S, gt=0)
    idle_unload_s: float | None = Field(default=None, gt=0)
    price: Price | None = None
    # What a line of a Batch API batch is spared of the price: 0.5 bills it at half
    # (docs/metering.md); a batch runs on idle capacity, at the lowest priority.
    batch_discount: float = Field(default=0.5, ge=0, lt=1, allow_inf_nan=False)
    # The share of the slots Batch API lines may fill while other requests come (at
    # least one slot): more, and a batch moves faster beside interactive traffic but
    # lengthens the decode steps its first tokens wait for (docs/deployments.md).
    batch_share: float = Field(default=0.25, gt=0, le=1, allow_inf_nan=False)
    # Slots per replica (upstream: requests sent at once) and the context of each
    # (upstream: the window assumed when a client sends no max_tokens).
    max_num_seqs: int = Field(default=DEFAULT_MAX_NUM_SEQS, ge=1, le=256)
    n_ctx: int = Field(default=DEFAULT_N_CTX, ge=64)
    # Which replica serves a request (tokenmill.gateway.routing; docs/routing.md).
    routing: Literal["cache_aware", "least_loaded", "round_robin"] = "cache_aware"
    # Hosted tools (web search, code execution...: tools a provider's server runs) in a
    # Responses or Messages request: "omit" leaves them out of what the model sees and
    # names them in the x-tokenmill-omitted-tools header (agent CLIs offer web search by
    # default); "refuse": a 400 naming the tool (docs/agent-apis.md).
    hosted_tools: Literal["omit", "refuse"] = "omit"
    # "stable_first": per-session system lines after the tools (chat/layout.py); "as_sent"
    prompt_order: Literal["stable_first", "as_sent"] = "stable_first"

    @classmethod
    def engine_name(cls) -> str:
        default = cls.model_fields["engine"].default
        assert isinstance(default, str)
        return default

    def engine_target(self) -> str:
        """The engine class that serves this deployment, as "module:Class"."""
        return self.ENGINE_TARGET

    def for_replica(self, index: int) -> Self:
        """This section as replica ``index`` runs it: where a replica keeps state of
        its own (a directory), each gets its own."""
        return self


class Autoscale(BaseModel):
    """``[deployments.autoscale]``: replicas that follow the load, between
    ``min_replicas`` and ``max_replicas`` (tokenmill.gateway.autoscale;
    docs/autoscaling.md). ``replicas`` is then the count it starts with."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(default=1, ge=0, le=64)
    max_replicas: int = Field(ge=1, le=64)
    # Requests running or waiting per replica that the replicas are sized for. Unset:
    # the replica's slots (max_num_seqs): more, and requests queue.
    target_ongoing_requests: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # A first-token latency (p90 over look_back_s) past which one more replica is added
    # even below target_ongoing_requests; no replica goes while it is above 0.8 of it.
    target_ttft_p90_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # How long the load must ask for more (fewer) replicas before they are added
    # (removed); and at least this long between two scale events of one direction.
    upscale_delay_s: float = Field(default=30.0, ge=0, allow_inf_nan=False)
    downscale_delay_s: float = Field(default=600.0, ge=0, allow_inf_nan=False)
    # The load is averaged over this window (noise is not a trend).
    look_back_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    # A replica being removed finishes its streams for up to drain_s; streams still
    # running then end in-band, billed for the tokens they produced.
    drain_s: float = Field(default=300.0, ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _bounds(self) -> Autoscale:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas = {self.min_replicas} is more than max_replicas = "
                f"{self.max_replicas}"
            )
        return self


Placement = Literal["process", "local", "ray"]
# A pool's name: its replicas are the Ray actors "<pool>/<index>" (tokenmill.replicas.pool).
POOL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class ReplicatedDeployment(DeploymentCommon):
    """A deployment that runs its engine in ``replicas`` copies, each placed by
    ``placement``: "process" (a supervised child process, tokenmill.replicas.process),
    "local" (in the gateway's own process: for embedding tokenmill and for the
    benchmark's ceiling) or "ray" (a Ray actor, on the cluster of Settings.ray_address)."""

    replicas: int = Field(default=1, ge=1, le=64)
    placement: Placement = "process"
    # Move a prompt's KV state from the replica holding it to the one routing chose
    # when that beats computing it (engines that can, docs/routing.md); false: never.
    kv_moves: bool = True
    # placement = "ray" only. CPUs the replica's actor reserves (default: ray_cpus()),
    # and custom resources it needs ({node_b = 1} pins it to nodes that offer node_b).
    ray_num_cpus: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    ray_resources: dict[str, Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(
        default_factory=dict
    )
    # A replica that answers no health probe for health_check_timeout_s (or whose
    # decode step runs that long) is wedged: it is killed and restarted.
    health_check_interval_s: float = Field(default=5.0, gt=0)
    health_check_timeout_s: float = Field(default=30.0, gt=0)
    # Niceness of replica processes. 0 (the default) competes for the cores on equal
    # terms with everything else on the host; a higher value yields them to the gateway
    # but also to every other busy process, which starves the model on a shared host
    # (10 here: 1.4 tok/s beside two busy loops, against 12.6 at 0).
    replica_nice: int = Field(default=0, ge=0, le=19)
    # placement = "ray" only: the replicas are the named Ray actors of this pool, shared
    # by every gateway (or Serve cell) that names it, created by the first one to need
    # each (tokenmill.replicas.pool; docs/pools.md).
    pool: str | None = Field(default=None, pattern=POOL_NAME_PATTERN, max_length=64)
    # Replicas that follow the load (Autoscale); unset: always ``replicas``.
    autoscale: Autoscale | None = None

    def most_replicas(self) -> int:
        """The most replicas it runs at once: ``autoscale.max_replicas``, or ``replicas``."""
        return self.replicas if self.autoscale is None else self.autoscale.max_replicas

    def ray_cpus(self) -> float:
        """The CPUs a replica's Ray actor reserves."""
        return 1.0 if self.ray_num_cpus is None else self.ray_num_cpus

    @model_validator(mode="before")
    @classmethod
    def _isolated_alias(cls, data: Any) -> Any:
        # ``isolated`` (deprecated) was placement before Ray: true = "process",
        # false = "local". Accepted as input only; the model has no such attribute.
        if not isinstance(data, dict) or "isolated" not in data:
            return data
        data = dict(data)
        isolated = data.pop("isolated")
        if not isinstance(isolated, bool):
            raise ValueError(
                f"'isolated' (deprecated: use placement) must be true or false, not {isolated!r}"
            )
        placement = "process" if isolated else "local"
        given = data.setdefault("placement", placement)
        if given != placement:
            raise ValueError(
                f"'isolated = {str(isolated).lower()}' (deprecated) means "
                f"placement = {placement!r}, which contradicts placement = {given!r}: "
                "drop 'isolated'"
            )
        return data

    @field_validator("pool")
    @classmethod
    def _pool_on_ray(cls, v: str | None, info: ValidationInfo) -> str | None:
        # A field validator, so the message names the key; placement and idle_unload_s
        # come before it, so they are known here (unless they were bad).
        if v is None:
            return v
        placement = info.data.get("placement")
        if placement is not None and placement != "ray":
            raise ValueError(
                f"'pool' needs placement = \"ray\" (this deployment's placement is "
                f"{placement!r}): a pool's replicas are Ray actors that gateways share"
            )
        if info.data.get("idle_unload_s") is not None:
            raise ValueError(
                "a pool's replicas are not unloaded when idle (other gateways may be "
                "using them): drop idle_unload_s, or stop the pool with 'tokenmill pool stop'"
            )
        return v

    @field_validator("autoscale")
    @classmethod
    def _autoscale_alone(cls, v: Autoscale | None, info: ValidationInfo) -> Autoscale | None:
        if v is None:
            return v
        placement = info.data.get("placement")
        if placement == "local":
            raise ValueError(
                'autoscale needs replicas of their own (placement = "process" or '
                '"ray"): a local replica is the gateway\'s own process'
            )
        if info.data.get("pool") is not None and v.min_replicas < 1:
            raise ValueError(
                "a pool's replicas are shared by gateways and never all stopped: "
                "min_replicas must be at least 1 with a pool"
            )
        if info.data.get("idle_unload_s") is not None:
            raise ValueError(
                "autoscale replaces idle_unload_s: min_replicas = 0 unloads the last "
                "replica after downscale_delay_s without requests; drop idle_unload_s"
            )
        replicas = info.data.get("replicas")
        if replicas is not None and not v.min_replicas <= replicas <= v.max_replicas:
            raise ValueError(
                f"replicas = {replicas} (the count autoscale starts with) is outside "
                f"min_replicas..max_replicas ({v.min_replicas}..{v.max_replicas})"
            )
        return v

    @field_validator("ray_num_cpus", "ray_resources")
    @classmethod
    def _ray_only(cls, v: Any, info: ValidationInfo) -> Any:
        # Fields are validated in order, so placement is known here (unless it was bad).
        # Empty values pass: a section dumped to JSON carries them whatever its placement.
        placement = info.data.get("placement")
        if v and placement is not None and placement != "ray":
            raise ValueError(
                f"'{info.field_name}' is only for placement = \"ray\" "
                f"(this deployment's placement is {placement!r})"
            )
        if info.field_name == "ray_resources":
            for name in ("CPU", "GPU", "memory"):
                if name in v:
                    raise ValueError(
                        f"{name!r} is not a custom resource"
                        + (": use ray_num_cpus" if name == "CPU" else "")
                    )
        return v


class LlamaCppDeployment(ReplicatedDeployment):
    """A GGUF model served by llama.cpp (tokenmill.engines.llamacpp)."""

    ENGINE_TARGET: ClassVar[str] = "tokenmill.engines.llamacpp:LlamaCppEngine"

    engine: Literal["llamacpp"] = "llamacpp"
    # Absent: the embedded SmolLM2.
    model: Path | None = None
    # Which weights a replica serves: "as-is", the file as given, or a llama.cpp type
    # ("q8_0", "q4_0", "q4_k_m", "f16") it is converted to once and cached in
    # weights_dir. Unset: "q8_0" for the embedded SmolLM2 (its Q4_1 has no fast CPU
    # kernel for a batch of rows: docs/configuration.md), "as-is" for a model file.
    weights: WeightsSetting | None = None
    # Where converted weights are kept. Unset: <data_dir>/weights of the gateway.
    weights_dir: Path | None = None
    n_threads: int | None = Field(default=None, ge=1)
    # Fewer llama.cpp threads for a step when that is measured to be faster: where other
    # busy processes share the cores, threads that wait for each other at every barrier
    # lose to one (see tokenmill.engines.llamacpp.threads). false: always n_threads.
    adapt_threads: bool = True
    # How the slots hold their KV cells (docs/operations.md#kv-memory). "shared": one
    # pool of kv_pool_tokens cells that every slot draws on, as llama-server's
    # --kv-unified, vLLM and SGLang do: a sequence may take up to n_ctx of them, so a
    # long prompt fits beside many short ones; an answer has the distribution of the
    # same request alone, but a greedy one may part from it where the model is nearly
    # undecided (where its cells sit changes the last bits of attention).
    # "per_slot": a KV stream of n_ctx cells for each slot; a greedy answer is the
    # same alone or batched, bit for bit, but no sequence holds more than its slot's.
    kv_layout: Literal["shared", "per_slot"] = "shared"
    # Tokens one sequence may hold (prompt and completion); 0: the model's trained
    # context (8,192 for the embedded SmolLM2), at most 32,768, in the shared layout,
    # and 2,048 (at most the trained context) a slot in the per-slot one.
    n_ctx: int = Field(default=0, ge=0)
    # KV cells of a replica's shared pool, all its slots together (docs/operations.md).
    # Unset: 2,048 a slot, or n_ctx if more (16 x 2,048 = 32,768 cells by default,
    # 720 MiB for SmolLM2-135M). The per-slot layout has n_ctx cells a slot instead.
    kv_pool_tokens: int | None = Field(default=None, ge=64)
    # Host memory for sequences parked from reassigned slots, in bytes. Unset: a
    # quarter of the memory available at start, at most 8 GiB; 0: no host tier.
    kv_host_bytes: int | None = Field(default=None, ge=0)
    # Where what the host tier parks is also written, so that a restarted replica (a
    # crash, a new version) finds its cached prefixes (docs/operations.md#kv-memory).
    # Unset: <data_dir>/kv/<id> (Settings.with_data_dir); "": none. Replica i: replica-<i>.
    kv_disk_dir: Path | Literal[""] | None = None
    # The disk tier's bound in bytes. Unset: 10 % of the free space there, at most 4 GiB.
    kv_disk_bytes: int | None = Field(default=None, ge=1)
    # RoPE context extension, as llama-server's --rope-scaling/--rope-scale/
    # --yarn-orig-ctx: serve an n_ctx past the model's training context (SmolLM2's 8k
    # at 32k: "yarn", rope_scale 4, yarn_orig_ctx 8192). Quality past the trained
    # window is the model's, not guaranteed (docs/agent-apis.md).
    rope_scaling: Literal["none", "linear", "yarn"] | None = None
    # Speculative decoding without a draft model: "ngram" drafts each sequence's next
    # tokens from its own prompt and output (prompt lookup) and verifies them in the
    # step, while measured step costs say it pays; each token is sampled from the
    # logits after exactly the tokens before it, so greedy answers are the plain ones
    # where llama.cpp computes a row alike beside its draft
    # (docs/operations.md#speculative-decoding). "off": a token a step.
    speculative: Literal["ngram", "off"] = "off"
    # When a found draft is verified: "measured", while the measured step costs say it
    # writes more tokens a second (tokenmill.engines.speculative.best_cap); "always",
    # every draft found, whole, as llama-server's --spec-type ngram-* does (for tests
    # and hardware where a row costs next to nothing).
    speculative_rule: Literal["measured", "always"] = "measured"
    rope_scale: float | None = Field(default=None, ge=1.0, allow_inf_nan=False)
    yarn_orig_ctx: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _disk_keys_together(self) -> LlamaCppDeployment:
        if self.kv_disk_bytes is not None and self.kv_disk_dir == "":
            raise ValueError('kv_disk_bytes bounds a disk tier that kv_disk_dir = "" turns off')
        if self.kv_host_bytes == 0 and (self.kv_disk_dir or self.kv_disk_bytes is not None):
            raise ValueError("the disk tier needs the host-memory tier: kv_host_bytes must be > 0")
        return self

    @model_validator(mode="after")
    def _pool_keys_in_layout(self) -> LlamaCppDeployment:
        if self.kv_layout == "per_slot" and self.kv_pool_tokens is not None:
            raise ValueError(
                "kv_pool_tokens sizes the shared pool; with kv_layout = 'per_slot' every "
                "slot has n_ctx cells of its own: set n_ctx instead"
            )
        return self

    @model_validator(mode="after")
    def _rope_keys_together(self) -> LlamaCppDeployment:
        if self.rope_scaling in (None, "none") and self.rope_scale is not None:
            raise ValueError("rope_scale needs rope_scaling = 'linear' or 'yarn'")
        if self.rope_scaling != "yarn" and self.yarn_orig_ctx is not None:
            raise ValueError("yarn_orig_ctx needs rope_scaling = 'yarn'")
        return self

    def ray_cpus(self) -> float:
        if self.ray_num_cpus is not None:
            return self.ray_num_cpus
        return float(self.n_threads or 1)

    def for_replica(self, index: int) -> Self:
        if not self.kv_disk_dir:
            return self
        return self.model_copy(update={"kv_disk_dir": self.kv_disk_dir / f"replica-{index}"})

    @field_validator("n_ctx")
    @classmethod
    def _n_ctx_or_model(cls, v: int) -> int:
        if 0 < v < 64:
            raise ValueError("n_ctx must be at least 64 (or 0: the model's trained context)")
        return v

    @field_validator("kv_pool_tokens")
    @classmethod
    def _pool_holds_a_context(cls, v: int | None, info: ValidationInfo) -> int | None:
        n_ctx = info.data.get("n_ctx")
        if v is not None and n_ctx and v < n_ctx:
            raise ValueError(
                f"kv_pool_tokens = {v} is less than n_ctx = {n_ctx}: one sequence could "
                "never use its whole context. Raise kv_pool_tokens or lower n_ctx"
            )
        return v

    @field_validator("model")
    @classmethod
    def _model_exists(cls, v: Path | None) -> Path | None:
        # A field validator, so the message names the key: deployments.N.model.
        if v is not None and not v.is_file():
            raise ValueError(f"model file not found: {v}")
        return v


class UpstreamDeployment(DeploymentCommon):
    """Any OpenAI-compatible endpoint (tokenmill.engines.upstream)."""

    ENGINE_TARGET: ClassVar[str] = "tokenmill.engines.upstream:UpstreamEngine"
    MISSING_HINTS: ClassVar[dict[str, str]] = {"url": "an upstream deployment needs 'url'"}

    engine: Literal["upstream"] = "upstream"
    url: str
    upstream_model: str | None = None
    api_key: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    timeout_s: float = Field(default=600.0, gt=0)
    # A GGUF file whose tokenizer and chat template match the upstream model ("embedded":
    # the embedded SmolLM2's), read without its weights. Prompts are then counted exactly
    # for admission and the credit hold, and completions when the upstream reports no
    # usage; without it both are estimated from the text (about 4 characters a token).
    tokenizer: str | None = None

    @field_validator("url")
    @classmethod
    def _openai_base(cls, v: str) -> str:
        if not v.rstrip("/").endswith("/v1"):
            raise ValueError("'url' must be an OpenAI-compatible base URL ending in /v1")
        return v

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_exists(cls, v: str | None) -> str | None:
        if v is not None and v != "embedded" and not Path(v).is_file():
            raise ValueError(f'tokenizer file not found: {v} (a GGUF file, or "embedded")')
        return v


class ScriptedDeployment(ReplicatedDeployment):
    """Tests only (tokenmill.engines.scripted): an engine a test drives step by step."""

    ENGINE_TARGET: ClassVar[str] = "tokenmill.engines.scripted:ScriptedEngine"
    MISSING_HINTS: ClassVar[dict[str, str]] = {
        "control": "a scripted (test) deployment needs 'control', its driver's socket"
    }

    engine: Literal["scripted"] = "scripted"
    # The driver's Unix socket.
    control: Path


# Every engine's section; a deployment's ``engine`` key picks one.
ENGINE_SECTIONS: tuple[type[DeploymentCommon], ...] = (
    LlamaCppDeployment,
    UpstreamDeployment,
    ScriptedDeployment,
)
EngineSection: TypeAlias = LlamaCppDeployment | UpstreamDeployment | ScriptedDeployment
SECTION_BY_ENGINE = {c.engine_name(): c for c in ENGINE_SECTIONS}


def _engine_tag(v: Any) -> str:
    if isinstance(v, dict):
        # No ``engine`` key: llama.cpp, the default since the first release.
        engine = v.get("engine", "llamacpp")
        return engine if isinstance(engine, str) else repr(engine)
    # A section already built, or not a table at all (llamacpp's section then says so).
    engine = getattr(v, "engine", "llamacpp")
    return engine if isinstance(engine, str) else "llamacpp"


DeploymentConfig: TypeAlias = Annotated[
    Annotated[LlamaCppDeployment, Tag("llamacpp")]
    | Annotated[UpstreamDeployment, Tag("upstream")]
    | Annotated[ScriptedDeployment, Tag("scripted")],
    Discriminator(_engine_tag),
]
_DEPLOYMENT_ADAPTER: TypeAdapter[EngineSection] = TypeAdapter(DeploymentConfig)


def parse_section(data: Any) -> EngineSection:
    """One deployment's section from a dict, such as the ``model_dump(mode="json")`` a
    replica process or Ray actor receives; raises pydantic's ValidationError."""
    return _DEPLOYMENT_ADAPTER.validate_python(data)


def _accepted_keys(section: type[DeploymentCommon]) -> set[str]:
    keys = set(section.model_fields)
    if "placement" in keys:
        keys.add("isolated")
    return keys


def foreign_key_message(key: str, section: type[DeploymentCommon]) -> str | None:
    owners = [c.engine_name() for c in ENGINE_SECTIONS if key in _accepted_keys(c)]
    if not owners:
        return None
    engine = section.engine_name()
    if key == "control":
        return "'control' is only for scripted (test) deployments"
    if key == "tokenizer" and engine == "llamacpp":
        return "'tokenizer' is for upstream deployments (llamacpp uses its model's)"
    return f"'{key}' is for {' and '.join(owners)} deployments, not {engine}"
