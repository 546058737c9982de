"""A `Flight`: one accepted client request on its way in this process, and the one way it ends.

The flight joins the request's record (`RequestState`, generation/state.py) to what drives it
here: the submission its deltas come from, the deadline (`gateway.request_timeout_s` from its
acceptance, the wait for a worker included), and its settlement. Whoever reads the answer (a
stream's pump, streams/hub.py; a whole answer's collector, generation/answers.py) listens to it
and awaits `ended()`; however the request ends (its final delta, the deadline, a disconnect, a
shutdown), `finish()` runs exactly once: it settles the quota reservation to the tokens actually
produced (or releases it when the request timed out before producing any), records usage (written
in the next group commit; `settled()` waits for it, so an answer ends only once its usage is
durable), and the abort and the telemetry record in the background.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sluice import telemetry
from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.generation.state import RequestState
from sluice.protocol import RequestDelta

if TYPE_CHECKING:
    from sluice.gateway.auth.service import TenantContext
    from sluice.gateway.generation.service import GenerationService
    from sluice.gateway.queueing.backend import Submission

log = logging.getLogger(__name__)


class RequestTimedOut(OpenAIError):
    """The request did not end within `gateway.request_timeout_s` of its acceptance (waiting for
    a worker included): 504 before the answer started, an error event in a stream after."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            504,
            f"The request did not complete within {timeout_s:g}s (waiting for a worker included); "
            "it was stopped and nothing was charged for what did not run.",
            type="timeout",
            code="request_timeout",
        )


class Flight:
    """One accepted request in this process (module docstring)."""

    __slots__ = ("_deadline", "_ended", "_running", "_timer", "_usage", "finished", "pump", "service", "state",
                 "submission", "tenant", "timed_out")

    def __init__(self, service: GenerationService, state: RequestState, tenant: TenantContext,
                 submission: Submission, *, deadline: float = math.inf) -> None:
        self.service = service
        self.state = state
        self.tenant = tenant
        self.submission = submission
        self.finished = False
        self.timed_out = False
        self.pump: Any = None  # a streamed answer's pump while it runs (streams/hub.py)
        self._running = False  # the quota ledger was told it runs (its first output)
        self._ended: asyncio.Future[None] | None = None
        self._usage: asyncio.Future[None] | None = None  # its usage written (`finish`)
        loop = asyncio.get_running_loop()
        # One timer per request resolves `_deadline`; every wait races it (no timer per wait).
        self._deadline: asyncio.Future[None] = loop.create_future()
        self._timer = loop.call_at(deadline, self._expire) if math.isfinite(deadline) else None

    @property
    def request_id(self) -> str:
        return self.state.request.request_id

    def _expire(self) -> None:
        self._timer = None
        if not self.finished and not self._deadline.done():
            self._deadline.set_result(None)

    async def _within_deadline(self, waited: asyncio.Future[Any]) -> None:
        """Until `waited` is done; `RequestTimedOut` once the deadline passes first (a cancel, a
        disconnect's, propagates and leaves `waited` as it is)."""
        if not waited.done():
            await asyncio.wait((waited, self._deadline), return_when=asyncio.FIRST_COMPLETED)
        if not waited.done():
            self.timed_out = True
            raise RequestTimedOut(self.service.request_timeout_s)
        waited.result()  # its exception, if any

    async def first_delta(self) -> None:
        """Until the first delta arrived (it is not taken: `listen` gets it), within the deadline:
        a stream's answer starts only then, so an expiry before it is an HTTP error."""
        await self._within_deadline(self.submission.first())

    def listen(self, on_delta: Callable[[RequestDelta], None]) -> None:
        """Each delta (those that came before first) to `on_delta`, within its delivery (the
        dispatcher's or the upstream reader's call: no task step per token). The final delta, or an
        exception from `on_delta`, ends the wait of `ended()`."""
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._ended = ended

        def deliver(delta: RequestDelta) -> None:
            if ended.done():
                return  # a late delta after an exception, a timeout or an abort
            if not self._running and self.state.has_output:
                self._running = True
                if self.state.reservation is not None:
                    self.service.quotas.mark_running(self.state.reservation)
            try:
                on_delta(delta)
            except Exception as exc:  # never into the deliverer (the dispatcher, the upstream reader)
                ended.set_exception(exc)
                return
            if delta.finish_reason is not None:
                ended.set_result(None)

        self.submission.listen(deliver)

    async def ended(self) -> None:
        """Until the final delta was delivered to the listener; `RequestTimedOut` at the deadline."""
        if self._ended is None:
            raise RuntimeError(f"{self.request_id}: nothing listens to this flight")
        await self._within_deadline(self._ended)

    def finish(self, *, aborted: bool = False) -> None:
        """Settles the reservation now; the abort (when asked), usage and the record in the background."""
        if self.finished:
            return
        self.finished = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._ended is not None and self._ended.done() and not self._ended.cancelled():
            self._ended.exception()  # retrieved: an exception nobody waited for is not logged as lost
        state, service = self.state, self.service
        service.flights.remove(self.request_id, self)
        if aborted and state.finish_reason is None:
            state.finish_reason = "timeout" if self.timed_out else "abort"
        reservation = state.reservation
        if reservation is not None:
            if self.timed_out and not state.has_output:
                service.quotas.release(reservation)  # it never ran: nothing is charged
            else:
                service.quotas.settle(reservation, state.billed_prompt_tokens, state.num_output_tokens)
        self._usage = service.usage.record(self.request_id, self.tenant.id, state.request.model,
                                           state.billed_prompt_tokens, state.num_output_tokens,
                                           requests=int(state.bills_request))
        service.spawn(self._after(aborted))

    async def settled(self) -> None:
        """After `finish()`: waits until the quota ledger has applied it (a shared ledger applies
        it in the background), so the client's next request, on any replica, finds it ended; and
        until its usage is written (`UsageService.written`)."""
        if self.state.reservation is not None:
            await self.service.quotas.settled(self.state.reservation)
        await self.service.usage.written(self._usage, self.request_id)

    async def _after(self, aborted: bool) -> None:
        state = self.state
        if aborted:
            try:
                await self.submission.abort()
            except Exception:
                log.warning("abort of %s failed", self.request_id, exc_info=True)
        try:
            telemetry.emit_record(state.record(), state.token_times)
        except Exception:
            log.warning("could not emit the record of %s", self.request_id, exc_info=True)
