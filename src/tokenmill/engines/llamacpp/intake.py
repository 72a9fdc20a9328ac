"""A request's prompts as the llama.cpp engine takes them: tokens, checked.

:func:`prompt_tokens` tokenizes (or checks) every prompt of a request and refuses,
naming the field, what this engine cannot run: token ids outside the vocabulary,
more choices than slots, a prompt with no room left for a completion.
:class:`NextTurns` keeps, per chat template, the tokens it writes after an answer
before the next user message (the next-turn warm-up, see :mod:`.slotcache`).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.engines.base import GenerationRequest
from tokenmill.engines.chat_template import next_user_turn
from tokenmill.engines.llamacpp.vocab import Vocab
from tokenmill.errors import ContextLengthError, InvalidRequestError

__all__ = ["NEXT_TURNS_KEPT", "NextTurns", "prompt_tokens"]

# Chat templates whose next-turn tokens are kept (the model's, and requests' own).
NEXT_TURNS_KEPT = 64


def prompt_tokens(
    request: GenerationRequest,
    vocab: Vocab,
    *,
    n_ctx: int,
    max_choices: int,
    pool: int | None = None,
) -> list[list[int]]:
    """The request's prompts as token ids, each checked against the context of
    ``n_ctx`` tokens; ``max_choices``: the slots, which all choices need at once;
    ``pool``: the KV cells the slots share, which all choices' prompts need at once."""
    n_vocab = vocab.n_tokens
    for token, _ in request.sampling.logit_bias:
        if not 0 <= token < n_vocab:
            raise InvalidRequestError(
                f"logit_bias names token {token}; this model's token ids are 0 to {n_vocab - 1}",
                param="logit_bias",
            )
    if request.choices > max_choices:
        raise InvalidRequestError(
            f"the request asks for {request.choices} choices (n times the prompts); a "
            f"replica of this deployment generates at most {max_choices} at once",
            param="n",
        )
    if request.prompts is not None:
        prompts = [_prompt_item(vocab, item) for item in request.prompts]
    elif request.prompt_tokens is not None:
        prompts = [_prompt_item(vocab, request.prompt_tokens)]
    else:
        prompts = [vocab.tokenize(vocab.render(request))]
    several = len(prompts) > 1
    for p, tokens in enumerate(prompts):
        which = f"prompt {p}" if several else "the prompt"
        if not tokens:
            raise InvalidRequestError(f"{which} is empty", param="prompt")
        # max_tokens 0 means "as many as fit": the prompt must leave room for one.
        n_prompt, n_max = len(tokens), request.sampling.max_tokens
        if n_prompt + max(n_max, 1) > n_ctx:
            raise ContextLengthError(
                f"This model's maximum context length is {n_ctx} tokens. "
                f"However, you requested {n_prompt + n_max} tokens ({n_prompt} in "
                f"{which}, {n_max} for the completion). Shorten the prompt or lower "
                "max_tokens.",
                param="max_tokens",
            )
    need = request.n * sum(len(tokens) + 1 for tokens in prompts)
    if pool is not None and need > pool:
        raise ContextLengthError(
            f"This replica's KV pool holds {pool} tokens (kv_pool_tokens), all its "
            f"sequences together. However, the {request.choices} choices of this request "
            f"need {need} at once for their prompts. Ask for fewer choices or shorten "
            "the prompts.",
            param="n",
        )
    return prompts


def _prompt_item(vocab: Vocab, item: str | Sequence[int]) -> list[int]:
    if isinstance(item, str):
        return vocab.tokenize(item)
    vocab.check_ids(item, "prompt")
    return list(item)


class NextTurns:
    """Chat template source -> its next-turn tokens: the same few tokens for every
    chat with that template, tokenized once."""

    def __init__(self, vocab: Vocab) -> None:
        self._vocab = vocab
        self._kept: dict[str, tuple[int, ...]] = {}

    def of(self, request: GenerationRequest) -> tuple[int, ...]:
        """The tokens a chat's template writes after this request's answer, before
        the next user message (empty: not a one-choice chat without tools, or a
        template that does not write an answer as it was generated)."""
        if request.messages is None or request.choices != 1 or request.tools is not None:
            return ()
        vocab = self._vocab
        source = request.chat_template or vocab.template
        if not source:
            return ()
        tokens = self._kept.get(source)
        if tokens is None:
            text = next_user_turn(source, vocab.bos, vocab.eos)
            tokens = tuple(vocab.tokenize(text, bos=False)) if text else ()
            if len(self._kept) < NEXT_TURNS_KEPT:  # requests' own templates vary
                self._kept[source] = tokens
        return tokens
