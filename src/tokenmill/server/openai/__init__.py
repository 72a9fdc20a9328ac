"""OpenAI's chat completions, completions and embeddings (and the deployment predict
endpoints and vLLM's tokenizer routes, which answer in the same family of shapes), as
an adapter over the generation core (:mod:`tokenmill.chat`).

The parts every API's folder has: ``protocol`` (with ``tools`` and ``structured``)
the request models, validated and turned into the core's neutral request (``replies``
the bodies and chunks sent back, which the OpenAPI document shows); ``serving``
opens a generation and pairs it with its encoder; ``events`` the pure encoders, the
core's events shaped as OpenAI's chunks and bodies; ``router`` the thin routes.
``embeddings`` and ``tokenizing`` serve the routes that generate nothing. Nothing
here decides how a chat is rendered or read.
"""
