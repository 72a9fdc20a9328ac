"""Grammar-constrained sampling for the llama.cpp engine, with llguidance.

A :class:`~tokenmill.engines.base.Constraint` (JSON schema, any JSON object, GBNF,
Lark, regex, a list of choices) becomes an llguidance grammar, compiled once per
distinct constraint (:class:`GrammarCache`, off the decode thread) and copied for each
sequence (:class:`SequenceGrammar`). Before a constrained sequence samples, its
grammar writes a bitmask of the tokens it allows (llguidance computes it in tens of
microseconds over a 49k vocabulary) and every other token's logit becomes ``-inf``,
in that sequence's own logits row: the other sequences of the batched step are
untouched. After sampling, the grammar consumes the token.

Why llguidance: measured here (``make bench``'s constrained row) a mask costs tens of
microseconds a token; llama.cpp's own grammar sampler walks the whole vocabulary
against its stacks (milliseconds a token), and xgrammar pulls in torch.

JSON comes out with the separators ``", "`` and ``": "`` and no other whitespace: a
small model left free whitespace loops on spaces and newlines until ``max_tokens``.
For the same reason every number a JSON constraint allows has bounded digits
(:mod:`tokenmill.engines.json_numbers`): a greedy model otherwise writes
``3211123200000000000…`` until ``max_tokens``.

This module imports llguidance and numpy; it is loaded with the engine.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.llamacpp
import numpy as np

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from tokenmill.engines.base import Constraint
from tokenmill.engines.json_numbers import bound_numbers
from tokenmill.errors import InvalidRequestError

__all__ = ["GrammarCache", "SequenceGrammar", "grammar_text"]

# JSON as json.dumps writes it: what models have read most of, and no free whitespace.
JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}

# Compiled grammars kept for reuse: a service sees the same few schemas again and again.
CACHE_SIZE = 64


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar for ``c``; ``InvalidRequestError`` naming ``c.param``
    when it is not even well formed (compile errors come from :class:`GrammarCache`)."""
    try:
        if c.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                bound_numbers({"type": "object"}), overrides=JSON_OPTIONS
            )
        if c.kind == "json_schema":
            schema = json.loads(c.text)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema is a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(
                bound_numbers(schema),
                defaults=JSON_OPTIONS,
                overrides={"whitespace_flexible": False},
            )
        if c.kind == "choice":
            options = json.loads(c.text)
            if (
                not isinstance(options, list)
                or not options
                or not all(isinstance(o, str) for o in options)
            ):
                raise ValueError("choices are a non-empty list of strings")
            return llguidance.grammar_from("choice", c.text)
        if c.kind == "gbnf":
            return llguidance.grammar_from("gbnf", c.text)
        if c.kind == "lark":
            return llguidance.grammar_from("lark", c.text)
        return llguidance.grammar_from("regex", c.text)
    except ValueError as e:
        raise InvalidRequestError(f"the {_what(c)} is not valid: {e}", param=c.param) from e


def _what(c: Constraint) -> str:
    return {
        "json_object": "JSON object format",
        "json_schema": "JSON schema",
        "gbnf": "GBNF grammar",
        "lark": "Lark grammar",
        "regex": "regular expression",
        "choice": "list of choices",
    }[c.kind]


class GrammarCache:
    """Compiled grammars for one model's vocabulary, by constraint.

    The llguidance tokenizer (every token's bytes, about a second to build over a 49k
    vocabulary) is built on first use. :meth:`compile` may take long for a large
    grammar and is called off the decode thread (``prepare``); :meth:`start` is cheap.
    """

    def __init__(self, vocab: Any, n_vocab: int, eog: list[int]) -> None:
        self._vocab = vocab
        self._n_vocab = n_vocab
        self._eog = eog
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.llamacpp.lltokenizer_from_vocab(
                    self._vocab, n_vocab=self._n_vocab, eos_token=self._eog
                )
            return self._tokenizer

    def compile(self, c: Constraint) -> llguidance.LLMatcher:
        """The compiled grammar of ``c`` (cached); ``InvalidRequestError`` naming
        ``c.param`` when llguidance refuses it, with llguidance's reason."""
        with self._lock:
            matcher = self._compiled.get(c)
            if matcher is not None:
                self._compiled.move_to_end(c)
                return matcher
        grammar = grammar_text(c)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"the {_what(c)} cannot be compiled: {matcher.get_error()}", param=c.param
            )
        with self._lock:
            self._compiled[c] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def start(self, c: Constraint) -> SequenceGrammar:
        """A fresh grammar state for one sequence."""
        return SequenceGrammar(self.compile(c).deep_copy(), self._n_vocab)


class SequenceGrammar:
    """One sequence's grammar state: masks its logits, consumes its tokens."""

    __slots__ = ("_bits", "_matcher", "_n_vocab")

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int) -> None:
        self._matcher = matcher
        self._n_vocab = n_vocab
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)

    def mask(self, logits: np.ndarray[Any, np.dtype[np.float32]]) -> bool:
        """Set the logit of every token the grammar does not allow next to ``-inf``
        (in place); False when the grammar is in an error state (nothing allowed)."""
        bits = self._bits
        self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if self._matcher.is_error():
            return False
        allowed = np.unpackbits(bits.view(np.uint8), count=self._n_vocab, bitorder="little")
        np.copyto(logits, -np.inf, where=allowed == 0)
        return True

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar did not allow it."""
        return bool(self._matcher.consume_token(token))

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (end-of-sequence only)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())
