"""What one decode step computes: the batch of the llama.cpp engine's step loop.

Every decoding choice gets its next token; the prompt budget left goes to prefilling
choices as :func:`~.prefill.grant_prefills` orders them (the shortest left first, the
oldest always a share), so a long prompt never stalls running streams, nor a short
prompt that came after it. A
follower (see :mod:`.choices`) waits for its leader's prompt: it neither decodes nor
prefills. Background choices (a Batch API line's) sit out every step that prefills a
foreground prompt: a batch on a CPU would otherwise add its decodes to the step that
computes another request's first token (a step's time grows with its rows).

The batch is laid out in slot order. With one KV stream per slot, llama.cpp splits
a batch into one ubatch (one pass over the weights) per run of consecutive sequence
ids, taking the same number of tokens from each: in any other order the same tokens
cost up to one pass per sequence.

Plain Python, unit-tested without a model: the loop writes :class:`BatchPlan`'s rows
into llama.cpp's batch.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from tokenmill.engines.llamacpp.choices import Choice
from tokenmill.engines.llamacpp.prefill import Pending, grant_prefills

__all__ = ["BatchPlan", "Row", "plan_batch"]

# One batch row: (token, its position, the slot's sequence id, whether its logits
# are wanted).
Row = tuple[int, int, int, bool]


@dataclass(slots=True)
class BatchPlan:
    rows: list[Row] = field(default_factory=list)
    # (choice, row): the row whose logits give the choice's next token.
    outputs: list[tuple[Choice, int]] = field(default_factory=list)
    # (choice, row): prompt rows whose logits give the prompt's log probabilities
    # (echo with logprobs), in prompt order.
    prompt_rows: list[tuple[Choice, int]] = field(default_factory=list)
    # (choice, end): its prompt tokens ``n_past:end`` are in this batch.
    prefills: list[tuple[Choice, int]] = field(default_factory=list)
    # Choice key -> the rows verifying its draft (``choice.draft``, cut to what fit),
    # right after its output row: each row's logits give the token after that draft
    # token (speculative decoding, tokenmill.engines.speculative).
    drafts: dict[str, list[int]] = field(default_factory=dict)


def plan_batch(running: Collection[Choice], *, prefill_chunk: int, capacity: int) -> BatchPlan:
    """The next step's batch for ``running`` (in arrival order), at most ``capacity``
    rows of which at most ``prefill_chunk`` prompt tokens (see :mod:`.prefill`)."""
    if any(_waits_for_prompt(s) and not s.background for s in running):
        # A foreground prompt to prefill: background sequences sit this step out.
        running = [s for s in running if not s.background]
    decoding = sum(1 for s in running if s.prefilled)
    pending = [Pending(s.key, len(s.prompt) - s.n_past) for s in running if _waits_for_prompt(s)]
    grant = grant_prefills(pending, min(prefill_chunk, capacity - decoding)) if pending else {}
    # Drafts take what the prompts leave: a first token never waits for a draft.
    room = max(0, capacity - decoding - sum(grant.values()))
    plan = BatchPlan()
    rows = plan.rows
    for seq in sorted(running, key=_by_slot):
        if seq.prefilled:
            plan.outputs.append((seq, len(rows)))
            rows.append((seq.last_token, seq.n_past, seq.slot, True))
            if seq.draft:
                seq.draft = seq.draft[:room]
                room -= len(seq.draft)
                if seq.draft:
                    plan.drafts[seq.key] = list(range(len(rows), len(rows) + len(seq.draft)))
                    for i, token in enumerate(seq.draft):
                        rows.append((token, seq.n_past + 1 + i, seq.slot, True))
            continue
        take = grant.get(seq.key, 0)
        if take == 0:
            continue
        start, end = seq.n_past, seq.n_past + take
        collect = seq.prompt_logprobs is not None
        last = len(seq.prompt) - 1
        for i in range(start, end):
            if i == last:
                plan.outputs.append((seq, len(rows)))
            elif collect:
                plan.prompt_rows.append((seq, len(rows)))
            rows.append((seq.prompt[i], i, seq.slot, i == last or collect))
        plan.prefills.append((seq, end))
    return plan


def _waits_for_prompt(seq: Choice) -> bool:
    return not seq.prefilled and seq.leader is None


def _by_slot(seq: Choice) -> int:
    return seq.slot
