"""What one request holds before and while it streams, taken and given back in one place.

A request is admitted in steps, each of which takes one thing into its
:class:`Reservation`: :meth:`~Reservation.admit` an admission permit,
:meth:`~Reservation.place` a replica's slots, :meth:`~Reservation.hold` the credit
(:meth:`~Reservation.prepare` takes nothing, it learns the prompt). Whichever step
fails, or wherever the caller is cancelled, :meth:`Reservation.release` gives back
exactly what was taken, newest first, and nothing twice (the shape of
``contextlib.AsyncExitStack`` and of trio's nurseries: no hand-written rollback per
step). Once every step succeeded, :meth:`Reservation.books` hands what is held to the
stream as its :class:`Books`: the capacity, released once when the stream ends, and
the hold, settled once on the tokens really produced.

Nothing here may leave a hold open: a hold the caller gave up on halfway is written
whole and then settled unbilled, never abandoned to the ledger's sweeper.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable
from typing import TypeVar

from tokenmill.config import Price
from tokenmill.engines import GenerationRequest, PromptInfo
from tokenmill.errors import ContextLengthError, InvalidRequestError
from tokenmill.gateway.deployment import Deployment
from tokenmill.gateway.records import RequestRecord
from tokenmill.gateway.replicaset import Replica
from tokenmill.gateway.routing import RouteQuery
from tokenmill.metering import HoldRequest, Meter, Progress, Settlement, cost, discount_for
from tokenmill.replicas import ReplicaHost

T = TypeVar("T")


async def shielded(aw: Awaitable[T]) -> T:
    """Run ``aw`` to completion even if the caller is cancelled meanwhile."""
    task = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


class Reservation:
    """The permit, the replica and the hold of one request, as far as it got.

    ``request`` is the request as the steps left it: a placed request carries its
    token ids to a replica other than the one that counted them, and a held one its
    ``max_tokens``.
    """

    def __init__(
        self,
        deployment: Deployment,
        request: GenerationRequest,
        record: RequestRecord,
        meter: Meter,
        *,
        up_to_window: bool = False,
    ) -> None:
        self.deployment = deployment
        self.request = request
        # max_tokens past what the context leaves asks for the rest of the window
        # (Anthropic's Messages) instead of a 400.
        self._up_to_window = up_to_window
        self.record = record
        self._meter = meter
        self._caller = record.caller
        self._weight = request.choices
        self._permit = False
        self._replica: Replica | None = None
        self._hold: HoldRequest | None = None
        self._preparer: ReplicaHost | None = None

    # -- the steps, in order; each takes one thing -------------------------------------

    async def admit(self) -> None:
        """Take the admission permit: the request's slots in the deployment (it may
        queue for them; a full queue or the account's cap refuses it: 429)."""
        config = self.deployment.config
        if self._weight > config.max_num_seqs:
            raise InvalidRequestError(
                f"the request asks for {self._weight} choices (n times the prompts); a "
                f"replica of {self.deployment.id!r} generates at most {config.max_num_seqs} "
                "at once",
                param="n",
            )
        tenant = self._caller.tenant()
        self.record.queue_s = await self.deployment.admission.acquire(self._weight, tenant)
        self._permit = True
        self.record.marks["admitted"] = time.monotonic()

    async def prepare(self) -> PromptInfo:
        """Render, tokenize and check the prompt once, on any serving replica. Takes
        nothing: while it runs, the deployment counts it preparing (an idle replica
        must not unload under it)."""
        deployment = self.deployment
        deployment.preparing += 1
        try:
            self._preparer = await deployment.any_host()
            try:
                info = await self._preparer.prepare(self.request)
            except ContextLengthError as e:
                if not self._up_to_window or e.param != "max_tokens":
                    raise
                # The rest of the window (max_tokens 0), which hold() takes: still a
                # ContextLengthError if the prompt alone fills it.
                sampling = dataclasses.replace(self.request.sampling, max_tokens=0)
                self.request = dataclasses.replace(self.request, sampling=sampling)
                info = await self._preparer.prepare(self.request)
        finally:
            deployment.preparing -= 1
        self.record.marks["prepared"] = time.monotonic()
        self.record.prompt_tokens = info.prompt_tokens
        deployment.admission.serve(self._caller.account_id, info.prompt_tokens)
        return info

    async def place(self, info: PromptInfo, session: str | None = None) -> None:
        """Take a replica's slots: the routing policy chooses it with the prompt's
        token ids in hand (``session``: an affinity hint)."""
        request = self.request
        prompt = info.tokens[0] if info.tokens else ()
        query = RouteQuery(
            info.prompt_tokens, self._weight, request.sampling.max_tokens, session=session
        )
        self._replica, self.record.route = await self.deployment.place(
            request.request_id, query, prompt
        )
        if self._replica.host is not self._preparer and info.tokens is not None:
            self.request = dataclasses.replace(request, tokenized=info.tokens)

    async def hold(self, info: PromptInfo) -> None:
        """Take the credit: the prompt and every choice running to ``max_tokens`` (not
        given: the rest of the context window, which the request then carries)."""
        request = self.request
        max_tokens = request.sampling.max_tokens
        if max_tokens <= 0:
            longest = info.longest_prompt or info.prompt_tokens
            max_tokens = info.context_length - longest
            sampling = dataclasses.replace(request.sampling, max_tokens=max_tokens)
            self.request = request = dataclasses.replace(request, sampling=sampling)
        # Every choice may run to max_tokens: the hold covers them all.
        most = max_tokens * self._weight
        discount = discount_for(self.deployment.config, self._caller)
        hold = HoldRequest(
            request_id=request.request_id,
            caller=self._caller,
            deployment=self.deployment.id,
            prompt_tokens=info.prompt_tokens,
            max_tokens=most,
            amount=cost(self.deployment.config.price, info.prompt_tokens, most, discount),
            discount=discount,
        )
        # A hold half-written when the caller gives up (a client leaving a stream that
        # waited behind keep-alive pings) would stay open until the sweeper: it is
        # written whole, and counted held, so that release() settles it unbilled.
        # (A hold refused meanwhile raises its refusal: nothing was held.)
        try:
            await shielded(self._meter.hold(hold))
        except asyncio.CancelledError:
            self._hold = hold
            raise
        self._hold = hold
        self.record.marks["held"] = time.monotonic()

    # -- letting go ------------------------------------------------------------------

    async def release(self) -> None:
        """Give back what the steps took, newest first (the request never streams).

        A hold is settled unbilled; a replica's engine forgets the request (a pool's
        replica holds slots for it) before its slots return; then the permit.
        """
        hold, self._hold = self._hold, None
        try:
            if hold is not None:
                unbilled = Settlement(hold.request_id, hold.prompt_tokens, 0, "abort", 0)
                await shielded(self._meter.settle(hold, unbilled))
        finally:
            replica, self._replica = self._replica, None
            if replica is not None:
                replica.host.cancel(self.request.request_id)
                self.deployment.release(replica, self._weight)
            if self._permit:
                self._permit = False
                self.deployment.admission.release(
                    weight=self._weight, account=self._caller.account_id
                )

    def books(self) -> Books:
        """Hand every step's take to the stream: the reservation holds nothing after."""
        replica, hold = self._replica, self._hold
        if replica is None or hold is None or not self._permit:
            raise RuntimeError("books() before every step of the reservation succeeded")
        self._replica, self._hold, self._permit = None, None, False
        return Books(self.deployment, replica, self._weight, hold, self._meter)


