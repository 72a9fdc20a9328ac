"""What the llama.cpp engine has done since it was made, for health and tests.

One object for the engine's whole life: it outlives the model and its decode loop,
which are made anew by every ``start()`` after a ``close()``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Counters"]


@dataclass(slots=True)
class Counters:
    tokens_generated: int = 0  # completion tokens sampled, every request together
    steps: int = 0  # llama_decode calls of the step loop
    # KV streams copied: slot to slot (parking, prefixes, n), to and from host memory
    kv_copies: int = 0
    warmups: int = 0  # next turns computed ahead (see KvSlots.warm)
    pool_evictions: int = 0  # free slots' cached cells given up for room in the pool
    span_trims: int = 0  # free slots cut to what they share before a long prefill
    preemptions: int = 0  # running choices swapped out of a full pool
    resumes: int = 0  # swapped-out choices back in the pool
    kv_exports: int = 0  # sequences' states handed to another replica
    kv_imports: int = 0  # sequences' states taken from another replica
    spec_drafted: int = 0  # draft tokens verified (speculative = "ngram")
    spec_accepted: int = 0  # ... of which kept: tokens written without a step of their own
