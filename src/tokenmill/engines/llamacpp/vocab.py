"""The text side of a GGUF model: its tokenizer and chat template.

:class:`Vocab` wraps the vocabulary of a loaded llama.cpp model: the llama.cpp
engine uses it for its prompts, and :class:`GgufTokenizer` loads a GGUF file with
``vocab_only`` (no weights, a few MB) so that an upstream deployment counts tokens
with the same tokenizer as the model behind it.

This module imports ``llama_cpp``; it is loaded lazily, never by ``import tokenmill``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp as ll

from tokenmill.engines.base import GenerationRequest, TokenizeRequest, TokenizerInfo
from tokenmill.engines.chat_template import render_chat
from tokenmill.engines.embedded import embedded_model_path
from tokenmill.engines.llamacpp.threads import extra_buffers_work
from tokenmill.errors import EngineError, InvalidRequestError

# llama.cpp's vocabulary types (``llama_vocab_type``), named in ``tokenizer_class``.
_VOCAB_TYPES = {1: "SPM", 2: "BPE", 3: "WPM", 4: "UGM", 5: "RWKV"}

_backend_lock = threading.Lock()
_backend_ready = False


def init_backend() -> None:
    """llama.cpp's process-wide init, once; its logs are silenced on the way."""
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            ll.llama_backend_init()
            _silence_llama_logs()
            _backend_ready = True


def model_params() -> Any:
    """llama.cpp's model parameters for loading a model to run it (see
    :func:`~tokenmill.engines.llamacpp.threads.extra_buffers_work`)."""
    params = ll.llama_model_default_params()
    params.use_extra_bufts = extra_buffers_work()
    return params


class Vocab:
    """Tokenize and render prompts with one loaded model's vocabulary."""

    def __init__(self, model: Any) -> None:
        self.handle = ll.llama_model_get_vocab(model)
        tmpl = ll.llama_model_chat_template(model, None)
        self.template: str | None = tmpl.decode() if tmpl else None
        self.bos = self.token_text(ll.llama_vocab_bos(self.handle))
        self.eos = self.token_text(ll.llama_vocab_eos(self.handle))
        self.n_tokens = ll.llama_vocab_n_tokens(self.handle)
        self._piece_buf = ctypes.create_string_buffer(256)
        # token -> piece: at most the vocabulary, a few MB.
        self._pieces: dict[int, bytes] = {}
        self._special_pieces: dict[int, bytes] = {}

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""
        raw = ll.llama_vocab_get_text(self.handle, token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    def info(self, context_length: int) -> TokenizerInfo:
        """Special tokens as text (tokenizing one with ``special`` gives its id back),
        the model's own chat template and ``context_length``."""

        def special(token: int) -> str | None:
            return self.token_text(token) if token >= 0 else None

        kind = _VOCAB_TYPES.get(ll.llama_vocab_type(self.handle), "unknown")
        return TokenizerInfo(
            tokenizer_class=f"llama.cpp {kind}",
            eos_token=special(ll.llama_vocab_eos(self.handle)),
            bos_token=special(ll.llama_vocab_bos(self.handle)),
            pad_token=special(ll.llama_vocab_pad(self.handle)),
            chat_template=self.template,
            model_max_length=context_length,
        )

    def render(self, request: GenerationRequest | TokenizeRequest) -> str:
        """The prompt text: the request's ``prompt``, or its messages through the template."""
        if request.prompt is not None:
            return request.prompt
        assert request.messages is not None, "a prompt given as token ids has no text to render"
        source = request.chat_template or self.template
        add = request.add_generation_prompt if isinstance(request, TokenizeRequest) else True
        tools = request.tools if isinstance(request, GenerationRequest) else None
        return render_chat(source, request.messages, self.bos, self.eos, add, tools)

    def check_ids(self, tokens: Sequence[int], param: str) -> None:
        """Raise ``InvalidRequestError`` naming ``param`` for an id outside the vocabulary."""
        for token in tokens:
            if not 0 <= token < self.n_tokens:
                raise InvalidRequestError(
                    f"token id {token} is not in this model's vocabulary (ids 0 to "
                    f"{self.n_tokens - 1})",
                    param=param,
                )

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``, control tokens written out (the inverse of ``tokenize``)."""
        self.check_ids(tokens, "tokens")
        ids = (ll.llama_token * len(tokens))(*tokens)
        cap = max(64, 8 * len(tokens))
        buf = ctypes.create_string_buffer(cap)
        n = ll.llama_detokenize(self.handle, ids, len(tokens), buf, cap, False, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_detokenize(self.handle, ids, len(tokens), buf, -n, False, True)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def tokenize(self, text: str, *, special: bool = True, bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; ``special`` parses control tokens written as text
        (a rendered chat template) and adds BOS where the model wants one (``bos``
        False: never, for text that continues a prompt)."""
        data = text.encode("utf-8")
        add = special if bos is None else bos
        cap = len(data) + 8
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self.handle, data, len(data), buf, cap, add, special)
        if n < 0:
            buf = (ll.llama_token * -n)()
            n = ll.llama_tokenize(self.handle, data, len(data), buf, -n, add, special)
        return list(buf[:n])

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes one token stands for (possibly part of a UTF-8 character);
        ``special`` writes control tokens out (``<|im_start|>``), else they are empty.
        Each is asked of llama.cpp once (the decode loop asks for every token)."""
        cache = self._special_pieces if special else self._pieces
        piece = cache.get(token)
        if piece is not None:
            return piece
        buf = self._piece_buf
        n = ll.llama_token_to_piece(self.handle, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.handle, token, buf, len(buf), 0, special)
        piece = cache[token] = buf.raw[:n]
        return piece

    def is_eog(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self.handle, token))


class GgufTokenizer:
    """A GGUF file's tokenizer and chat template, loaded without its weights.

    ``path`` is a GGUF file, or ``"embedded"`` for the embedded SmolLM2's.
    """

    def __init__(self, path: str | Path) -> None:
        file = embedded_model_path() if str(path) == "embedded" else Path(path)
        if not file.is_file():
            raise EngineError(f"tokenizer file not found: {file}")
        init_backend()
        params = ll.llama_model_default_params()
        params.vocab_only = True
        self._model = ll.llama_model_load_from_file(str(file).encode(), params)
        if not self._model:
            raise EngineError(f"llama.cpp could not read the vocabulary of {file}")
        self.path = file
        self.vocab = Vocab(self._model)

    def count_prompt(self, request: GenerationRequest) -> int:
        if request.prompt_tokens is not None:
            return len(request.prompt_tokens)
        return len(self.vocab.tokenize(self.vocab.render(request)))

    def count_text(self, text: str) -> int:
        """Tokens of generated text (no BOS, control tokens read as plain text)."""
        return len(self.vocab.tokenize(text, special=False)) if text else 0

    def close(self) -> None:
        if self._model is not None:
            ll.llama_model_free(self._model)
            self._model = None


_log_callback: Any = None


def _silence_llama_logs() -> None:
    """Route llama.cpp's chatter to nothing unless TOKENMILL_LLAMA_LOG is set."""
    global _log_callback
    if os.environ.get("TOKENMILL_LLAMA_LOG") or _log_callback is not None:
        return

    def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        return None

    _log_callback = ll.llama_log_callback(_quiet)
    ll.llama_log_set(_log_callback, ctypes.c_void_p(0))
