"""A request inside the llama.cpp engine: a group of choices, each a decoding sequence.

A request asks for ``n`` choices of each of its prompts. Each choice decodes in a
slot of its own (:class:`Choice`); a request's choices form a :class:`Group`, which
is admitted whole and finishes when its last choice does. Choices of one prompt share
its prefill: the first (the leader) decodes the prompt, the others (followers) wait
with a slot of their own, then sample from the leader's last prompt row and take a
copy of its KV cells.

:func:`build_group` lays a request out so; plain Python, unit-tested without a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tokenmill.engines.base import (
    Constraint,
    GenerationRequest,
    SamplingParams,
    TopLogprob,
    Usage,
)
from tokenmill.engines.logprobs import TokenAligner
from tokenmill.engines.speculative import Speculation
from tokenmill.engines.textstream import TextStream

if TYPE_CHECKING:
    from tokenmill.engines.llamacpp.grammar import SequenceGrammar

__all__ = ["Choice", "Group", "build_group"]


@dataclass(slots=True)
class Choice:
    """One choice of a request: a sequence decoding in a slot of its own."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    stream: TextStream
    group: Group | None = None  # set at once by build_group
    key: str = ""  # unique among running choices (the request id for choice 0)
    index: int = 0  # the choice (OpenAI's ``index``)
    leader: Choice | None = None  # a follower's, until it starts
    followers: list[Choice] = field(default_factory=list)
    slot: int = -1
    n_past: int = 0  # tokens of this request already in the slot's KV
    cached: int = 0  # prompt tokens reused from the prefix cache
    generated: int = 0
    last_token: int = -1
    sampler: Any = None  # its llama.cpp sampler chain, while it runs
    greedy: bool = False  # the chain is greedy alone: its token is the logits' argmax
    done: bool = False
    # Tokens waiting for their text, when log probabilities were asked for.
    aligner: TokenAligner | None = None
    # The prompt's text goes out before the first sampled token (``echo``).
    echo_pending: bool = False
    # With echo and logprobs: (log probability, alternatives) of prompt tokens 1..n-1,
    # read from logits of every prompt row (see the step loop); None: not collected.
    prompt_logprobs: list[tuple[float, tuple[TopLogprob, ...]]] | None = None
    # The constraint's state (structured outputs): masks the logits before sampling.
    grammar: SequenceGrammar | None = None
    # A chat's answer: what its template writes before the next user message, as
    # tokens (see the next-turn warm-up in slotcache.py); empty for anything else.
    next_turn: tuple[int, ...] = ()
    # Its request's: it sits out steps that prefill a foreground prompt (batch.py).
    background: bool = False
    # Swapped out of a full KV pool: the key of its cells parked in host memory, until
    # it resumes (its slot stays its own meanwhile).
    swapped: int | None = None
    # Speculative decoding (speculative = "ngram"): its drafting state, and this
    # step's draft (tokens verified after its next one, in the same step).
    spec: Speculation | None = None
    draft: list[int] = field(default_factory=list)

    @property
    def prefilled(self) -> bool:
        """Its whole prompt is in the KV cache: it decodes a token a step."""
        return self.n_past >= len(self.prompt)


@dataclass(slots=True)
class Group:
    """One request's choices: ``n`` sequences for each of its prompts."""

    request_id: str
    members: list[Choice]
    prompt_tokens: int  # every prompt, each counted once
    generated: int = 0  # completion tokens of all its choices
    open: int = 0  # choices not finished yet
    # Monotonic times it was queued and taken by the decode loop (tokenmill.stages).
    marks: list[float] = field(default_factory=list)

    def usage(self) -> Usage:
        cached = sum(m.cached for m in self.members)
        return Usage(self.prompt_tokens, self.generated, cached)


def build_group(
    request: GenerationRequest,
    prompts: Sequence[list[int]],
    *,
    next_turn: tuple[int, ...] = (),
    start_grammar: Callable[[Constraint], SequenceGrammar] | None = None,
) -> Group:
    """``request``'s choices: ``request.n`` for each of ``prompts``, in that order.

    Choice ``i`` of a prompt with a seed samples with ``seed + i``; the first choice
    of each prompt leads, the others follow it. ``start_grammar`` gives each choice
    its constraint's state (needed when the request has a constraint).
    """
    rid, base = request.request_id, request.sampling
    echo, logprobs = base.echo, base.logprobs is not None
    members: list[Choice] = []
    group = Group(rid, members, sum(map(len, prompts)))
    for tokens in prompts:
        leader: Choice | None = None
        for i in range(request.n):
            sampling = base
            if i and base.seed is not None:  # each choice samples on its own
                sampling = replace(base, seed=base.seed + i)
            index = len(members)
            grammar = None
            if base.constraint is not None:
                if start_grammar is None:
                    raise ValueError("a constrained request needs start_grammar")
                grammar = start_grammar(base.constraint)
            seq = Choice(
                request_id=rid,
                prompt=tokens,
                sampling=sampling,
                stream=TextStream(base.stop),
                group=group,
                key=rid if index == 0 else f"{rid}#{index}",
                index=index,
                leader=leader,
                aligner=TokenAligner() if logprobs else None,
                echo_pending=echo,
                # A follower takes its leader's when it starts.
                prompt_logprobs=[] if echo and logprobs and leader is None else None,
                grammar=grammar,
                next_turn=next_turn,
                background=request.background,
            )
            if leader is None:
                leader = seq
            else:
                leader.followers.append(seq)
            members.append(seq)
    group.open = len(members)
    return group
