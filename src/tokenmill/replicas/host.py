"""Replica hosts: where a replica's engine runs, behind one interface the gateway drives.

A deployment's replica is a :class:`ReplicaHost`. The gateway admits, holds credit,
routes, streams, cancels and settles the same way whichever host it is:

* :class:`~tokenmill.replicas.local.LocalHost`: the engine in the gateway's own
  process (``placement = "local"``: embedding tokenmill, the benchmark's ceiling);
* :class:`~tokenmill.replicas.supervisor.SupervisedHost` over a child process
  (``placement = "process"``, the default: a crash in native code takes down one
  replica, not the gateway) or over a Ray actor (``placement = "ray"``: a replica on
  any node of a Ray cluster). The supervised host restarts a replica that died or
  hangs; what carries its frames is the only difference between the two.

A host has one state, and it alone says whether the replica serves: ``ready``
serves; ``unloaded`` and ``loading`` count toward the deployment's capacity (an
idle replica loads on its first request); ``restarting`` (died, coming back) and
``unhealthy`` (failed, not coming back by itself) do not, so while no replica is
ready requests wait in the deployment's queue.

Requests keep the engine contract (:mod:`tokenmill.engines.base`): ``generate``
returns a :class:`~tokenmill.engines.chunks.ChunkStream` ending in exactly one final
item, ``cancel`` is fire-and-forget and ends the stream with the tokens produced.
Embeddings keep :mod:`tokenmill.engines.embeddings`' (``prepare_embeddings``, then
``embed``); a host whose engine cannot embed refuses with a 400 naming ``model``.

This module is the interface only; it imports no host, and nothing of the gateway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from tokenmill.engines import (
    ChunkStream,
    EmbeddingInfo,
    EmbeddingRequest,
    Embeddings,
    EngineHealth,
    GenerationRequest,
    KvState,
    PromptInfo,
    TokenizeRequest,
    TokenizerInfo,
)
from tokenmill.kvblocks import CacheEvent

ReplicaState = Literal["unloaded", "loading", "ready", "restarting", "unhealthy"]
# States that count toward a deployment's capacity (see the module docstring).
ADMITTING: frozenset[ReplicaState] = frozenset({"unloaded", "loading", "ready"})


@dataclass(frozen=True, slots=True)
class ReplicaLocation:
    """Where a replica runs now: its process, and its Ray node and actor when on Ray."""

    pid: int | None = None
    node_id: str | None = None
    node_address: str | None = None
    actor_id: str | None = None


@dataclass(frozen=True, slots=True)
class KvParcel:
    """A sequence's KV state held where a :class:`KvLink` put it, not in the gateway:
    its tokens, the state's size and fingerprint (as :class:`~tokenmill.engines.KvState`),
    and ``handle``, what the link that exported it finds the bytes by (a Ray object
    reference), meaningful only to a link of the same ``kind``."""

    tokens: tuple[int, ...]
    nbytes: int
    fingerprint: str
    kind: str
    handle: object


@runtime_checkable
class KvLink(Protocol):
    """A way for KV state to go from one replica to another without passing through
    the gateway (:mod:`tokenmill.gateway.moves`): Ray replicas' object store. Two
    replicas whose links are of one ``kind`` move state that way; any other pair
    through the gateway's connections (``export_kv``, then ``import_kv``)."""

    kind: str

    async def export_kv(self, tokens: Sequence[int], min_tokens: int) -> KvParcel | None:
        """As :meth:`ReplicaHost.export_kv`, the state left where the link keeps it."""
        ...

    async def import_kv(self, parcel: KvParcel) -> bool:
        """As :meth:`ReplicaHost.import_kv`, for a parcel of this link's ``kind``."""
        ...


@runtime_checkable
class ReplicaHost(Protocol):
    """One replica of a deployment, wherever it runs. See the module docstring."""

    kind: str  # "local", "process" or "ray"

    @property
    def state(self) -> ReplicaState: ...

    @property
    def restarts(self) -> int:
        """Times the replica was restarted after dying or hanging."""
        ...

    def location(self) -> ReplicaLocation: ...

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the event loop) whenever ``state`` changes."""

    def on_cache(self, callback: Callable[[CacheEvent], None]) -> None:
        """Call ``callback`` (on the event loop) with what the replica's KV cache holds
        (:mod:`tokenmill.kvblocks`): a snapshot whenever it (re)starts, then each
        change. Never called for a replica whose engine publishes no cache."""

    def on_status(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the event loop) whenever the replica reports its status
        (what :meth:`health` returns): a shared replica's slots may have come free, so a
        request waiting for one tries again. A replica whose slots only this gateway
        counts never needs to report, and may never call it."""

    async def start(self) -> None:
        """Load the replica; raise (and be ``unhealthy``) if it cannot. Idempotent."""

    async def close(self) -> None:
        """Stop the replica; open streams end with an error. State ``unloaded``."""

    async def reserve(self, request_id: str, weight: int) -> None:
        """Claim ``weight`` slots for a request about to run here. Only a replica shared
        with other gateways (a pool's) keeps its own count and may refuse, with
        :class:`~tokenmill.errors.ReplicaFullError`; ``cancel`` gives back a claim that
        no ``generate`` followed."""

    async def prepare(self, request: GenerationRequest) -> PromptInfo: ...

    def generate(self, request: GenerationRequest) -> ChunkStream: ...

    def cancel(self, request_id: str) -> None: ...

    async def tokenize(self, request: TokenizeRequest) -> list[int]: ...

    async def detokenize(self, tokens: Sequence[int]) -> str: ...

    def context_length(self) -> int: ...

    async def tokenizer_info(self) -> TokenizerInfo:
        """The engine's tokenizer: special tokens, chat template, context length."""
        ...

    async def prepare_embeddings(self, request: EmbeddingRequest) -> EmbeddingInfo:
        """Tokenize and check the inputs: their token count, billed as prompt tokens."""
        ...

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        """One unit-length vector per input (after ``prepare_embeddings``)."""
        ...

    async def export_kv(self, tokens: Sequence[int], min_tokens: int) -> KvState | None:
        """The replica's KV state of the longest prefix of ``tokens`` it holds, at least
        ``min_tokens`` of it (see :class:`~tokenmill.engines.KvMoving`); None when it
        holds none or its engine cannot move state."""
        ...

    async def import_kv(self, state: KvState) -> bool:
        """Keep ``state`` as a cached sequence; False when not taken."""
        ...

    async def held_kv(self, min_tokens: int) -> list[tuple[int, ...]]:
        """The sequences its KV cache holds (slots and host memory), at least
        ``min_tokens`` each, most recently used first; none where its engine cannot
        move state (:class:`~tokenmill.engines.KvMoving`)."""
        ...

    def kv_link(self) -> KvLink | None:
        """Its path for KV state that skips the gateway, if it has one (a Ray
        replica's object store); None: moves go through the gateway."""
        ...

    def health(self) -> EngineHealth: ...


__all__ = ["ADMITTING", "KvLink", "KvParcel", "ReplicaHost", "ReplicaLocation", "ReplicaState"]
