"""Run lm-eval with client-side patches for what tokenmill answers differently.

lm-eval 0.4.13's ``local-completions`` cannot score a log-likelihood task against
tokenmill as it is (2cba47d) without these three patches; each stands for one
difference and can be turned off (``TM_SHIM_<NAME>=0``) to see lm-eval's own behaviour:

INFO   lm-eval's remote tokenizer (``tokenizer_backend=remote``: tokenmill's
       ``/tokenize`` and ``/detokenize``) first GETs ``/tokenizer_info`` (vLLM's route,
       with ``eos_token`` in it); tokenmill answers 404 ``unknown_url`` and the tokenizer
       refuses to start. Patch: skip that check (no eos token: not needed for
       log-likelihood).
BATCH  with ``tokenized_requests=True`` lm-eval sends ``prompt: [[ids...]]``, a batch of
       token-id lists even at ``batch_size=1``; tokenmill answers 400 naming ``prompt``
       ("exactly one prompt is supported per request"). Patch: send the one list flat.
EOS    lm-eval asks ``max_tokens: 1, echo: true, logprobs: 1`` and drops the last entry
       of ``token_logprobs`` as the generated token (``[ctxlen:-1]``). When that token is
       end-of-sequence, tokenmill returns no entry for it (``finish_reason: "stop"``,
       ``completion_tokens: 0``), so lm-eval drops the continuation's last token instead.
       Patch: drop an entry only when there is one more than the prompt's tokens.

Usage (in the virtualenv that has lm-eval): ``python tokenmill_shim.py <lm_eval arguments>``
"""

from __future__ import annotations

import os
import sys
from operator import itemgetter
from typing import Any


def enabled(name: str) -> bool:
    return os.environ.get(f"TM_SHIM_{name}", "1") != "0"


def install() -> None:
    from lm_eval import utils  # type: ignore[import-not-found]
    from lm_eval.models import api_models, openai_completions  # type: ignore[import-not-found]

    if enabled("INFO"):
        utils.RemoteTokenizer._validate_server = lambda self: None
        utils.RemoteTokenizer.tokenizer_info = property(lambda self: {})

    if enabled("BATCH"):
        create_message = api_models.TemplateAPI.create_message

        def flat_message(self: Any, messages: Any, generate: bool = False) -> Any:
            out = create_message(self, messages, generate)
            one_list = isinstance(out, list) and len(out) == 1 and isinstance(out[0], list)
            return out[0] if self.tokenized_requests and one_list else out

        api_models.TemplateAPI.create_message = flat_message

    if enabled("EOS"):

        def parse_logprobs(
            outputs: Any, tokens: Any = None, ctxlens: Any = None, **kwargs: Any
        ) -> list[tuple[float, bool]]:
            res = []
            for out in outputs if isinstance(outputs, list) else [outputs]:
                choices = sorted(out["choices"], key=itemgetter("index"))
                for choice, ctxlen, toks in zip(choices, ctxlens, tokens, strict=False):
                    lp = choice["logprobs"]
                    n = len(lp["token_logprobs"])
                    end = n - 1 if n > len(toks) else n  # the generated token, if any
                    logprobs = lp["token_logprobs"][ctxlen:end]
                    tops = lp["top_logprobs"][ctxlen:end]
                    pairs = zip(logprobs, tops, strict=True)
                    greedy = all(t == max(top.values()) for t, top in pairs)
                    res.append((sum(logprobs), greedy))
            return res

        openai_completions.LocalCompletionsAPI.parse_logprobs = staticmethod(parse_logprobs)


if __name__ == "__main__":
    install()
    from lm_eval.__main__ import cli_evaluate  # type: ignore[import-not-found]

    sys.argv[0] = "lm_eval"
    cli_evaluate()
