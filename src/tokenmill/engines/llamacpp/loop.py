"""The decode loop: one thread, one ``llama_decode`` a step, every running choice in it.

Each step the loop admits queued requests whole (all of a request's choices get a
slot at once), ends the cancelled ones, builds one batch holding the next token of
every decoding choice plus a chunk of pending prompt tokens sized to a step-time
budget, shortest prompt first (:mod:`.prefill`, :mod:`.batch`),
decodes it, samples every choice (:mod:`.outputs`) and hands the step's chunks to
the sink in one call. ctypes releases the GIL inside llama.cpp, so the event loop
keeps serving while a step runs. Between steps it runs a bounded batch of embedding
inputs; when idle for ``WARM_AFTER_S`` after a chat's answer, that chat's next turn
(:class:`~.slotcache.WarmUp`).

The loop schedules and steps; its parts do the rest, and each field of a
:class:`~.choices.Choice` has its writers named here:

* :mod:`.kvslots` places each choice's KV cells (``slot``, ``cached``, and ``n_past``
  where the choice starts: the cached prefix);
* :mod:`.swapper` keeps a shared pool from overflowing: a step that would first gives
  up cached cells of free slots, then swaps the newest running choices out to host
  memory and resumes them, bit for bit where they stopped, before anything new is
  admitted (``swapped``);
* :mod:`.speculator` plans each step's drafts (with :mod:`.drafting`; :mod:`.batch`
  cuts a draft to the step's room), verifies them and weighs them by the measured
  step costs (``spec``, ``draft``);
* the loop itself advances each choice (``n_past`` from there on, ``generated``,
  ``last_token``, ``done``, ``sampler``, ``greedy``, ``followers``, ``leader``);
  :mod:`.admission` ends a request withdrawn from the queue (``done``).

Nothing a choice has generated or will be billed for changes by a swap or a draft.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import llama_cpp as ll

from tokenmill.engines.base import Chunk, FinishReason, TokenLogprob
from tokenmill.engines.llamacpp.admission import RequestQueue
from tokenmill.engines.llamacpp.batch import BatchPlan, plan_batch
from tokenmill.engines.llamacpp.choices import Choice, Group
from tokenmill.engines.llamacpp.context import LlamaContext
from tokenmill.engines.llamacpp.counters import Counters
from tokenmill.engines.llamacpp.embedder import Embedder
from tokenmill.engines.llamacpp.kvslots import KvSlots
from tokenmill.engines.llamacpp.logits import LogitRow
from tokenmill.engines.llamacpp.outputs import OutputRows
from tokenmill.engines.llamacpp.prefill import RowCost
from tokenmill.engines.llamacpp.sampling import build_sampler, only_greedy
from tokenmill.engines.llamacpp.speculator import Events, Speculator
from tokenmill.engines.llamacpp.swapper import Swapper
from tokenmill.engines.llamacpp.threads import ThreadTuner
from tokenmill.engines.logprobs import finite
from tokenmill.errors import EngineError

T = TypeVar("T")

__all__ = ["PREFILL_CHUNK", "WARM_AFTER_S", "DecodeLoop"]

log = logging.getLogger("tokenmill.engines.llamacpp")

# Tokens of prompt prefilled per step across all sequences at most (the batch is sized
# for it): a step's share is sized to a time budget by measured step costs (prefill.py),
# this whole chunk only where rows are that cheap, or before any step is measured.
PREFILL_CHUNK = 512
# Seconds after a foreground request arrived during which background-only steps
# (Batch API lines) are each followed by as long a pause: the gateway's batch runner
# keeps to its share of the slots for as long (tokenmill.gateway.idle.QUIET_S).
YIELD_S = 10.0
# A chat's answer finished and nothing else to do for this long: the engine computes
# what the template writes before the next user message (see ``KvSlots.warm``). A
# person takes seconds to answer; a program that sends its next request at once
# arrives well before this and is never kept waiting by it.
WARM_AFTER_S = 0.2

# Where they go: (request id, chunk or error), one call per step.
Post = Callable[[list[tuple[str, Chunk | BaseException]]], None]

# The aborts of a step that has none (never added to: cancel() adds to loop._aborts).
_NO_ABORTS: set[str] = set()


class DecodeLoop:
    """Runs requests on ``context`` until stopped; :meth:`run` is the thread's body.

    ``cv`` guards the queue and the aborts (and the embedder's jobs): callers on other
    threads use :meth:`enqueue` and :meth:`cancel`.
    """

    def __init__(
        self,
        context: LlamaContext,
        kv: KvSlots,
        *,
        cv: threading.Condition,
        post: Post,
        counters: Counters,
        first_marks: dict[str, tuple[float, ...]],
        tuner: ThreadTuner | None,
        embedder: Embedder | None,
        speculate: bool = False,
        always_draft: bool = False,
    ) -> None:
        self.context = context
        self.kv = kv
        self.cache = kv.cache
        self.rows = OutputRows(context)
        self.cv = cv
        self._post_events = post
        self.counters = counters
        # Request id -> the marks of its first token (queued, picked, decoded, sampled:
        # tokenmill.stages), until the sink sends them with the token.
        self.first_marks = first_marks
        self._tuner = tuner
        self._n_threads = context.threads
        # When a foreground request last arrived (monotonic; guarded by cv): until
        # YIELD_S after it, background-only steps are followed by a pause (_pause).
        self._foreground_at = -math.inf
        self._pause_s = 0.0  # the pause owed after the last step
        self._embedder = embedder
        # Speculative decoding (speculative = "ngram", or a request's own choice):
        # drafts by prompt lookup, verified in the step, as long as the measured costs
        # of ubatches (from the steps while drafting is on) say it pays.
        self.speculator = Speculator(
            context, kv.cache, counters, speculate=speculate, always=always_draft
        )
        # What a step costs by its rows: how many prompt tokens fit a step's budget.
        self.row_cost = RowCost()
        self._requests = RequestQueue()  # guarded by cv
        self._aborts: set[str] = set()
        self.running: dict[str, Choice] = {}  # by key, in arrival order
        # Choices swapped out of a full pool, and the moves in and out (swapper.py).
        self.swapper = Swapper(context, kv, counters)
        self._stop = False
        self.failed: BaseException | None = None
        # Work for the decode thread between two steps (see call()); guarded by cv.
        self._jobs: deque[tuple[Callable[[], Any], Future[Any]]] = deque()

    @property
    def swapped(self) -> dict[str, Choice]:
        """Choices swapped out of a full pool, by key, in the order they were."""
        return self.swapper.swapped

    @property
    def waiting(self) -> int:
        """Requests queued for slots."""
        return self._requests.waiting

    # -- other threads' side -----------------------------------------------------------

    def enqueue(self, group: Group) -> None:
        group.marks.append(time.monotonic())
        with self.cv:
            if self.failed is not None:
                raise EngineError(f"the engine failed: {self.failed}")
            self._requests.push(group)
            if not group.members[0].background:
                self._foreground_at = group.marks[-1]
            self.cv.notify()

    def cancel(self, request_id: str) -> None:
        with self.cv:
            self._aborts.add(request_id)
            self.cv.notify()

    def stop(self) -> None:
        with self.cv:
            self._stop = True
            self.cv.notify()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the decode thread between two steps (it may touch the context
        and the slots); its result, or its exception, in the future."""
        future: Future[T] = Future()
        with self.cv:
            if self.failed is not None or self._stop:
                future.set_exception(EngineError("the engine is not running"))
                return future
            self._jobs.append((fn, future))
            self.cv.notify()
        return future

    def _run_jobs(self) -> None:
        with self.cv:
            jobs, self._jobs = self._jobs, deque()
        for fn, future in jobs:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:
                    future.set_exception(e)

    # -- the decode thread -------------------------------------------------------------

    def run(self) -> None:
        cv, embedder, requests = self.cv, self._embedder, self._requests
        try:
            while True:
                warm = None
                with cv:
                    while (
                        not self._stop
                        and not requests.waiting
                        and not self.running
                        and not self.swapped
                        and not self._jobs
                        and not (embedder and embedder.jobs)
                    ):
                        self._aborts.clear()
                        if self.cache.warm_up is None:
                            cv.wait()
                        elif not cv.wait(WARM_AFTER_S):
                            warm, self.cache.warm_up = self.cache.warm_up, None
                            break
                    if self._stop:
                        break
                if warm is not None:
                    self.kv.warm(warm)
                    continue
                if self._jobs:
                    self._run_jobs()
                if self.swapped:
                    self.swapper.resume(self.running)
                with cv:
                    admitted = self._admit_locked()
                    aborts: set[str] = _NO_ABORTS
                    if self._aborts:
                        aborts, self._aborts = self._aborts, set()
                events: Events = []
                # When this round takes every free slot, no step will see a gap. (Not
                # counted on the steps that admit nothing: most of them.)
                fills = bool(admitted) and len(admitted) == self.cache.free_slots()
                for i, seq in enumerate(admitted):
                    # Requests about to need a slot: this round's rest and the queue.
                    waiting = len(admitted) - i - 1 + requests.waiting
                    self.kv.assign(seq, pending=waiting, fills=fills)
                    seq.sampler = build_sampler(seq.sampling, self.context.vocab.n_tokens)
                    seq.greedy = only_greedy(seq.sampling)
                    self.speculator.start(seq)
                    self.running[seq.key] = seq
                for rid in aborts:
                    self._abort(rid, events)
                if self.running:
                    self._step(events)
                if embedder and embedder.jobs:
                    embedder.step()  # one bounded batch of embedding inputs
                if events:
                    self._post(events)
                if self._pause_s:
                    self._pause()
        except BaseException as e:  # a native failure: fail every request, loudly
            log.exception("decode loop failed")
            with cv:
                self.failed = e
                pending = requests.pending()
                requests.clear_queued()
            self._post([(s, EngineError(f"the engine failed: {e}")) for s in pending])
        finally:
            failed: Events = [
                (seq, EngineError("the engine is shutting down")) for seq in requests.pending()
            ]
            self.running.clear()
            self.swapped.clear()
            requests.clear()
            if failed:
                self._post(failed)
            if embedder is not None:
                embedder.fail_all(EngineError("the engine is shutting down"))
            with cv:
                jobs, self._jobs = self._jobs, deque()
            for _, future in jobs:
                if future.set_running_or_notify_cancel():
                    future.set_exception(EngineError("the engine is shutting down"))

    def _pause(self) -> None:
        """Idle as long as the background-only step before took, unless anything comes
        (a request, a cancel, a job): a foreground request that arrives then starts at
        once instead of waiting for a step under way."""
        pause, self._pause_s = self._pause_s, 0.0
        requests = self._requests
        with self.cv:
            self.cv.wait_for(
                lambda: self._stop or requests.waiting or self._aborts or self._jobs, pause
            )

    def _background_only(self, plan: BatchPlan) -> bool:
        """Whether this step is background work only (Batch API lines) while
        foreground requests come (the last within ``YIELD_S``)."""
        if time.monotonic() - self._foreground_at > YIELD_S:
            return False
        return all(seq.background for seq, _ in plan.outputs) and all(
            seq.background for seq, _ in plan.prefills
        )

    def _admit_locked(self) -> list[Choice]:
        """Requests, first come first served, while all of a request's choices fit
        (slots, and cells of a unified pool); none while a choice waits swapped out."""
        if not self._requests.waiting or self.swapped:
            return []
        self.cache.warm_up = None  # not idle: whatever comes next is not worth waiting for
        cells = None
        if self.context.unified:
            busy = sum(len(s.tokens) for s in self.cache.slots if s.seq is not None)
            cells = self.context.pool_tokens - busy
        return self._requests.admit(self.cache.free_slots(), now=time.monotonic(), cells=cells)

    def _abort(self, request_id: str, events: Events) -> None:
        """End a cancelled request: every choice if it runs, or its place in the queue."""
        group = self._requests.running(request_id)
        if group is not None:
            for seq in group.members:
                self._finish(seq, "abort", events)
            return
        with self.cv:
            group = self._requests.withdraw(request_id)
        if group is not None:
            last = group.members[-1]
            events.append((last, Chunk("", "abort", group.usage(), index=last.index)))

    def _prompt_rows(self, capacity: int) -> int:
        """The prompt tokens this step may read. In the shared pool: what the step-time
        budget leaves beside the decoding choices, by the measured cost of steps (see
        prefill.py). With a KV stream a slot, PREFILL_CHUNK whatever the measured speed:
        that layout keeps what else runs out of an answer, and llama.cpp's matrix kernels
        sum a piece of another size in another order (test_host_tier's parked
        conversation parted under load when the budget split its prompt)."""
        if not self.context.unified:
            return PREFILL_CHUNK
        decoding, shortest = 0, None
        for s in self.running.values():
            if s.prefilled:
                decoding += 1
            elif s.leader is None:
                left = len(s.prompt) - s.n_past
                shortest = left if shortest is None else min(shortest, left)
        return self.row_cost.chunk(
            decoding, capacity=min(capacity, PREFILL_CHUNK + decoding), shortest=shortest
        )

    def _step(self, events: Events) -> None:
        begun = time.monotonic()
        context = self.context
        capacity = context.batch_cap
        chunk = self._prompt_rows(capacity)
        if context.unified:
            capacity = min(capacity, self.swapper.fit(self.running, chunk))
        speculating = self.speculator.plan(self.running.values())
        plan = plan_batch(self.running.values(), prefill_chunk=chunk, capacity=capacity)
        if not plan.rows:
            return
        for i, (token, pos, slot, logits) in enumerate(plan.rows):
            context.add(i, token, pos, slot, logits)
        for seq, end in plan.prefills:
            self.cache.extend(seq.slot, seq.prompt[seq.n_past : end])
            seq.n_past = end
        n = len(plan.rows)
        tuner = self._tuner
        threads = self._n_threads if tuner is None else tuner.threads_for(n)
        context.set_threads(threads)
        started = time.monotonic()
        rc = context.decode(n)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        seconds = context.decoded_at - started
        self.row_cost.observe(n, seconds)
        if tuner is not None:
            tuner.observe(threads, n, seconds)
        if self._background_only(plan):
            # Background work takes at most half the engine's time while foreground
            # requests come: a step under way is what their first token waits for.
            self._pause_s = context.decoded_at - started
        self.counters.steps += 1
        for seq, idx in plan.prompt_rows:
            self.rows.record_prompt_row(seq, idx)
        for seq, idx in plan.outputs:
            # Read before sampling: the model's own distribution, untouched by it.
            logprobs = None if seq.aligner is None else self.rows.row(idx)
            if seq.followers:  # the prompt is in: the other choices start from here
                for follower in seq.followers:
                    if not follower.done:
                        self._start_follower(follower, seq)
                        self._advance(follower, idx, logprobs, events)
                seq.followers = []
            drafts = plan.drafts.get(seq.key)
            if drafts:
                self.speculator.verify(seq, [idx, *drafts], events, self._draw)
            else:
                self._advance(seq, idx, logprobs, events)
        self.speculator.end_step(plan, time.monotonic() - begun, speculating)

    def _draw(self, seq: Choice, idx: int, events: Events) -> int | None:
        """A drafting choice's token from output ``idx``, written to ``events``; None
        where the choice ended with it (see Speculator.verify)."""
        logprobs = None if seq.aligner is None else self.rows.row(idx)
        token = self.rows.sample(seq, idx)
        self._emit(seq, token, logprobs, events)
        return None if seq.done else token

    def _start_follower(self, seq: Choice, leader: Choice) -> None:
        """``leader`` has decoded the prompt: ``seq`` takes a copy of its KV cells.

        The leader's first token is sampled but not decoded yet, so the copy is the
        prompt.
        """
        self.kv.share(leader.slot, seq.slot)
        seq.n_past = len(seq.prompt)
        seq.leader = None
        seq.prompt_logprobs = leader.prompt_logprobs

    def _advance(self, seq: Choice, idx: int, logprobs: LogitRow | None, events: Events) -> None:
        """Sample ``seq``'s next token from output ``idx`` and pass its text on."""
        if seq.echo_pending:
            seq.echo_pending = False
            events.append((seq, self.rows.echo(seq)))
        self._emit(seq, self.rows.sample(seq, idx), logprobs, events)

    def _emit(
        self, seq: Choice, token: int | None, logprobs: LogitRow | None, events: Events
    ) -> None:
        """``seq`` sampled ``token`` (None: its constraint allowed none): count it,
        pass its text on, and end the choice where it ends."""
        group = seq.group
        assert group is not None
        if token is None:
            self._finish(seq, "stop", events)
            return
        if seq.n_past > len(seq.prompt) or seq.generated > 0:
            # the previous sampled token is now in the KV cache
            self.cache.append(seq.slot, seq.last_token)
        vocab, grammar = self.context.vocab, seq.grammar
        if not seq.sampling.ignore_eos and vocab.is_eog(token):
            # The end of the answer is a token the model generated: counted and given
            # its log probability as vLLM and llama-server do, but never text. It is
            # not decoded, so the slot's cells end before it (the next-turn warm-up
            # writes the template's own end of turn there).
            self._count(seq)
            eos = None
            if seq.aligner is not None and logprobs is not None:
                top = self.rows.top(logprobs, seq.sampling.logprobs or 0)
                piece = vocab.piece(token, special=True)
                eos = TokenLogprob(piece, finite(logprobs.logprob(token)), seq.stream.decoded, top)
            self._finish(seq, "stop", events, eos=eos)
            self._plan_warm(seq, ())
            return
        if grammar is not None and not grammar.consume(token):
            log.warning("request %s: grammar refused a token: %s", seq.request_id, grammar.error)
            self._finish(seq, "stop", events)
            return
        self._count(seq)
        seq.last_token = token
        seq.n_past = len(seq.prompt) + seq.generated - 1
        if seq.spec is not None:
            seq.spec.index.append(token)
        piece = vocab.piece(token)
        text = seq.stream.feed(piece)
        if seq.aligner is not None and logprobs is not None:
            top = self.rows.top(logprobs, seq.sampling.logprobs or 0)
            stream = seq.stream
            seq.aligner.add(piece, logprobs.logprob(token), top, stream.decoded, stream.partial)
        if seq.stream.stopped or (grammar is not None and grammar.done):
            # (A complete grammar that allows nothing more is the end of the answer,
            # even at max_tokens: the output is whole.)
            self._finish(seq, "stop", events, text)
        elif seq.generated >= seq.sampling.max_tokens or (
            len(seq.prompt) + seq.generated >= self.context.n_ctx_seq
        ):
            self._finish(seq, "length", events, text + seq.stream.finish())
            self._plan_warm(seq, (token,))  # the last token, sampled, never decoded
        else:
            released = () if seq.aligner is None else seq.aligner.release(len(text))
            if text or released:
                chunk = Chunk(text, tokens=group.generated, logprobs=released, index=seq.index)
                events.append((seq, chunk))

    def _count(self, seq: Choice) -> None:
        """``seq`` generated one more token (its request's, and the engine's)."""
        group = seq.group
        assert group is not None
        seq.generated += 1
        group.generated += 1
        self.counters.tokens_generated += 1
        if group.generated == 1:  # the request's first token
            marks = (*group.marks, self.context.decoded_at, time.monotonic())
            self.first_marks[group.request_id] = marks

    def _plan_warm(self, seq: Choice, head: tuple[int, ...]) -> None:
        """``seq``, a chat's answer, ended whole (EOS or max_tokens): its slot may
        compute ``head`` and what the template writes before the next user message,
        once the engine has nothing else to do (see ``KvSlots.warm``)."""
        if seq.next_turn:
            self.cache.plan_warm_up(seq.slot, (*head, *seq.next_turn))

    def _finish(
        self,
        seq: Choice,
        reason: FinishReason,
        events: Events,
        text: str = "",
        *,
        eos: TokenLogprob | None = None,
    ) -> None:
        """End ``seq``: its last ``text``, and ``eos``, the end-of-sequence token's log
        probability when it ended on one and asked for them."""
        if seq.done:
            return
        seq.done = True
        if reason == "stop" and not seq.stream.stopped:
            text += seq.stream.finish()
        self.running.pop(seq.key, None)
        self.swapper.forget(seq)  # cancelled while swapped out: its cells go
        self.kv.release(seq.slot)
        if seq.sampler is not None:
            ll.llama_sampler_free(seq.sampler)
            seq.sampler = None
        # Tokens still waiting now are those a stop string swallowed (or an abort cut).
        released = () if seq.aligner is None else seq.aligner.release(len(text))
        if eos is not None:  # after every token whose text went out
            released = (*released, eos)
        group = seq.group
        assert group is not None
        group.open -= 1
        matched = seq.stream.matched if reason == "stop" else None
        if group.open > 0:  # other choices go on: this one's end is not the request's
            chunk = Chunk(
                text,
                tokens=group.generated,
                logprobs=released,
                index=seq.index,
                choice_finish=reason,
                stop_sequence=matched,
            )
        else:
            self._requests.finished(group.request_id)
            chunk = Chunk(
                text,
                reason,
                group.usage(),
                group.generated,
                released,
                seq.index,
                stop_sequence=matched,
            )
        events.append((seq, chunk))

    def _post(self, events: list[tuple[Choice, Any]]) -> None:
        self._post_events([(seq.request_id, item) for seq, item in events])
