"""Runs batch lines consumed from Kafka: the `BatchLineHandler` of `KafkaBackend` (queueing/batch_lines.py).

prepare(): skip a line whose result is already stored (a replay after a crash) or whose batch is
no longer runnable (a cancelled batch's line gets a `batch_cancelled` result instead); then admit
it under the tenant's quotas. A line over a rate limit is deferred for the limit's retry-after (it
is not failed, and other lines keep flowing); a line over the daily budget fails with
`insufficient_quota`.
start(): the line's `RequestState` (generation/state.py) and the sink that keeps its text.
persist(): store the line's output (or error) row, unique on (batch_id, custom_id), settle the
quota reservation, record usage, and finalize the batch when it was the last line. The result's
body is the same whole answer an HTTP client gets (generation/answers.py).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from sluice.gateway.admin.service import tenant_with_quota
from sluice.gateway.auth.service import TenantContext, tenant_context
from sluice.gateway.batches.models import Batch, BatchResult
from sluice.gateway.batches.service import (
    RUNNABLE,
    TENANT_DISABLED,
    TENANT_DISABLED_MESSAGE,
    BatchService,
    stopped_by_tenant_disabled,
)
from sluice.gateway.batches.views import line_number
from sluice.gateway.cluster.invalidation import Change
from sluice.gateway.db.base import utcnow
from sluice.gateway.dispatch.jobs import DeltaSink
from sluice.gateway.generation.answers import failure_message, whole_answer
from sluice.gateway.generation.prepare import CLASS_TO_TIER
from sluice.gateway.generation.state import Endpoint, RequestState
from sluice.gateway.queueing.batch_lines import Defer
from sluice.gateway.quotas.service import QuotaExceeded, QuotaService, Reservation
from sluice.gateway.quotas.usage import UsageService
from sluice.protocol import FinishReason, GenerateRequest, RequestDelta

log = logging.getLogger(__name__)

TENANT_CACHE_S = 30.0
MAX_RATE_WAIT_S = 60.0
_ABORT_MESSAGES = {
    "batch_cancelled": "The batch was cancelled.",
    TENANT_DISABLED: TENANT_DISABLED_MESSAGE,
}


def _abort_code(batch: Batch) -> str:
    """What a line of a cancelling batch is answered: its tenant was disabled, or it was cancelled."""
    return TENANT_DISABLED if stopped_by_tenant_disabled(batch) else "batch_cancelled"


@dataclass(slots=True)
class _Line:
    """What this runner keeps of a line between its preparation and its stored result."""

    endpoint: str
    reservation: Reservation | None
    tenant_name: str = ""
    texts: list[str] = field(default_factory=list)
    stored: bool | None = None  # None: its row is not stored yet; then whether this call inserted it
    abort_code: str = "batch_cancelled"  # the error an aborted line is answered with


class BatchRunner:
    def __init__(self, service: BatchService, quotas: QuotaService, usage: UsageService) -> None:
        self.service = service
        self.quotas = quotas
        self.usage = usage
        self._lines: dict[str, _Line] = {}
        self._tenants: dict[str, tuple[float, TenantContext]] = {}

    async def _tenant(self, tenant_id: str) -> TenantContext | None:
        cached = self._tenants.get(tenant_id)
        if cached is not None and time.monotonic() - cached[0] < TENANT_CACHE_S:
            return cached[1]
        async with self.service.sessions() as session:
            found = await tenant_with_quota(session, tenant_id)
        if found is None:
            return None
        context = tenant_context(*found)
        self._tenants[tenant_id] = (time.monotonic(), context)
        return context

    def forget_tenant(self, tenant_id: str) -> None:
        """Its settings changed (e.g. it was disabled): read them again next time."""
        self._tenants.pop(tenant_id, None)

    def on_change(self, change: Change) -> None:
        """The invalidation bus: a tenant changed on any replica (or everything may have)."""
        if change.kind == "tenant":
            self.forget_tenant(change.ident)
        elif change.kind == "everything":
            self._tenants.clear()

    def tenant_label(self, tenant_id: str) -> str:
        """The tenant's name for request records (its id if not cached)."""
        cached = self._tenants.get(tenant_id)
        return cached[1].name if cached is not None else tenant_id

    # ---- BatchLineHandler ----------------------------------------------------------------------

    async def prepare(self, request: GenerateRequest) -> bool | Defer:
        batch_id, custom_id = request.batch_id, request.custom_id
        if batch_id is None or custom_id is None:
            return False
        async with self.service.sessions() as session:
            batch = await session.get(Batch, batch_id)
            stored = await session.scalar(
                select(BatchResult.id).where(
                    BatchResult.batch_id == batch_id, BatchResult.custom_id == custom_id
                )
            )
        if batch is None or stored is not None:
            return False  # batch deleted, or a replay of a line already answered
        if batch.status not in RUNNABLE:
            if batch.status == "cancelling":
                code = _abort_code(batch)
                await self._store_error(request, code, _ABORT_MESSAGES[code])
            return False
        if utcnow() > batch.expires_at:  # past its completion window: answered, not run
            await self._store_error(request, "batch_expired",
                                    "The batch expired before this request could run.")
            return False
        tenant = await self._tenant(request.tenant_id)
        if tenant is None or not tenant.enabled:  # disabled meanwhile (by the admin API or not)
            await self.service.stop_tenant(request.tenant_id)
            await self._store_error(request, TENANT_DISABLED, TENANT_DISABLED_MESSAGE)
            return False
        reservation = await self._admit(tenant, request)
        if reservation is None:
            return False
        if isinstance(reservation, Defer):
            return reservation
        self._lines[request.request_id] = _Line(batch.endpoint, reservation, tenant.name)
        return True

    async def _admit(self, tenant: TenantContext, request: GenerateRequest) -> Reservation | Defer | None:
        try:
            return await self.quotas.admit(tenant, len(request.prompt_token_ids),
                                           request.sampling.max_tokens, request.priority)
        except QuotaExceeded as exc:
            if exc.retry_after is None:  # a budget, not a rate: waiting will not help today
                await self._store_error(request, exc.code or "insufficient_quota", exc.message)
                return None
            return Defer(min(float(exc.retry_after), MAX_RATE_WAIT_S))

    def start(self, request: GenerateRequest) -> tuple[RequestState, DeltaSink]:
        line = self._lines.get(request.request_id)
        state = self._state(request, line)
        texts = line.texts if line is not None else []

        def sink(delta: RequestDelta) -> None:
            if delta.text:
                texts.append(delta.text)

        return state, sink

    def failed(self, request: GenerateRequest, error: str) -> RequestState:
        state = self._state(request, self._lines.get(request.request_id))
        state.finish_reason, state.error = str(FinishReason.ERROR), error
        return state

    def _state(self, request: GenerateRequest, line: _Line | None) -> RequestState:
        endpoint: Endpoint = "text" if line is not None and line.endpoint == "/v1/completions" else "chat"
        tenant = line.tenant_name if line is not None and line.tenant_name else self.tenant_label(request.tenant_id)
        state = RequestState.of(request, CLASS_TO_TIER[request.priority], endpoint=endpoint, tenant_name=tenant)
        state.reservation = line.reservation if line is not None else None
        return state

    async def persist(self, state: RequestState) -> None:
        """Stores the line's result; raises when the database fails, and may then be called again
        with the same state: the line's output stays here until its row is stored, so a retry
        writes the real result, and the tokens are billed once, by the call that stored it."""
        request = state.request
        line = self._lines.get(request.request_id)
        if line is None:  # nothing prepared it here (e.g. a record this gateway could not route)
            line = self._lines[request.request_id] = _Line("", None)  # answered with an error
        if line.stored is None:
            if state.finish_reason == FinishReason.ABORT:
                async with self.service.sessions() as session:
                    batch = await session.get(Batch, request.batch_id)
                line.abort_code = _abort_code(batch) if batch is not None else "batch_cancelled"
            ran = state.ran
            prompt = state.num_prompt_tokens if ran else 0
            completion = state.num_output_tokens
            ok, result = self._result_line(state, line)
            if prompt or completion:  # written before the row: a line re-run after a kill counts once
                written = self.usage.record(request.request_id, request.tenant_id, request.model, prompt, completion)
                await self.usage.written(written, request.request_id)
            line.stored = await self._insert(request, ok, result)
            # Settled once, by the call that stored the row; a line that never ran (cancelled or
            # failed before dispatch) costs nothing.
            if line.reservation is not None:
                if ran:
                    self.quotas.settle(line.reservation, prompt, completion)
                else:
                    self.quotas.release(line.reservation)
        assert request.batch_id is not None  # batch lines only
        await self.service.maybe_finalize(request.batch_id)
        del self._lines[request.request_id]

    def _result_line(self, state: RequestState, line: _Line) -> tuple[bool, dict[str, Any]]:
        request = state.request
        if state.finish_reason == FinishReason.ABORT:
            aborted = _error_line(request, line.abort_code, _ABORT_MESSAGES[line.abort_code])
            if state.ran:  # stopped mid-run: what it was billed is reported with it (issue #36)
                aborted["usage"] = _usage(state.num_prompt_tokens, state.num_output_tokens)
            return False, aborted
        if state.finish_reason == FinishReason.ERROR or state.finish_reason is None:
            # A worker's or upstream's reason (it may name the upstream and quote its own error
            # text) is for the operator's log only, as streamed and whole answers keep it
            # (docs/upstreams.md); the gateway's own reason (no worker had the line) is shown.
            message = (failure_message(state) if state.worker else
                       f"Generation failed: {state.error or 'backend error'}")
            failed = _error_line(request, "generation_failed", message)
            if state.ran:
                failed["usage"] = _usage(state.num_prompt_tokens, state.num_output_tokens)
            return False, failed
        body = msgspec.to_builtins(whole_answer(state, "".join(line.texts)))
        return True, {
            "id": request.request_id,
            "custom_id": request.custom_id,
            "response": {"status_code": 200, "request_id": request.request_id, "body": body},
            "error": None,
        }

    # ---- storage -------------------------------------------------------------------------------

    async def _store_error(self, request: GenerateRequest, code: str, message: str) -> None:
        """An error result for a line answered without running (cancelled, expired, over budget)."""
        await self._insert(request, False, _error_line(request, code, message))
        assert request.batch_id is not None  # batch lines only
        await self.service.maybe_finalize(request.batch_id)

    async def _insert(self, request: GenerateRequest, ok: bool, line: dict[str, Any]) -> bool:
        """Stores the line's row; False when it was stored already (a replay raced its original):
        exactly one result stands per (batch_id, custom_id)."""
        assert request.batch_id is not None and request.custom_id is not None  # batch lines only
        row = BatchResult(
            batch_id=request.batch_id,
            custom_id=request.custom_id,
            line_no=line_number(request.request_id),
            ok=ok,
            line=json.dumps(line, ensure_ascii=False),
            created_at=utcnow(),
        )
        try:
            async with self.service.sessions() as session, session.begin():
                session.add(row)
        except IntegrityError:
            return False
        return True


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _error_line(request: GenerateRequest, code: str, message: str) -> dict[str, Any]:
    return {
        "id": request.request_id,
        "custom_id": request.custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
