"""The gateway's side of ``/v1/embeddings``: admitted, held and settled like a prompt.

An embedding request goes the way of a generation that produces no completion
tokens (see :meth:`Gateway.open <tokenmill.gateway.core.Gateway.open>`): it takes an
admission permit (one slot's worth: a full deployment queues it, or refuses it with
429), a replica counts its input tokens (``prepare_embeddings``), the credit for
them is held at the deployment's ``price.prompt_per_mtok`` (no credit: 402; a key's
rate limit: 429), the replica computes the vectors, and the hold is settled with
the tokens as prompt tokens, exactly once, however the request ends (a client that
left still pays for inputs that were embedded, as for a prompt that was read). The
request's receipt (``/v1/usage/{request_id}``) and log line are a generation's.
"""

from __future__ import annotations

import asyncio
import time

from tokenmill.engines import EmbeddingRequest, Embeddings
from tokenmill.errors import EngineError, ServiceError
from tokenmill.gateway.core import Gateway, RequestRecord
from tokenmill.gateway.deployment import Deployment
from tokenmill.gateway.records import finished
from tokenmill.gateway.replicaset import Replica
from tokenmill.gateway.reservation import Books
from tokenmill.identity import ANONYMOUS, Caller
from tokenmill.metering import HoldRequest, cost, discount_for


async def embed(
    gateway: Gateway,
    deployment: Deployment,
    request: EmbeddingRequest,
    caller: Caller = ANONYMOUS,
) -> Embeddings:
    """Admit, count the inputs, hold credit, embed, settle. Raises what refused it."""
    record = RequestRecord(request.request_id, deployment.id, caller)
    try:
        gateway.check_admits(caller, "embed")
        record.queue_s = await deployment.admission.acquire(1, caller.tenant())
    except BaseException as e:
        gateway.refused(record, e)
        raise
    replica: Replica | None = None
    try:
        replica = await deployment.pick()
        info = await replica.host.prepare_embeddings(request)
        record.prompt_tokens = info.prompt_tokens
        deployment.admission.serve(caller.account_id, info.prompt_tokens)
        discount = discount_for(deployment.config, caller)
        hold = HoldRequest(
            request_id=request.request_id,
            caller=caller,
            deployment=deployment.id,
            prompt_tokens=info.prompt_tokens,
            max_tokens=0,
            amount=cost(deployment.config.price, info.prompt_tokens, 0, discount),
            discount=discount,
        )
        await gateway.meter.hold(hold)
    except BaseException as e:
        _release(deployment, replica, record)
        gateway.refused(record, e)
        raise
    books = Books(deployment, replica, 1, hold, gateway.meter)
    for o in gateway.observers:
        o.on_start(record)
    try:
        result = await replica.host.embed(request)
        record.finish_reason = "stop"
        record.ttft_s = time.monotonic() - record.started
        return result
    except ServiceError as e:
        record.status = "error"
        record.error_code = e.code
        raise
    except asyncio.CancelledError:
        record.finish_reason = "abort"
        record.status = "cancelled"
        raise
    except Exception as e:  # a bug, not an answer: the client gets a 502, not a trace
        record.status = "error"
        record.error_code = "engine_error"
        raise EngineError(f"the replica failed: {type(e).__name__}") from e
    finally:
        books.release_capacity(record)
        try:
            # Settling survives the caller's cancellation (it is shielded in settle).
            await asyncio.shield(books.settle(record))
        finally:
            finished(record, gateway.observers)


def _release(deployment: Deployment, replica: Replica | None, record: RequestRecord) -> None:
    """The replica's routing count and the admission permit go back (refused before
    its books were opened)."""
    if replica is not None:
        deployment.release(replica)
    held_s = time.monotonic() - record.started - record.queue_s
    deployment.admission.release(held_s, account=record.caller.account_id)


__all__ = ["embed"]
