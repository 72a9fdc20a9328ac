"""OpenAI's chat completions and completions (and the deployment predict endpoints that
answer in their shapes), as an adapter over the generation core (:mod:`tokenmill.chat`).

``protocol`` (with ``tools`` and ``structured``): the wire models, validated and turned
into the core's neutral request; ``serving``: the core's events shaped as OpenAI's
chunks and bodies. Nothing here decides how a chat is rendered or read.
"""
