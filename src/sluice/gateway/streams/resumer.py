"""Continuing a streamed response another replica generated and lost (docs/streams.md, "Replica
takeover"): `StreamResumer` is what `StreamHolder` (streams/holder.py) calls with a stream it
claimed.

The log's typed checkpoints say where the stream stands: its `Envelope` (what every chunk repeats)
and, per event, the output token ids first sent with it, its text characters, its finish reason
and its kind. The request's state is rebuilt from them; the request is admitted again against the
tenant's quotas (the lost replica's hold was released by the lease sweep, charged as nothing: this
admission and its settlement, to the whole completion, are the request's only charge), dispatched
with `resume_token_ids` = the tokens logged, and a pump continues the log at its next sequence
number with the same envelope and no second role chunk. Followers on any replica see the rest. The
pump's disconnect grace applies as on the acceptor.

Usage: whoever ends a stream's log records its usage first. A claimed stream whose generation had
ended (or that is not continued) may or may not have had its usage written by the lost replica, so
the taker records it (the prompt and the tokens logged) before it ends the log; the usage table
counts a request id once (quotas/usage.py), so neither a loss nor a double count can happen.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Protocol

from sluice.gateway.auth.service import AuthService, TenantContext
from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.generation.service import GenerationService
from sluice.gateway.generation.state import Envelope, RequestState
from sluice.gateway.queueing.backend import Submission
from sluice.gateway.quotas.service import Reservation
from sluice.gateway.streams.frames import DONE, Framer
from sluice.gateway.streams.holder import MAX_TAKEOVERS, TAKEOVER_FAILED, Claimed, StreamHolder
from sluice.gateway.streams.hub import ABANDONED, StreamHub
from sluice.gateway.streams.log import EventKind, Mark
from sluice.gateway.streams.redis_log import RedisStreamLog
from sluice.protocol import FinishReason, GenerateRequest

log = logging.getLogger(__name__)

ADMIT_WAIT_S = 30.0  # a taken-over stream the quotas refuse (429, 503) is admitted again until this long


class Step(enum.Enum):
    """What a claimed stream needs (`plan`)."""

    NOTHING = "nothing"  # its end marker was written after all: nothing to do
    ABANDON = "abandon"  # no disconnect grace: its client went with the replica; the log ends, abandoned
    FAIL = "fail"  # lost too often, or its log has a gap or no envelope: the log ends with an error
    END = "end"  # it had ended ([DONE] or an error logged): only the end marker is written
    FINISH = "finish"  # its generation had ended; the finishing events are written from the state
    CONTINUE = "continue"  # generated further from its logged tokens, on a worker, by a pump here


def plan(request: GenerateRequest, claimed: Claimed) -> Step:
    """The step a claimed stream needs, from its log's checkpoints alone (no SSE text is read)."""
    if claimed.ended:
        return Step.NOTHING
    if claimed.grace_s == 0:
        return Step.ABANDON
    if claimed.takeovers > MAX_TAKEOVERS or not claimed.whole or claimed.envelope is None:
        return Step.FAIL
    if claimed.final:
        return Step.END
    if claimed.finish is not None or len(claimed.token_ids) >= request.sampling.max_tokens:
        return Step.FINISH
    return Step.CONTINUE


def rebuild(request: GenerateRequest, envelope: Envelope, claimed: Claimed) -> RequestState:
    """The stream's state as its log holds it; what follows goes on after its tokens."""
    tokens = claimed.token_ids
    state = RequestState(request=request, envelope=envelope, tenant_name=claimed.tenant, stream=True,
                         output_token_ids=list(tokens), num_logged_tokens=len(tokens),
                         text_chars=claimed.chars, finish_reason=claimed.finish)
    state.resume_after(tokens)
    return state


def tail(claimed: Claimed, framer: Framer) -> list[tuple[bytes, Mark]]:
    """The last events of a stream whose generation had ended before its replica was lost (a kill
    between the finishing chunk and [DONE]): the finishing chunk if it is missing, the usage chunk
    if it was asked for and is missing, [DONE]."""
    events: list[tuple[bytes, Mark]] = []

    def emit(frame: bytes, chars: int, finish: str | None) -> None:
        events.append((frame, Mark(EventKind.CHUNK, b"", chars, finish)))

    if claimed.finish is None:  # the last token's chunk went out, its finishing chunk did not
        framer.finishing(FinishReason.LENGTH, emit)
    usage = None if claimed.usage_sent else framer.usage()
    if usage is not None:
        events.append((usage, Mark(EventKind.USAGE)))
    events.append((DONE, Mark(EventKind.DONE)))
    return events


