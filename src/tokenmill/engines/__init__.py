"""Inference backends, chosen by name and imported only when used.

Importing this package never imports llama.cpp (or torch, or ray): a backend's
module is loaded by :func:`load_engine_class` on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from tokenmill.engines.base import (
    ChatMessage,
    Chunk,
    Engine,
    EngineHealth,
    GenerationRequest,
    PromptInfo,
    SamplingParams,
    Usage,
)

ENGINES: dict[str, str] = {
    "llamacpp": "tokenmill.engines.llamacpp:LlamaCppEngine",
    "upstream": "tokenmill.engines.upstream:UpstreamEngine",
}


def load_engine_class(name: str) -> Any:
    """Resolve an engine name (or a ``module:Class`` string) to its class."""
    target = ENGINES.get(name, name)
    module_name, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}")
    return getattr(importlib.import_module(module_name), attr)


__all__ = [
    "ENGINES",
    "ChatMessage",
    "Chunk",
    "Engine",
    "EngineHealth",
    "GenerationRequest",
    "PromptInfo",
    "SamplingParams",
    "Usage",
    "load_engine_class",
]
