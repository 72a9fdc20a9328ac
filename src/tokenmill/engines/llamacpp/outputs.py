"""A decode step's output rows: sampled tokens, constraints and log probabilities.

After each ``llama_decode`` the step loop reads, for every row whose logits it asked
for, either a prompt token's log probability (echo with logprobs) or the choice's
next token: its constraint (structured outputs) masks the logits, its sampler chain
draws, and the log probabilities it asked for are read from the raw row first, the
model's own distribution, untouched by sampling.
"""

from __future__ import annotations

import codecs
import logging

from tokenmill.engines.base import Chunk, TokenLogprob, TopLogprob
from tokenmill.engines.llamacpp.choices import Choice
from tokenmill.engines.llamacpp.context import LlamaContext
from tokenmill.engines.llamacpp.logits import LogitRow
from tokenmill.engines.logprobs import finite

__all__ = ["OutputRows"]

log = logging.getLogger("tokenmill.engines.llamacpp")


class OutputRows:
    """Reads the output rows of ``context``'s last decode."""

    def __init__(self, context: LlamaContext) -> None:
        self.context = context
        self.vocab = context.vocab

    def sample(self, seq: Choice, idx: int) -> int | None:
        """``seq``'s next token from output ``idx``; None when its constraint allows
        no token at all (the grammar failed: the choice ends)."""
        grammar = seq.grammar
        if grammar is not None and not grammar.mask(self.context.logits(idx)):
            log.warning("request %s: grammar failed: %s", seq.request_id, grammar.error)
            return None
        if seq.greedy:
            # What llama.cpp's greedy sampler picks (the first of the largest), without
            # copying the vocabulary into its candidates.
            return int(self.context.logits(idx).argmax())
        return self.context.sample(seq.sampler, idx)

    def row(self, idx: int) -> LogitRow:
        """The raw logits at output ``idx`` (copied), for log probabilities."""
        return LogitRow(self.context.logits(idx))

    def top(self, row: LogitRow, k: int) -> tuple[TopLogprob, ...]:
        """The ``k`` likeliest tokens of ``row`` (none for ``k`` <= 0)."""
        if k <= 0:
            return ()
        # Control tokens as written (<|im_end|>): as text they would all be "", and
        # several would collide as keys of a completion's top_logprobs.
        piece = self.vocab.piece
        return tuple(TopLogprob(piece(t, special=True), finite(lp)) for t, lp in row.top(k))

    def record_prompt_row(self, seq: Choice, idx: int) -> None:
        """Output ``idx`` is the prompt row before ``seq``'s next uncollected prompt
        token: record that token's log probability and alternatives."""
        collected = seq.prompt_logprobs
        assert collected is not None
        row = self.row(idx)
        token = seq.prompt[len(collected) + 1]  # the token this row predicts
        collected.append((finite(row.logprob(token)), self.top(row, seq.sampling.logprobs or 0)))

    def echo(self, seq: Choice) -> Chunk:
        """The prompt as a chunk: its text, and its tokens' log probabilities if asked."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        parts: list[str] = []
        tokens: list[TokenLogprob] = []
        chars = 0
        collected = seq.prompt_logprobs
        for i, token in enumerate(seq.prompt):
            piece = self.vocab.piece(token, special=True)
            if collected is not None:
                logprob, top = (None, ()) if i == 0 else collected[i - 1]
                tokens.append(TokenLogprob(piece, logprob, chars, top))
            text = decoder.decode(piece)
            parts.append(text)
            chars += len(text)
        parts.append(decoder.decode(b"", final=True))
        return Chunk("".join(parts), logprobs=tuple(tokens), index=seq.index)
