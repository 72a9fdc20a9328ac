"""vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``, answered with the
deployment's own tokenizer. Knows nothing of routes.
"""

from __future__ import annotations

import dataclasses

from tokenmill.engines import TokenizeRequest
from tokenmill.gateway import Deployment
from tokenmill.server.openai.protocol import DetokenizeBody, TokenizeBody
from tokenmill.server.openai.replies import Detokenized, Tokenized, TokenizerInfoBody


async def tokenize(deployment: Deployment, body: TokenizeBody) -> Tokenized:
    """The prompt's token ids, as a generation with the same prompt would see them."""
    host = await deployment.any_host()
    messages = None
    if body.messages is not None:
        messages = tuple(m.to_chat_message() for m in body.messages)
    request = TokenizeRequest(
        prompt=body.prompt,
        messages=messages,
        chat_template=body.chat_template,
        add_generation_prompt=body.add_generation_prompt,
        add_special_tokens=body.add_special_tokens,
    )
    tokens = await host.tokenize(request)
    return Tokenized(tokens=tokens, count=len(tokens), max_model_len=host.context_length())


async def detokenize(deployment: Deployment, body: DetokenizeBody) -> Detokenized:
    host = await deployment.any_host()
    return Detokenized(prompt=await host.detokenize(body.tokens))


async def tokenizer_info(deployment: Deployment) -> TokenizerInfoBody:
    """vLLM's ``/tokenizer_info``: what lm-evaluation-harness's remote tokenizer reads."""
    host = await deployment.any_host()
    info = await host.tokenizer_info()
    return TokenizerInfoBody.model_validate(dataclasses.asdict(info))
