"""How much prompt a decode step reads, and whose: the prefill policy of the step loop.

A step's time grows with its rows, and everything waits for the step under way: the
next token of every decoding stream, and the first step of a request that arrives
meanwhile. Reading a 370-token prompt in one step of 512 rows made another
conversation's next turn, ~20 new tokens, wait ~1 s for it (issue 47). So:

* **How much**: a step's rows are sized to a time budget by the measured cost of
  steps (:class:`RowCost`: seconds ~ fixed + per_row x rows), so a step lasts about
  that long whatever the prompts and whatever the machine: more rows where rows are
  cheap, fewer on a loaded CPU. The budget is short (:data:`STEP_BUDGET_S`) when a
  prompt would be finished by a short step (someone's first token waits on it), and
  longer (:data:`LONG_STEP_BUDGET_S`) when only long prompts are being read: shorter
  steps would read them slower (each pays the pass over the weights again) and hold
  their slots longer. Every decoding stream has its row first; prompts share what the
  budget leaves, at least :data:`MIN_CHUNK` tokens (a prompt always progresses) and
  what keeps the step's fixed cost a small share of it, at most what the batch holds.
* **Whose**: the shortest prompt left goes first, so a continuation's few new tokens
  go in the next step instead of after the whole of a long prompt that came first
  (shortest remaining first, what minimises mean time to first token); and the
  prompt waiting longest always gets a share of the rows (:data:`OLDEST_SHARE`), so a
  long prompt is never starved by a stream of short ones.

Pure: no llama.cpp, no clock (the loop passes the seconds it measured); tested with
made-up costs (tests/engines/test_prefill_schedule.py). :func:`plan_batch` carries out
the grants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "FIXED_SHARE",
    "LONG_STEP_BUDGET_S",
    "MIN_CHUNK",
    "OLDEST_SHARE",
    "STEP_BUDGET_S",
    "Pending",
    "RowCost",
    "grant_prefills",
]

# A step with prompt rows in it lasts about this long: what a decoding stream's next
# token and a newly arrived request wait for, at most, beyond their own step. At
# SmolLM2-135M's Q8_0 on 2 cores (~2 ms a prompt row) ~50 rows a step; the cost per row
# flattens well before that, so long prompts lose little to it (docs/operations.md).
STEP_BUDGET_S = 0.1
# A step that reads only long prompts (none would be finished by a short step) lasts
# about this long: here the whole 512-row chunk, as before the budget. Measured in the
# many-conversations workload (docs/benchmarks.md), 0.25 s steps read first turns
# slower, held their slots longer, and every later turn queued longer for a slot
# (later-turn TTFT p50 1.92x llama-server's, against 1.42x with this); a request that
# arrives meanwhile waits this step out, and then has a short one.
LONG_STEP_BUDGET_S = 1.0
# Prompt tokens a step reads at least, whatever the budget says: a prompt progresses
# even beside more decoding streams than the budget holds.
MIN_CHUNK = 16
# A step that reads prompt tokens has at least as many rows as keep its fixed cost (the
# pass over the weights) to this share of it, whatever the budget says: on a loaded
# machine, where every row costs more and the budget leaves few, shorter steps would
# read prompts slower still (a step of 16 rows spends a fifth of its time on the pass
# here), and the queue grows when the machine can least afford it.
FIXED_SHARE = 0.1
# Of a step's prompt rows, the prompt that has waited longest gets at least this share
# (if it has that many left), shorter ones notwithstanding.
OLDEST_SHARE = 0.25
# Steps of at most this many rows measure the fixed cost of a step (a pass over the
# weights); steps of at least LARGE_ROWS measure the cost of a row beyond it (any
# prompt chunk does: a chunk too small to measure a row would never grow).
SMALL_ROWS = 4
LARGE_ROWS = 8
# Weight of the newest step in each moving average: a few steps decide, so the sizes
# follow a machine whose load changes.
ALPHA = 0.2
# A row's cost as a share of a small step's, until a larger step is measured: high
# enough that a first chunk is short rather than long (its step then measures it).
ROW_PRIOR = 0.5


@dataclass(frozen=True, slots=True)
class Pending:
    """A prompt still being read: its choice's key and how many tokens it has left."""

    key: str
    left: int