class Books:
    """A streaming request's capacity and credit: the capacity is released once, as
    the stream ends (:meth:`release_capacity`); the hold is settled once, on the tokens
    produced (:meth:`settle`), and meanwhile priced for progress (:meth:`progress`)."""

    def __init__(
        self,
        deployment: Deployment,
        replica: Replica,
        weight: int,
        hold: HoldRequest,
        meter: Meter,
    ) -> None:
        self.deployment = deployment
        self.replica = replica
        self.hold = hold
        self._weight = weight
        self._meter = meter
        self._released = False
        self._settled = False

    @property
    def price(self) -> Price | None:
        return self.deployment.config.price

    def charge(self, prompt_tokens: int, completion_tokens: int) -> int:
        """What these tokens cost (at the hold's discount), never more than was held."""
        price = cost(self.price, prompt_tokens, completion_tokens, self.hold.discount)
        return min(self.hold.amount, price)

    def progress(self, prompt_tokens: int, delivered: int) -> Progress:
        return Progress(self.hold.request_id, delivered, self.charge(prompt_tokens, delivered))

    def release_capacity(self, record: RequestRecord) -> None:
        """The replica's slots and the admission permit go back (once): first thing as
        a stream ends, before any slow bookkeeping."""
        if self._released:
            return
        self._released = True
        self.deployment.release(self.replica, self._weight)
        held_s = time.monotonic() - record.started - record.queue_s
        self.deployment.admission.release(held_s, self._weight, record.caller.account_id)

    async def settle(self, record: RequestRecord, *, dispatched: bool = True) -> None:
        """Charge the tokens ``record`` counts and release the rest of the hold (once).
        It survives the caller's cancellation: no token goes unbilled. A request never
        ``dispatched`` (its replica died as it was handed over) reached no engine: its
        prompt was never read, and nothing is charged."""
        if self._settled:
            return
        self._settled = True
        record.duration_s = time.monotonic() - record.started
        charged = self.charge(record.prompt_tokens, record.completion_tokens) if dispatched else 0
        settlement = Settlement(
            request_id=record.request_id,
            prompt_tokens=record.prompt_tokens,
            completion_tokens=record.completion_tokens,
            finish_reason=record.finish_reason,
            charged=charged,
        )
        record.charged = settlement.charged
        await shielded(self._meter.settle(self.hold, settlement))


__all__ = ["Books", "Reservation", "shielded"]
