"""Which decoding choices of a step draft, and how many tokens: speculative decoding's
plan for one step of the llama.cpp loop.

The rules are :mod:`tokenmill.engines.speculative`'s (pure): each choice that may
draft looks up a draft as long as, alone, writes the most tokens a second at its
acceptance by the measured ubatch costs (none: it rests), and every draft is then cut
to the length that writes the most for the whole step. Plain Python over the running
choices: no llama.cpp. The loop verifies what is planned here in its step.
"""

from __future__ import annotations

from collections.abc import Collection

from tokenmill.engines.llamacpp.batch import BatchPlan
from tokenmill.engines.llamacpp.choices import Choice
from tokenmill.engines.speculative import MAX_DRAFT, StepCosts, best_cap

__all__ = ["plan_drafts", "step_rows"]


def plan_drafts(
    running: Collection[Choice], costs: StepCosts, *, n_ctx: int, always: bool = False
) -> None:
    """Set each decoding choice's draft for this step (``choice.draft``), within its
    ``max_tokens`` and ``n_ctx``; ``always``: every draft found, whole, whatever the
    costs (``speculative_rule = "always"``). None while a prompt is to be read: its
    first token does not wait for drafts."""
    if any(not s.prefilled and s.leader is None for s in running):
        return
    drafting: list[Choice] = []
    plain: list[int] = []
    for seq in running:
        if not seq.prefilled or seq.done:
            continue
        spec = seq.spec
        if spec is not None:
            limit = min(
                MAX_DRAFT,
                seq.sampling.max_tokens - seq.generated - 1,
                n_ctx - (len(seq.prompt) + seq.generated) - 1,
            )
            k = limit if always else spec.length.length(costs, limit)
            if k <= 0 < limit:
                spec.length.rest()  # drafting does not pay for it now
            seq.draft = spec.index.draft(k)
            if seq.draft:
                drafting.append(seq)
                continue
        plain.append(seq.slot)
    if not drafting or always:
        return
    cap = best_cap(
        [(s.slot, len(s.draft), s.spec.length) for s in drafting if s.spec is not None],
        plain,
        costs,
    )
    for seq in drafting:
        seq.draft = seq.draft[:cap]


def step_rows(plan: BatchPlan) -> list[tuple[int, int]]:
    """A step's (slot, rows) for each sequence in it, in slot order (see
    tokenmill.engines.speculative.ubatches)."""
    rows: dict[int, int] = {}
    for _, _, slot, _ in plan.rows:
        rows[slot] = rows.get(slot, 0) + 1
    return sorted(rows.items())