class ResumingBackend(Protocol):
    def resume(self, state: RequestState) -> Submission: ...

    def could_serve(self, model: str) -> bool: ...


class StreamResumer:
    def __init__(self, hub: StreamHub, generation: GenerationService, auth: AuthService, backend: ResumingBackend,
                 holder: StreamHolder) -> None:
        if not isinstance(hub.log, RedisStreamLog):
            raise ValueError("a replica takeover needs the stream log in Redis ([shared] url)")
        self.hub = hub
        self.log: RedisStreamLog = hub.log
        self.generation = generation
        self.auth = auth
        self.backend = backend
        self.holder = holder

    def can_continue(self, request: GenerateRequest) -> bool:
        return request.model in self.generation.tokenizers and self.backend.could_serve(request.model)

    async def __call__(self, request: GenerateRequest, claimed: Claimed) -> None:
        rid = request.request_id
        step = plan(request, claimed)
        if step is Step.NOTHING:
            return  # its end marker came late: the holder releases it at the next check
        if step is not Step.CONTINUE:  # it ends here: its usage first (a continued one's pump records it)
            await self._record_usage(request, claimed)
        if step is Step.ABANDON:  # `X-Sluice-Disconnect: abort`: its client's connection went with the replica
            log.info("stream %s: its replica was lost and it has no disconnect grace; not continued", rid)
            self.holder.end_with(claimed, ABANDONED)
            return
        if step is Step.FAIL:
            log.warning("stream %s: not continued (lost %d times, whole log: %s, envelope: %s); its log ends "
                        "with an error", rid, claimed.takeovers, claimed.whole, claimed.envelope is not None)
            self.holder.end_with(claimed, TAKEOVER_FAILED)
            return
        if step is Step.END:
            self.holder.end_with(claimed, None)  # it had ended: only its end marker was missing
            return
        assert claimed.envelope is not None  # plan() fails a claim without one
        state = rebuild(request, claimed.envelope, claimed)
        framer = Framer(state, self.generation.tokenizers.get(request.model), resumed=claimed.next_seq > 0)
        if step is Step.FINISH:
            self.log.adopt(rid, claimed.tenant, claimed.next_seq, claimed.key)
            for frame, mark in tail(claimed, framer):
                self.log.append(rid, frame, mark)
            self.log.end(rid)
            return
        await self._continue(claimed, state, framer)

    async def _record_usage(self, request: GenerateRequest, claimed: Claimed) -> None:
        """The usage of a stream that ends here, as its log holds it (counted once: module docstring)."""
        usage = self.generation.usage
        written = usage.record(request.request_id, request.tenant_id, request.model,
                               len(request.prompt_token_ids), len(claimed.token_ids))
        await usage.written(written, request.request_id)

    async def _continue(self, claimed: Claimed, state: RequestState, framer: Framer) -> None:
        request = state.request
        tenant = await self.auth.tenant_by_id(request.tenant_id)
        if tenant is None or not tenant.enabled:
            raise ValueError(f"tenant {request.tenant_id} is gone or disabled")
        state.tenant_name = tenant.name
        state.reservation = await self._admit(tenant, request)
        try:
            submission = self.backend.resume(state)
        except BaseException:
            self.generation.quotas.release(state.reservation)
            raise
        flight = self.generation.fly(state, tenant, submission)
        self.log.adopt(claimed.response_id, claimed.tenant, claimed.next_seq, claimed.key)
        grace_s = claimed.grace_s  # as its POST chose it, else as the tenant's now
        if grace_s is None:
            grace_s = self.hub.grace_s if tenant.disconnect_grace_s is None else tenant.disconnect_grace_s
        self.hub.start(flight, framer, grace_s)

    async def _admit(self, tenant: TenantContext, request: GenerateRequest) -> Reservation:
        """The quota admission of the resumed request, as the acceptor's was (prompt + max_tokens);
        a refusal that waiting may lift (429 with a retry time, 503) is retried, for a while."""
        quotas = self.generation.quotas
        loop = asyncio.get_running_loop()
        give_up = loop.time() + ADMIT_WAIT_S
        while True:
            try:
                return await quotas.admit(tenant, len(request.prompt_token_ids), request.sampling.max_tokens,
                                          request.priority)
            except OpenAIError as exc:
                retry_after = getattr(exc, "retry_after", 1)
                if exc.status not in (429, 503) or retry_after is None or loop.time() > give_up:
                    raise
                await asyncio.sleep(min(max(float(retry_after), 0.2), 2.0))



