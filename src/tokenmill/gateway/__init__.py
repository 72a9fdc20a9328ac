"""The gateway: a request's path from admission to a settled stream.

Admission (:mod:`.admission`, :mod:`.fairqueue`), routing (:mod:`.routing`,
:mod:`.prefix`), the credit reservation (:mod:`.reservation`), the metered stream
(:mod:`.core`), each deployment (:mod:`.deployment`) and its replicas' lives
(:mod:`.replicaset`, driven by :mod:`.scaling`). Replica hosting
itself is the layer below, :mod:`tokenmill.replicas`; the books are the ledger's,
reached through :class:`tokenmill.metering.Meter`. Callers import from here.
"""

from __future__ import annotations

from tokenmill.gateway.core import Gateway, RequestRecord, RequestStream, new_request_id
from tokenmill.gateway.deployment import Deployment
from tokenmill.gateway.fairqueue import requested_priority

__all__ = [
    "Deployment",
    "Gateway",
    "RequestRecord",
    "RequestStream",
    "new_request_id",
    "requested_priority",
]
