"""What a scenario of ``make bench`` is, and what it is given.

A scenario is one module of ``bench/scenarios/`` with a module-level object that
satisfies :class:`Scenario`, listed once in ``scenarios.SCENARIOS``. The runner
(``bench/run.py``) gives it ``--only-NAME`` and ``--no-NAME``, lets it add its own
flags, runs it with a :class:`Bench` and prints its table; see ``bench/README.md``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from load import Plan, one_run
from servers import Server


class Scenario(Protocol):
    """One comparison ``make bench`` makes, with its own servers and its own table."""

    @property
    def name(self) -> str:
        """``--only-NAME`` / ``--no-NAME``, ``.bench-cache/NAME.json`` when run alone,
        and by convention its key in the results."""
        ...

    @property
    def about(self) -> str:
        """What it measures, for ``--help`` (a clause: "the Ray replica and ...")."""
        ...

    @property
    def default(self) -> bool:
        """Whether a plain ``make bench`` runs it (else only with ``--only-NAME``)."""
        ...

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Its own flags (their names must not clash with another scenario's)."""
        ...

    def run(self, bench: Bench) -> None:
        """Measure and write into ``bench.results``; on KeyboardInterrupt, keep what was
        measured and set ``bench.results["interrupted"]``. Stop every server it started."""
        ...

    def table(self, results: dict[str, Any]) -> str | None:
        """Its printed report from ``results`` (None: nothing to print)."""
        ...


@dataclass
class Bench:
    """What every scenario is given: the flags, a scratch directory for its servers'
    data and logs, the results so far (written as JSON at the end) and the model file."""

    args: argparse.Namespace
    tmp: Path
    results: dict[str, Any]
    gguf: Path

    @property
    def reps(self) -> int:
        return int(self.args.reps)

    @property
    def max_tokens(self) -> int:
        return int(self.args.max_tokens)

    @property
    def interrupted(self) -> bool:
        return bool(self.results.get("interrupted"))

    def plan(self, concurrency: int) -> Plan:
        return Plan.for_level(concurrency, self.args.lockstep)

    def run(
        self,
        server: Server,
        concurrency: int,
        busy: int = 0,
        top_logprobs: int | None = None,
        extra: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """One measured run (``load.one_run``) at the bench's max_tokens and the level's plan."""
        plan = self.plan(concurrency)
        return one_run(server, concurrency, self.max_tokens, plan, busy, top_logprobs, extra)
