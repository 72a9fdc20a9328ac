"""Speculative decoding in the decode loop (:mod:`.loop`): which choices draft, each
step's drafts, their verification, and the step costs the drafts are weighed by.

Drafts come from prompt lookup (:class:`~tokenmill.engines.speculative.NgramIndex`),
their lengths from :mod:`.drafting`'s plan over the measured ubatch costs
(:class:`~tokenmill.engines.speculative.StepCosts`), and what is kept from
:func:`~tokenmill.engines.speculative.verify`: every token written is sampled by its
own sampler chain from the logits after exactly the tokens before it, so greedy
answers are those without drafts (as far as llama.cpp computes a row alike beside its
draft: docs/operations.md) and sampled ones are distributed as the model's.

Of a :class:`~.choices.Choice` this module (with :mod:`.drafting`) alone writes
``spec`` and ``draft``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from tokenmill.engines.base import Chunk
from tokenmill.engines.llamacpp.batch import BatchPlan
from tokenmill.engines.llamacpp.choices import Choice
from tokenmill.engines.llamacpp.context import LlamaContext
from tokenmill.engines.llamacpp.counters import Counters
from tokenmill.engines.llamacpp.drafting import plan_drafts, step_rows
from tokenmill.engines.llamacpp.slotcache import SlotCache
from tokenmill.engines.speculative import NgramIndex, Speculation, StepCosts, verify

__all__ = ["Draw", "Events", "Speculator"]

# One step's chunks (or errors), by the choice they belong to.
Events = list[tuple[Choice, Chunk | BaseException]]
# Sample a choice's token from an output row and write it to the events: the token,
# or None where the choice ended with it.
Draw = Callable[[Choice, int, Events], int | None]


class Speculator:
    """``speculate``: whether a choice drafts unless its request says (speculative =
    "ngram"); ``always``: every draft found is verified whole, whatever the costs
    (speculative_rule = "always": what a test of drafting needs on any CPU)."""

    def __init__(
        self,
        context: LlamaContext,
        cache: SlotCache[Choice],
        counters: Counters,
        *,
        speculate: bool = False,
        always: bool = False,
    ) -> None:
        self.context = context
        self.cache = cache
        self.counters = counters
        self.speculate = speculate
        self.always = always
        self.costs = StepCosts(unified=context.unified, n_ubatch=context.batch_cap)

    def start(self, seq: Choice) -> None:
        """``seq`` is admitted: it drafts if its request asks, or by default."""
        wanted = seq.sampling.speculative
        if self.speculate if wanted is None else wanted:
            seq.spec = Speculation(NgramIndex(seq.prompt))

    def plan(self, running: Collection[Choice]) -> bool:
        """This step's drafts (``choice.draft``); whether any choice may draft (nothing
        of it on the steps of those that do not)."""
        speculating = any(s.spec is not None for s in running)
        if speculating:
            plan_drafts(running, self.costs, n_ctx=self.context.n_ctx_seq, always=self.always)
        return speculating

    def verify(self, seq: Choice, idxs: list[int], events: Events, draw: Draw) -> None:
        """``seq``'s next token from output ``idxs[0]``, and while each is the draft
        token that followed it, the next from the following row (``draw``). The cells
        of the draft tokens not kept leave the slot before anything reads it."""
        drafted, spec = seq.draft[: len(idxs) - 1], seq.spec
        assert spec is not None
        written: Events = []
        kept = verify(drafted, lambda i: draw(seq, idxs[i], written))
        # The step's tokens of this choice leave as one delta: an event less a token
        # kept on every hop to the client.
        for item in written:
            last = events[-1] if events and events[-1][0] is seq else None
            joined = None
            if last is not None and isinstance(last[1], Chunk) and isinstance(item[1], Chunk):
                joined = last[1].then(item[1])
            if joined is None:
                events.append(item)
            else:
                events[-1] = (seq, joined)
        if not seq.done:  # (an ended choice's slot kept only its record: KvSlots.release)
            # The cells that stay: those the slot's record holds (the previous token's
            # and the drafts kept).
            self.context.drop(seq.slot, len(self.cache.slots[seq.slot].tokens))
        spec.verified(len(drafted), kept)
        self.counters.spec_drafted += len(drafted)
        self.counters.spec_accepted += kept

    def end_step(self, plan: BatchPlan, seconds: float, speculating: bool) -> None:
        """A step took ``seconds``: its drafts are spent, and its cost is measured, its
        planning and sampling too (what a draft's tokens save is steps, each of them
        all of this). Decode steps only: a prompt's rows want no logits, and cost less
        than the rows a draft adds."""
        for seq, _ in plan.outputs:
            seq.draft = []
        if (speculating or self.speculate) and not plan.prefills:
            self.costs.observe(step_rows(plan), seconds)
