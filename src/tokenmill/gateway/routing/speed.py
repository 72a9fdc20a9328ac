"""A replica's measured speeds, as moving averages of what its streams showed.

Each stream that ends says how long its prompt took to compute, for how many uncached
prompt tokens, how long each later token took and how many it generated.
:class:`Speed` keeps exponentially weighted averages of seconds per prompt token
(``prefill_s``), per generated token of one stream (``decode_s``) and of tokens a
stream generates (``generated``), which
:mod:`tokenmill.gateway.routing.cache_aware` reads. Plain arithmetic: the gateway
feeds it, tests feed it numbers.

The prompt's time is the replica's own when it sends it (its ``picked`` to
``decoded`` marks, :mod:`tokenmill.stages`: the decode steps that computed the
prompt), else the time to first token from dispatch. The latter also holds the wait
in the replica's queue and for the step under way, which has nothing to do with the
prompt's length: divided by a short uncached part (a conversation's next turn, 20
tokens) it made a replica that caches well look 30-50 times slower at prefill than
it is, and the routing policy then overvalued every cached block.
"""

from __future__ import annotations

# The weight of the newest observation: about the last ten requests count, so a
# replica that slows down (a busy node) is seen within a few requests.
ALPHA = 0.2
# A prompt of fewer uncached tokens than this says more about the fixed cost of a
# step than about prefill speed, and would make a replica that caches well look slow
# at prefill: not counted.
MIN_PREFILL_TOKENS = 32


class Speed:
    def __init__(self) -> None:
        self.prefill_s: float | None = None
        self.decode_s: float | None = None
        self.generated: float | None = None

    def observe(
        self,
        *,
        prefill_s: float | None,
        uncached_tokens: int,
        decode_s: float | None,
        generated: int,
    ) -> None:
        """One stream's figures: seconds spent computing its ``uncached_tokens`` prompt
        tokens, seconds from its first to its last of ``generated`` tokens."""
        if prefill_s is not None and uncached_tokens >= MIN_PREFILL_TOKENS:
            self.prefill_s = _mix(self.prefill_s, prefill_s / uncached_tokens)
        if decode_s is not None and generated >= 2:
            self.decode_s = _mix(self.decode_s, decode_s / (generated - 1))
        if generated >= 1:
            self.generated = _mix(self.generated, float(generated))


def _mix(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)
