"""The thread-count policy, driven with made-up step times on a made-up clock."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill.engines.llamacpp import threads as th
from tokenmill.engines.llamacpp.threads import ThreadTuner, available_cpus, thread_counts


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(
    tuner: ThreadTuner,
    clock: Clock,
    cost: Callable[[int, int], float],
    steps: int,
    n_tokens: int = 1,
) -> list[int]:
    """Run ``steps`` steps where a step with t threads takes ``cost(t, n_tokens)``."""
    used = []
    for _ in range(steps):
        t = tuner.threads_for(n_tokens)
        seconds = cost(t, n_tokens)
        clock.now += seconds
        tuner.observe(t, n_tokens, seconds)
        used.append(t)
    return used


def lost(used: list[int], cost: Callable[[int, int], float]) -> float:
    """Seconds spent beyond what the best count would have taken."""
    best = min(cost(t, 1) for t in set(used) | {1, 2})
    return sum(cost(t, 1) - best for t in used)


# Step times measured on the 2-core machine for one stream (ms): quiet, 2 threads are
# faster; with two busy loops beside it, one thread is.
def quiet(t: int, n: int) -> float:
    return {2: 0.0084, 1: 0.0141}[t]


def contended(t: int, n: int) -> float:
    return {2: 0.063, 1: 0.027}[t]


def test_counts_halve_down_to_one() -> None:
    assert thread_counts(2) == [2, 1]
    assert thread_counts(8) == [8, 4, 2, 1]
    assert thread_counts(6) == [6, 3, 1]
    assert thread_counts(1) == [1]


def test_quiet_machine_keeps_every_thread_and_rarely_probes() -> None:
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock)
    run(tuner, clock, quiet, 2_000)  # the first probes come close together
    start = clock.now
    used = run(tuner, clock, quiet, 20_000)  # then ~170 s of one stream
    assert tuner.current == 2 and tuner.switches == 0
    # Probes back off to one per PROBE_INTERVAL_MAX_S: under 0.1 % of the time is lost.
    assert lost(used, quiet) / (clock.now - start) < 0.001


def test_contention_moves_to_one_thread_and_back_when_it_ends() -> None:
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock)
    run(tuner, clock, quiet, 5_000)
    assert tuner.current == 2
    start = clock.now
    while tuner.current != 1:
        run(tuner, clock, contended, 1)
        assert clock.now - start < 2.0, "did not notice the busy cores within 2 s"
    run(tuner, clock, contended, 1_000)
    start = clock.now
    used = run(tuner, clock, contended, 4_000)
    assert lost(used, contended) / (clock.now - start) < 0.01
    start = clock.now
    while tuner.current != 2:
        run(tuner, clock, quiet, 1)
        assert clock.now - start < 2.0, "did not take the cores back within 2 s"
    assert tuner.switches == 2


def test_noise_does_not_flip_the_choice() -> None:
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock)
    jitter = [1.0, 1.3, 0.8, 1.1, 0.9, 1.25, 1.0, 0.85]
    i = 0

    def noisy(t: int, n: int) -> float:
        nonlocal i
        i += 1
        return quiet(t, n) * jitter[i % len(jitter)]

    run(tuner, clock, noisy, 20_000)
    assert tuner.current == 2 and tuner.switches == 0


def test_steps_are_compared_only_with_steps_of_their_size() -> None:
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock)

    # A 512-token prefill takes far longer than a one-token step at any thread count;
    # mixing them must not read as "one thread is faster".
    def mixed_cost(t: int, n: int) -> float:
        return quiet(t, n) * (60 if n == 512 else 1)

    for _ in range(3_000):
        n = 512 if clock.now % 1.0 < 0.05 else 1
        run(tuner, clock, mixed_cost, 1, n_tokens=n)
    assert tuner.current == 2 and tuner.switches == 0


def test_long_steps_never_try_fewer_threads_and_take_the_count_short_steps_chose() -> None:
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock)

    # Prompt chunks of ~1 s (longer than PROBE_MAX_STEP_S): a probe would cost one.
    def chunk(t: int, n: int) -> float:
        return {2: 1.0, 1: 1.9}[t]

    assert run(tuner, clock, chunk, 200, n_tokens=512) == [2] * 200
    # Contention, seen on the short steps, moves every size to one thread.
    run(tuner, clock, contended, 2_000)
    assert tuner.current == 1

    # It lasts: chunks with both threads are slower still. They keep one thread and try
    # two at most once in SLOW_PROBE_GAP_STEPS of their steps.
    def contended_chunk(t: int, n: int) -> float:
        return {2: 4.0, 1: 1.9}[t]

    used = run(tuner, clock, contended_chunk, 10 * th.SLOW_PROBE_GAP_STEPS, n_tokens=512)
    assert tuner.current == 1
    assert 1 <= used.count(2) <= 10 + 1


def test_a_long_prompt_gets_every_thread_back_once_the_contention_has_gone() -> None:
    # Issue 49: contention on the short steps (the agent CLI starting beside the
    # server) chose one thread, then a 2,400-token prompt ran at half speed, since no
    # short step came while it was read to notice the contention had ended.
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock)
    run(tuner, clock, contended, 2_000)
    assert tuner.current == 1

    def chunk(t: int, n: int) -> float:  # quiet again
        return {2: 1.0, 1: 1.9}[t]

    used = run(tuner, clock, chunk, 30, n_tokens=512)
    assert used[0] == 1 and used[-10:] == [2] * 10
    assert used.count(1) <= 1 + th.PROBE_INTERVAL_MAX_S / 1.9 + 1
    assert tuner.current == 2


def test_a_single_core_never_probes() -> None:
    clock = Clock()
    tuner = ThreadTuner(1, clock=clock)
    assert set(run(tuner, clock, quiet, 1_000)) == {1}


def test_four_cores_walk_down_one_neighbour_at_a_time() -> None:
    clock = Clock()
    tuner = ThreadTuner(4, clock=clock)

    def cost(t: int, n: int) -> float:  # three busy loops on four cores: 1 is best
        return {4: 0.09, 2: 0.05, 1: 0.03}[t]

    run(tuner, clock, cost, 3_000)
    assert tuner.current == 1
    assert tuner.switches == 2


def test_available_cpus_is_within_the_affinity_mask() -> None:
    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [("150000 100000\n", 1.5), ("max 100000\n", None), ("50000 100000\n", 0.5)],
)
def test_cgroup_quota_is_read_from_the_process_cgroup(
    tmp_path: Path, cpu_max: str, expected: float | None
) -> None:
    membership = tmp_path / "cgroup"
    membership.write_text("0::/box/inner\n")
    (tmp_path / "box" / "inner").mkdir(parents=True)
    (tmp_path / "box" / "inner" / "cpu.max").write_text(cpu_max)
    assert th._cgroup_cpu_quota(tmp_path, membership) == expected
    assert th._cgroup_cpu_quota(tmp_path / "missing", membership) is None
