"""Run lm-eval with a client-side patch for what tokenmill answers differently.

lm-eval 0.4.13's ``local-completions`` scores log-likelihood tasks against tokenmill
with its remote tokenizer (``tokenizer_backend=remote``: tokenmill's
``/tokenizer_info``, ``/tokenize`` and ``/detokenize``) and token-id prompts
(``tokenized_requests=True``: ``prompt: [[ids...]]``, a list of one prompt). One
difference remains; the patch for it can be turned off (``TM_SHIM_EOS=0``) to see
lm-eval's own behaviour:

EOS    lm-eval asks ``max_tokens: 1, echo: true, logprobs: 1`` and drops the last entry
       of ``token_logprobs`` as the generated token (``[ctxlen:-1]``). When that token is
       end-of-sequence, tokenmill returns no entry for it (``finish_reason: "stop"``,
       ``completion_tokens: 0``: an end-of-sequence token is neither text nor billed),
       so lm-eval drops the continuation's last token instead. Patch: drop an entry
       only when there is one more than the prompt's tokens.

(Two more patches were needed before tokenmill had ``GET /tokenizer_info`` and took
several prompts per request; they are gone.)

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
    from lm_eval.models import openai_completions  # type: ignore[import-not-found]

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
