"""A replica's measured speeds, as moving averages of what its streams showed.

Each stream that ends says how long its first token took after it was handed to the
replica, for how many uncached prompt tokens, and how long each later token took.
:class:`Speed` keeps exponentially weighted averages of seconds per prompt token
(``prefill_s``) and per generated token of one stream (``decode_s``), which
:mod:`tokenmill.gateway.routing.cache_aware` reads. Plain arithmetic: the gateway
feeds it, tests feed it numbers.
"""

from __future__ import annotations

# The weight of the newest observation: about the last ten requests count, so a
# replica that slows down (a busy node) is seen within a few requests.
ALPHA = 0.2
# A first token after fewer uncached prompt tokens than this says more about the
# fixed cost of a request (a decode step, the frames) than about prefill speed, and
# would make a replica that caches well look slow at prefill: not counted.
MIN_PREFILL_TOKENS = 32


class Speed:
    def __init__(self) -> None:
        self.prefill_s: float | None = None
        self.decode_s: float | None = None

    def observe(
        self,
        *,
        ttft_s: float | None,
        uncached_tokens: int,
        decode_s: float | None,
        generated: int,
    ) -> None:
        """One stream's figures: seconds to its first token for ``uncached_tokens``
        computed, and seconds from its first to its last of ``generated`` tokens."""
        if ttft_s is not None and uncached_tokens >= MIN_PREFILL_TOKENS:
            self.prefill_s = _mix(self.prefill_s, ttft_s / uncached_tokens)
        if decode_s is not None and generated >= 2:
            self.decode_s = _mix(self.decode_s, decode_s / (generated - 1))


def _mix(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)
