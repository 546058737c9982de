"""Generation: a body prepared into a request, admitted against the quotas, submitted, flown.

`prepare()` validates (generation/prepare.py) and keeps the event loop free: a prompt over
`INLINE_PROMPT_CHARS` characters is rendered and tokenized on a worker thread of a small pool
shared fairly between tenants (generation/tokenize_pool.py), after the cheap limits have refused
anything over `gateway.max_prompt_chars` / `gateway.max_messages` or certainly over the model's
context, and after the tenant's requests/min and concurrency were checked: a large prompt refused
once tokenized (400) still counts against requests/min. `launch()` admits the request against the
tenant's quotas and submits it to the backend (durably: it returns after the Kafka ack); the
`Flight` it returns follows the request until it ends (generation/flight.py). `flights` holds
every flight of this process.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from sluice import telemetry, tracing
from sluice.gateway.auth.service import TenantContext
from sluice.gateway.edge.body_decode import SizeLimits, prompt_chars, size_fault
from sluice.gateway.edge.errors import OpenAIError, service_unavailable
from sluice.gateway.edge.schemas import ChatCompletionRequest, CompletionRequest
from sluice.gateway.generation.flight import Flight
from sluice.gateway.generation.prepare import RequestPreparer
from sluice.gateway.generation.state import RequestState, RequestTable
from sluice.gateway.generation.tokenization import TokenizerRegistry
from sluice.gateway.generation.tokenize_pool import INLINE_PROMPT_CHARS, FairTokenizePool
from sluice.gateway.queueing.backend import BackendUnavailable, GenerationBackend, Submission
from sluice.gateway.quotas.service import QuotaExceeded, QuotaService
from sluice.gateway.quotas.usage import UsageService
from sluice.objectives import PREDICTED_TTFT_HEADER, Objective, format_predicted_ttft
from sluice.settings import ObjectiveSettings

log = logging.getLogger(__name__)


class PredictedMiss(OpenAIError):
    """429: no worker is predicted to give the first token within the request's TTFT target, and
    its tenant sheds such requests (`on_predicted_miss = "shed"`); its quota hold is released."""

    def __init__(self, predicted_s: float, target_s: float) -> None:
        super().__init__(
            429,
            f"No worker is predicted to start this answer within its time-to-first-token target of "
            f"{target_s:g}s (the best predicts {predicted_s:.2f}s); it was refused rather than queued. "
            "Retry later, or with a looser X-Sluice-Objective.",
            type="requests", code="ttft_target_unattainable",
            headers={"retry-after": str(max(1, math.ceil(predicted_s - target_s))),
                     PREDICTED_TTFT_HEADER: format_predicted_ttft(predicted_s)},
        )



class GenerationService:
    def __init__(
        self,
        backend: GenerationBackend,
        tokenizers: TokenizerRegistry,
        quotas: QuotaService,
        usage: UsageService,
        *,
        request_timeout_s: float = 600.0,
        max_prompt_chars: int = 1_048_576,
        max_messages: int = 2048,
        max_n: int = 8,
        objectives: ObjectiveSettings | None = None,
    ) -> None:
        if not request_timeout_s > 0:
            raise ValueError(f"gateway.request_timeout_s must be positive, got {request_timeout_s}")
        self.backend = backend
        self.limits = SizeLimits(max_messages=max_messages, max_prompt_chars=max_prompt_chars, max_n=max_n)
        self.preparer = RequestPreparer(tokenizers, backend.could_serve, self.limits,
                                        objectives if objectives is not None else ObjectiveSettings(),
                                        backend.link_limits)
        self.tokenize_pool = FairTokenizePool()
        self.tokenizers = tokenizers
        self.quotas = quotas
        self.usage = usage
        self.request_timeout_s = request_timeout_s
        self.flights: RequestTable[Flight] = RequestTable()
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def prepare(self, tenant: TenantContext, body: ChatCompletionRequest | CompletionRequest,
                      header: Objective | None = None) -> RequestState:
        """The validated request, on a worker thread when the prompt is large. `header`: the
        request's own (tightening) objective, from `X-Sluice-Objective`."""
        chars = prompt_chars(body)
        if size_fault(body, self.limits) is not None or chars <= INLINE_PROMPT_CHARS:
            return self.preparer.prepare(tenant, body, header)  # a cheap limit refuses it at once, or it is small
        # Costly from here: first what needs no tokenizing (the 429s, a prompt far over the context).
        self.quotas.precheck(tenant, pending=self.tokenize_pool.waiting(tenant.id))
        tokenizer = self.preparer.model_tokenizer(tenant, body.model)
        if tokenizer.surely_over(chars, tokenizer.max_model_len):
            await self.quotas.count_request(tenant)
            param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
            raise OpenAIError(
                400, f"This model's maximum context length is {tokenizer.max_model_len} tokens; your prompt "
                f"has {chars} characters, certainly more tokens than that.", param=param,
                code="context_length_exceeded",
            )
        try:
            return await self.tokenize_pool.run(tenant.id, self.preparer.prepare, tenant, body, header)
        except OpenAIError:
            await self.quotas.count_request(tenant)  # the tokenizing was spent: the request counts
            raise

    async def launch(self, tenant: TenantContext, state: RequestState) -> Flight:
        """Quota admission, then submission; the reservation is refunded when submission fails."""
        request = state.request
        try:
            with tracing.span("admission"):
                prompt = len(request.prompt_token_ids) if state.bills_request else 0  # n > 1: billed once
                state.reservation = await self.quotas.admit(tenant, prompt, request.sampling.max_tokens,
                                                            request.priority)
        except QuotaExceeded as exc:
            telemetry.count_rejection(tenant.name, exc.code or "rate_limit_exceeded", request.priority.label)
            raise
        try:
            self._predict(tenant, state)
            submission = await self.backend.submit(state)
        except BackendUnavailable as exc:
            self.quotas.release(state.reservation)
            await self.quotas.settled(state.reservation)  # a retry at once finds the slot free
            telemetry.count_rejection(tenant.name, "unavailable", request.priority.label)
            # The reason names internal addresses (the Kafka broker); it is for the operator's log.
            log.warning("request %s not accepted: %s", request.request_id, exc)
            raise service_unavailable() from None
        except PredictedMiss as exc:
            self.quotas.release(state.reservation)
            await self.quotas.settled(state.reservation)  # the next request finds the slot free
            telemetry.count_rejection(tenant.name, exc.code or "ttft_target_unattainable", request.priority.label)
            raise
        except BaseException:
            self.quotas.release(state.reservation)
            raise
        telemetry.count_admission(tenant.name, request.priority.label)
        return self.fly(state, tenant, submission)

    def _predict(self, tenant: TenantContext, state: RequestState) -> None:
        """A request with a TTFT target: its predicted TTFT at the best worker, kept in its state
        (the response header, the record); `PredictedMiss` when it misses and the tenant sheds.
        Here, before the append: a refused request never reaches Kafka, and every replica is
        linked to every worker, so each predicts from the same reports (dispatch/ttft.py)."""
        target = state.request.ttft_target_s
        if target is None:
            return
        predicted = self.backend.predicted_ttft(state.request)
        state.predicted_ttft_s = predicted
        if predicted is not None and predicted > target and tenant.shed_predicted_miss:
            raise PredictedMiss(predicted, target)

    def fly(self, state: RequestState, tenant: TenantContext, submission: Submission) -> Flight:
        """The flight of a request admitted and submitted (here, or resumed by a takeover), with its
        deadline from now; it stays in `flights` until it finishes."""
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        flight = Flight(self, state, tenant, submission, deadline=deadline)
        self.flights.add(state.request_id, flight)
        return flight
