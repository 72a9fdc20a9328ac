"""tokenmill: serve LLMs with token streaming over an OpenAI-compatible API, and meter
every token. Importing this package never imports llama.cpp, torch or ray."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
