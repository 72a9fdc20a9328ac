"""Inference backends, chosen by name and imported only when used.

Importing this package never imports llama.cpp (or torch, or ray): a backend's
module is loaded by :func:`create_engine` on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tokenmill.engines.base import (
    CachePublishing,
    ChatMessage,
    Chunk,
    Constraint,
    Engine,
    EngineHealth,
    GenerationRequest,
    KvMoving,
    KvState,
    PromptInfo,
    PromptItem,
    SamplingParams,
    SteppedEngine,
    StepSink,
    TokenizeRequest,
    TokenizerInfo,
    TokenizingEngine,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    TopLogprob,
    Usage,
)
from tokenmill.engines.chunks import ChunkStream
from tokenmill.engines.embeddings import (
    EmbeddingEngine,
    EmbeddingInfo,
    EmbeddingInput,
    EmbeddingRequest,
    Embeddings,
    cannot_embed,
)
from tokenmill.engines.json_numbers import bound_numbers

if TYPE_CHECKING:
    from tokenmill.config import DeploymentConfig
    from tokenmill.engines.llamacpp import LlamaCppEngine
    from tokenmill.engines.scripted import ScriptedEngine
    from tokenmill.engines.upstream import UpstreamEngine

    # mypy checks here that every engine implements the interface.
    _ENGINES: tuple[type[Engine], ...] = (LlamaCppEngine, ScriptedEngine, UpstreamEngine)


def create_engine(section: DeploymentConfig) -> Engine:
    """The engine a deployment's config section names, built by its ``from_config``.

    Its module is imported here, on first use: never by ``import tokenmill``.
    """
    module_name, _, attr = section.engine_target().partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    engine = cls.from_config(section)
    if not isinstance(engine, Engine):
        raise TypeError(f"{section.engine_target()} does not implement the Engine interface")
    return engine


__all__ = [
    "CachePublishing",
    "ChatMessage",
    "Chunk",
    "ChunkStream",
    "Constraint",
    "EmbeddingEngine",
    "EmbeddingInfo",
    "EmbeddingInput",
    "EmbeddingRequest",
    "Embeddings",
    "Engine",
    "EngineHealth",
    "GenerationRequest",
    "KvMoving",
    "KvState",
    "PromptInfo",
    "PromptItem",
    "SamplingParams",
    "StepSink",
    "SteppedEngine",
    "TokenLogprob",
    "TokenizeRequest",
    "TokenizerInfo",
    "TokenizingEngine",
    "ToolCall",
    "ToolCallDelta",
    "ToolSpec",
    "TopLogprob",
    "Usage",
    "bound_numbers",
    "cannot_embed",
    "create_engine",
]
