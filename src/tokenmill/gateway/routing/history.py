"""What a deployment's routing remembers between requests, kept by the caller.

The policies are pure (:mod:`tokenmill.gateway.routing`): whatever they weigh that an
earlier request left behind comes to them in the :class:`~tokenmill.gateway.routing.
RouteQuery`, and the deployment (:mod:`tokenmill.gateway.deployment`) keeps it here:
:meth:`RouteHistory.recall` fills a query in before a policy chooses,
:meth:`RouteHistory.record` remembers what it chose (:meth:`RouteHistory.choose`
does both around a policy's choice). Two things are remembered:

* each session's last replica (``user`` or ``x-session-id``: ``cache_aware``'s
  affinity hint when no cache is known), the least recently routed forgotten first;
* the replica chosen last (``round_robin``'s turn).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

from tokenmill.gateway.routing import Decision, ReplicaView, RouteQuery, RoutingPolicy

# Sessions remembered, the least recently routed forgotten first (an entry is ~150
# bytes: 10k sessions cost ~1.5 MB a deployment).
SESSIONS_KEPT = 10_000


class RouteHistory:
    def __init__(self, sessions_kept: int = SESSIONS_KEPT) -> None:
        self.sessions_kept = sessions_kept
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._last = -1

    def choose(
        self, policy: RoutingPolicy, replicas: Sequence[ReplicaView], query: RouteQuery
    ) -> Decision:
        """``policy``'s decision for ``query`` as remembered (:meth:`recall`), then
        remembered (:meth:`record`)."""
        query = self.recall(query)
        decision = policy.choose(replicas, query)
        self.record(query, decision)
        return decision

    def recall(self, query: RouteQuery) -> RouteQuery:
        """``query`` with what is remembered for it: its session's last replica, and
        the replica chosen last."""
        home = None if query.session is None else self._sessions.get(query.session)
        return dataclasses.replace(query, session_home=home, last_index=self._last)

    def record(self, query: RouteQuery, decision: Decision) -> None:
        """Remember that ``query`` went to ``decision.index``."""
        self._last = decision.index
        if query.session is None:
            return
        self._sessions[query.session] = decision.index
        self._sessions.move_to_end(query.session)
        if len(self._sessions) > self.sessions_kept:
            self._sessions.popitem(last=False)

    def __len__(self) -> int:
        """The sessions remembered."""
        return len(self._sessions)


__all__ = ["SESSIONS_KEPT", "RouteHistory"]
