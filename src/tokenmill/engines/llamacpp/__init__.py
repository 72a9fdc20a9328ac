"""llama.cpp engine: one continuous-batching decode loop over llama-cpp-python's C API.

A dedicated thread owns the llama context. Each step it builds one batch holding
the next token of every decoding sequence plus a bounded chunk of pending prompt
tokens (so a long prompt never stalls running streams), calls ``llama_decode`` once,
samples every sequence with its own sampler chain, and hands the step's text deltas
to the event loop in a single ``call_soon_threadsafe``. ctypes releases the GIL
inside llama.cpp, so the event loop keeps serving while a step runs.

Each slot is a llama.cpp sequence with its own KV stream (``kv_unified=false``). A
finished or aborted request leaves its slot at once; the tokens it left in the
slot's KV cells stay there as a prefix cache, so a later prompt sharing a prefix
(a system prompt, a continued chat) only computes the rest.

The parts, one job each:

* ``engine``: :class:`LlamaCppEngine`, the ``Engine`` interface: lifecycle, intake,
  streams and the step sink, health.
* ``intake``: a request's prompts as checked tokens; a template's next-turn tokens.
* ``choices``: a request as a group of choices (``n`` per prompt), leaders and
  followers (pure).
* ``loop``: the decode thread: admission, aborts, one step after another, what a
  sampled token does (text, stop, length), finishing.
* ``admission``: requests queued and running; a request is admitted whole (pure).
* ``batch``: which tokens a step decodes, in slot order (pure).
* ``outputs``: a step's output rows: constraints, sampling, log probabilities, echo.
* ``slotcache``: what every KV slot holds, its read API and change listeners, the
  next-turn warm-up plan (pure).
* ``kvslots``: placements, copies, releases and warm-ups carried out on llama.cpp.
* ``context``: the loaded model and context: every llama.cpp call of the decode side.
* ``counters``: what the engine has done, for health and tests.

Used by those, and by nothing outside llama.cpp:

* ``vocab``: a GGUF model's tokenizer and chat template (also counts tokens for an
  upstream deployment, loaded ``vocab_only``).
* ``slots``: where a request goes among the KV slots, by their cached prefixes (pure).
* ``sampling``: a request's sampler chain; ``logits``: a step's logits as rows.
* ``grammar``: constraints (JSON schema, regex, choices) as llguidance grammars.
* ``embedder``: embeddings, run on the decode thread.
* ``threads``: how many threads a step uses, tuned by measuring; the CPU it runs on.
* ``weights``: which file a replica serves (as given, or converted once by llama.cpp's
  quantizer and cached) and the kernel path its weights take; ``gguf`` reads a model
  file's header, ``kernels`` is llama.cpp's rule for that path (both pure);
  ``perplexity`` and ``convert`` are ``tokenmill convert``.

The pure parts (``choices``, ``admission``, ``batch``, ``slotcache``, ``slots``,
``logits``, ``threads``, ``gguf``, ``kernels``) import no llama.cpp and are
unit-tested without it: this package's ``__init__`` loads
``engine`` (and so ``llama_cpp``) only when :class:`LlamaCppEngine` is asked for.
The engine is loaded lazily by name, never by ``import tokenmill``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.engines.embedded import embedded_model_path

if TYPE_CHECKING:
    from tokenmill.engines.llamacpp.engine import LlamaCppEngine

__all__ = ["LlamaCppEngine", "embedded_model_path"]


def __getattr__(name: str) -> Any:
    if name == "LlamaCppEngine":
        from tokenmill.engines.llamacpp.engine import LlamaCppEngine

        return LlamaCppEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
