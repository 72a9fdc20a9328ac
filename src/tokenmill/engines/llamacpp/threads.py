"""How many threads a decode step uses: the cores we really have, tuned by measurement.

llama.cpp splits every operation of a step across its threads and joins them at a
barrier after each one, a few hundred times a step. On a quiet machine that is what
makes a step fast. On a machine whose cores are shared with other busy processes it
is what makes it slow: a thread that the kernel preempts holds all its partners at
the next barrier, spinning. Measured here (SmolLM2-135M, 2 cores, two ``yes`` loops
beside it): 2 threads give 15.8 tok/s for one stream at 61 ms of CPU a token, one
thread gives 37.4 tok/s at 16.6 ms; quiet, 2 threads give 119 tok/s and one 71.

So the thread count is not a constant. :class:`ThreadTuner` picks it per step from
how long recent steps of the same size took: it keeps using the count that was
fastest, and now and then (rarely while nothing changes, at once when step times
move) tries a neighbouring count for a couple of steps: of a size whose steps are
short (decode steps). A prompt chunk's size takes the count chosen there, and never
tries fewer; where that count is below every thread it tries one more now and then
(the contention that chose it may have ended during a long prompt).
It is pure policy: the engine tells it what each step cost and asks what to use
next; it never touches llama.cpp, and it is tested with made-up timings.

:func:`available_cpus` is the ceiling: the CPUs this process may run on (its
affinity mask) and, under a cgroup CPU quota (a container's ``--cpus``), no more
than the quota.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("tokenmill.engines.llamacpp")

# Weight of the newest step in a size's running average: a handful of steps decide.
EWMA_ALPHA = 0.25
# Steps of one size, at the count in use, before its average is trusted for a probe.
MIN_SAMPLES = 4
# A probe runs this many steps at the other count and averages them; one step at
# least twice as slow as the count in use ends it at once (no need to confirm).
PROBE_STEPS = 2
CLEARLY_WORSE = 2.0
# The other count must be this much faster to be taken: noise never flips a choice.
SWITCH_MARGIN = 0.9
# Between probes while nothing changes: doubling from the first to the last. A quiet
# machine at one stream pays ~12 ms once per 16 s for probing one thread (< 0.1 %).
PROBE_INTERVAL_MIN_S = 0.5
PROBE_INTERVAL_MAX_S = 16.0
# No probe with fewer threads on a step size whose steps take longer than this: a
# prompt chunk of 512 tokens takes ~1 s here, and such a probe costs a whole slow step
# (measured: a second ~1,900-token prompt on a fresh replica read in 7.2 s against
# 4.1 s for the first, 4.9 s with the count fixed). Such steps take the count the
# short steps chose: the contention a probe looks for slows every size alike.
PROBE_MAX_STEP_S = 0.1
# But a count the short steps chose may be stale: fewer threads chosen under
# contention that ended while a long prompt is read (no short step comes to notice),
# and then minutes of prompt run at half speed (measured, issue 49: a restarted
# server read Claude Code's 2,400 new tokens in 135 s against 73 s). So slow steps
# at fewer than every thread try one more, at most once in this many of their steps:
# under contention that lasts, a failed try costs one slow step in this many.
SLOW_PROBE_GAP_STEPS = 8
# Step times that moved by this factor since the last probe mean the machine changed
# (other work started or stopped): probe again soon.
CHANGE_FACTOR = 1.5


def available_cpus() -> int:
    """CPUs this process can use: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _cgroup_cpu_quota(
    root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> float | None:
    """Cores' worth of CPU time this process's cgroup v2 quota allows (None: no quota)."""
    try:
        rel = ""
        for line in membership.read_text().splitlines():
            if line.startswith("0::"):
                rel = line[3:].lstrip("/")
        text = (root / rel / "cpu.max").read_text().split()
    except (OSError, IndexError):
        return None
    if len(text) != 2 or text[0] == "max":
        return None
    try:
        return int(text[0]) / int(text[1])
    except (ValueError, ZeroDivisionError):
        return None


def thread_counts(max_threads: int) -> list[int]:
    """The counts worth trying, most first: max, then halving down to 1."""
    counts = [max(1, max_threads)]
    while counts[-1] > 1:
        counts.append(counts[-1] // 2)
    return counts


@dataclass(slots=True)
class _Probe:
    threads: int
    n_tokens: int
    samples: list[float] = field(default_factory=list)


class ThreadTuner:
    """Chooses each step's thread count from measured step times (see module doc).

    The engine calls :meth:`threads_for` before a step with the step's batch size,
    runs it with that many threads, then reports the time with :meth:`observe`.
    Steps are compared only with steps of the same batch size: their cost differs.
    """

    def __init__(
        self,
        max_threads: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.counts = thread_counts(max_threads)
        self.current = self.counts[0]
        self._clock = clock
        self._avg: dict[tuple[int, int], float] = {}
        self._samples: dict[tuple[int, int], int] = {}
        self._probe: _Probe | None = None
        self._interval = PROBE_INTERVAL_MIN_S
        self._next_probe = clock() + PROBE_INTERVAL_MIN_S
        self._last_probe = -math.inf
        # Each size's average right after the last probe, to notice a change.
        self._baseline: dict[int, float] = {}
        self._toward_fewer = True  # which neighbour the next probe tries
        self.switches = 0

    def threads_for(self, n_tokens: int) -> int:
        """How many threads the next step, of ``n_tokens`` tokens, should use."""
        probe = self._probe
        if probe is not None:
            if probe.n_tokens == n_tokens:
                return probe.threads
            self._probe = None  # the batch changed size: the probe would compare nothing
        if len(self.counts) < 2 or self._clock() < self._next_probe:
            return self.current
        key = (self.current, n_tokens)
        if self._avg.get(key, 0.0) > PROBE_MAX_STEP_S:
            # Slow steps: never fewer threads (a whole slow step lost); one more where
            # the short steps chose fewer, in case their contention has gone.
            i = self.counts.index(self.current)
            if i == 0:
                return self.current
            other = self.counts[i - 1]
        elif self._samples.get(key, 0) < MIN_SAMPLES:
            return self.current
        else:
            other = self._neighbour()
        self._probe = _Probe(other, n_tokens)
        return other

    def observe(self, threads: int, n_tokens: int, seconds: float) -> None:
        """A step of ``n_tokens`` tokens ran with ``threads`` threads in ``seconds``."""
        probe = self._probe
        if probe is not None and threads == probe.threads and n_tokens == probe.n_tokens:
            probe.samples.append(seconds)
            current = self._avg.get((self.current, n_tokens), math.inf)
            slow = current > PROBE_MAX_STEP_S  # one slow step decides
            if len(probe.samples) >= PROBE_STEPS or slow or seconds > current * CLEARLY_WORSE:
                self._conclude(probe)
            return
        if threads != self.current:
            return
        key = (threads, n_tokens)
        old = self._avg.get(key)
        avg = seconds if old is None else old + EWMA_ALPHA * (seconds - old)
        self._avg[key] = avg
        self._samples[key] = self._samples.get(key, 0) + 1
        base = self._baseline.get(n_tokens)
        if base is not None and not base / CHANGE_FACTOR < avg < base * CHANGE_FACTOR:
            # The machine changed under us: look again soon, not in up to 8 s.
            self._interval = PROBE_INTERVAL_MIN_S
            self._next_probe = min(self._next_probe, self._last_probe + PROBE_INTERVAL_MIN_S)
            self._baseline[n_tokens] = avg

    def _neighbour(self) -> int:
        i = self.counts.index(self.current)
        fewer = self.counts[i + 1] if i + 1 < len(self.counts) else None
        more = self.counts[i - 1] if i > 0 else None
        self._toward_fewer = not self._toward_fewer
        if fewer is None or (more is not None and not self._toward_fewer):
            assert more is not None
            return more
        return fewer

    def _conclude(self, probe: _Probe) -> None:
        self._probe = None
        now = self._clock()
        self._last_probe = now
        probe_avg = sum(probe.samples) / len(probe.samples)
        key = (self.current, probe.n_tokens)
        current_avg = self._avg.get(key, math.inf)
        if probe_avg < current_avg * SWITCH_MARGIN:
            log.info(
                "decode threads %d -> %d: steps of %d tokens took %.1f ms against %.1f ms",
                self.current,
                probe.threads,
                probe.n_tokens,
                probe_avg * 1000,
                current_avg * 1000,
            )
            self.current = probe.threads
            self.switches += 1
            # Other sizes' figures were taken with the old count: start them afresh.
            key = (probe.threads, probe.n_tokens)
            self._avg = {key: probe_avg}
            self._samples = {key: MIN_SAMPLES}
            self._baseline = {probe.n_tokens: probe_avg}
            self._interval = PROBE_INTERVAL_MIN_S
        else:
            self._interval = min(self._interval * 2, PROBE_INTERVAL_MAX_S)
            self._baseline[probe.n_tokens] = current_avg
            if current_avg > PROBE_MAX_STEP_S:  # a slow size's try, not taken
                self._next_probe = now + max(self._interval, SLOW_PROBE_GAP_STEPS * current_avg)
                return
        self._next_probe = now + self._interval


def extra_buffers_work() -> bool:
    """Whether llama.cpp's extra weight buffer types are safe to use on this CPU.

    A native build (``GGML_NATIVE``, as pip compiles llama-cpp-python) on a CPU with
    AMX puts the weights in AMX buffers, and with llama-cpp-python 0.3.36
    ``llama_decode`` then crashes (SIGSEGV) on any batch of more than a few tokens:
    seen on a Xeon with ``amx_int8`` (2026-12-03) for SmolLM2's Q4_1, in tokenmill and
    in llama-cpp-python's own ``Llama`` alike. They are off there (llama-server's
    ``--no-repack`` does the same); kept elsewhere, where weight repacking speeds up
    Q4_0 prompts on AVX2 and AVX-512.
    """
    return not cpu_has_amx()


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_int8" in line.split()
    except OSError:
        pass
    return False