def grant_prefills(pending: Sequence[Pending], rows: int) -> dict[str, int]:
    """Prompt tokens each of ``pending`` (in arrival order) reads this step, ``rows``
    at most in all: the oldest its share first (:data:`OLDEST_SHARE` of ``rows``, when
    others wait too), then the shortest left first (ties: arrival order). A key with
    nothing granted is absent."""
    grants: dict[str, int] = {}
    if rows <= 0 or not pending:
        return grants
    if len(pending) > 1:
        oldest = pending[0]
        share = min(oldest.left, max(1, math.ceil(rows * OLDEST_SHARE)))
        grants[oldest.key] = share
        rows -= share
    order = sorted(range(len(pending)), key=lambda i: (pending[i].left, i))
    for i in order:
        if rows <= 0:
            break
        p = pending[i]
        given = grants.get(p.key, 0)
        take = min(p.left - given, rows)
        if take > 0:
            grants[p.key] = given + take
            rows -= take
    return grants


class RowCost:
    """What a decode step costs by its rows, from the steps measured: seconds ~
    ``fixed + per_row x (rows - fixed_rows)``. ``fixed`` is the moving average of
    steps of at most :data:`SMALL_ROWS` rows (``fixed_rows`` theirs): one pass over the
    weights and the step's own overhead; ``per_row`` that of what each row beyond them
    added in steps of at least :data:`LARGE_ROWS` rows (until one is measured,
    :data:`ROW_PRIOR` of ``fixed``). Both follow the machine: a loaded CPU makes every
    step dearer, and the chunks shorter, down to what keeps the pass
    :data:`FIXED_SHARE` of a step."""

    def __init__(self) -> None:
        self.fixed: float | None = None
        self.fixed_rows = 0.0
        self.per_row: float | None = None

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0.0:
            return
        if rows <= SMALL_ROWS:
            self.fixed = _ewma(self.fixed, seconds)
            self.fixed_rows = _ewma(self.fixed_rows or None, float(rows))
        elif rows >= LARGE_ROWS:
            if self.fixed is None:  # the pass not measured: count it in every row
                per_row = seconds / rows
            else:
                beyond = max(1.0, rows - self.fixed_rows)
                per_row = max((seconds - self.fixed) / beyond, seconds / rows / 10.0)
            self.per_row = _ewma(self.per_row, per_row)

    def _model(self) -> tuple[float, float] | None:
        """(seconds of the pass alone, seconds a row), or None while nothing is measured."""
        fixed, per_row = self.fixed, self.per_row
        if per_row is None:
            if fixed is None:
                return None
            per_row = fixed * ROW_PRIOR
        if fixed is None:
            return 0.0, per_row
        return max(0.0, fixed - per_row * self.fixed_rows), per_row

    def rows_within(self, seconds: float) -> int | None:
        """The most rows a step may have to last at most ``seconds``; None while
        nothing has been measured."""
        model = self._model()
        if model is None:
            return None
        base, per_row = model
        return max(0, int((seconds - base) / per_row))

    def rows_for_share(self, share: float) -> int:
        """The fewest rows of a step whose pass over the weights is at most ``share``
        of it (0 while the pass or a row's cost is not measured)."""
        model = self._model()
        if model is None or self.fixed is None or self.per_row is None:
            return 0
        base, per_row = model
        return math.ceil(base * (1.0 - share) / (share * per_row))

    def chunk(self, decoding: int, *, capacity: int, shortest: int | None = None) -> int:
        """Prompt tokens a step may read beside ``decoding`` rows, ``shortest`` the
        fewest prompt tokens any prompt being read has left (None: as if one would be
        finished): what :data:`STEP_BUDGET_S` leaves them where that finishes a
        prompt, else what :data:`LONG_STEP_BUDGET_S` does."""
        short = self.within_budget(decoding, capacity=capacity, budget_s=STEP_BUDGET_S)
        if shortest is None or shortest <= short:
            return short
        if decoding == 0:
            # Nothing decodes and no first token waits on this step: a long step keeps
            # no one waiting, and the whole room reads long prompts fastest. Deep in a
            # prompt a small piece costs many times a row of a whole one (at 9,600
            # tokens of a 32k context, 16-row steps took 1.7-3.4 s, ~106 ms a row,
            # where 512 rows took ~10 ms each), so budget-sized pieces, shrinking as
            # the measured row cost grows with depth, read a 20k prompt ten times slower.
            return max(0, capacity)
        return self.within_budget(decoding, capacity=capacity, budget_s=LONG_STEP_BUDGET_S)

    def within_budget(self, decoding: int, *, capacity: int, budget_s: float) -> int:
        """Prompt tokens a step may read beside ``decoding`` rows to last ``budget_s``:
        at least :data:`MIN_CHUNK` and what keeps the step's fixed cost
        :data:`FIXED_SHARE` of it, at most ``capacity - decoding`` (all of it while
        nothing has been measured)."""
        room = capacity - decoding
        within = self.rows_within(budget_s)
        if within is None:
            return max(0, room)
        least = max(MIN_CHUNK, self.rows_for_share(FIXED_SHARE) - decoding)
        return max(0, min(room, max(least, within - decoding)))


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)
