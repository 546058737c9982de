"""From an OpenAI request body to an accepted `GenerateRequest`, and the bookkeeping at its end.

Order of checks: model exists (404) → tenant may use it (403) → cheap size limits (message count,
characters: 400 before any tokenization) → body fields (400) → prompt fits
the context (400) → per-request caps and rate/budget quotas (400/429) → submit (503 when no
backend can take it). `Flight` then follows the request until it ends: it settles the quota
reservation to the tokens actually produced, records usage, and emits the telemetry record.

`prepare()` keeps the event loop free: a prompt over `INLINE_PROMPT_CHARS` characters is rendered
and tokenized on a worker thread, at most `TOKENIZE_THREADS` at once (so three huge prompts do not
hold three tokenizations' memory beside everything else), after the cheap limits have refused
anything over `gateway.max_prompt_chars` / `gateway.max_messages`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sluice import telemetry
from sluice.gateway.auth.service import TenantContext
from sluice.gateway.edge.body_decode import SizeLimits, prompt_chars, size_fault
from sluice.gateway.edge.errors import OpenAIError, bad_request, body_fault, service_unavailable
from sluice.gateway.edge.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _SamplingFields
from sluice.gateway.generation.tokenization import ModelTokenizer, TokenizerRegistry
from sluice.gateway.queueing.backend import BackendUnavailable, GenerationBackend, Submission
from sluice.gateway.quotas.service import QuotaExceeded, QuotaService, Reservation
from sluice.gateway.quotas.usage import UsageService
from sluice.protocol import GenerateRequest, Priority, RequestDelta, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")

TIER_TO_CLASS = {
    "priority": Priority.INTERACTIVE,
    "default": Priority.STANDARD,
    "auto": Priority.STANDARD,
    "flex": Priority.BATCH,
}
CLASS_TO_TIER = {Priority.INTERACTIVE: "priority", Priority.STANDARD: "default", Priority.BATCH: "flex"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)
INLINE_PROMPT_CHARS = 16_384  # tokenized on the event loop up to this size (a thread hop costs more)
TOKENIZE_THREADS = 2


def resolve_priority(tenant: TenantContext, service_tier: str | None) -> Priority:
    """min(requested, ceiling): asking above the ceiling gets the ceiling (no error)."""
    if service_tier is None:
        requested = tenant.default_class
    else:
        requested = TIER_TO_CLASS.get(service_tier)  # type: ignore[assignment]
        if requested is None:
            raise bad_request(
                f"Invalid service_tier {service_tier!r}: expected auto, default, flex or priority.",
                "service_tier",
            )
    # Priority: lower value = more urgent, so the ceiling is the numeric maximum.
    return Priority(max(int(requested), int(tenant.priority_ceiling)))


def _param_of(message: str) -> str | None:
    """The sampling field a `SamplingParams.validate` message is about ("at most 16 stop ..." -> stop)."""
    words = [w.strip(",.:()") for w in message.split()]
    named = [w for w in words if w in _SAMPLING_FIELDS]
    if named:
        return named[0]
    return "stop" if "stop sequence" in message else None


def _refuse_unsupported_chat_fields(body: ChatCompletionRequest) -> None:
    """Fields sluice cannot honour get a 400 naming them, rather than being silently ignored."""
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request(
            f"response_format type {body.response_format.type!r} is not supported; only 'text' is.",
            "response_format",
        )
    for name in ("tools", "functions"):
        if getattr(body, name):
            raise bad_request(f"{name} (tool calling) is not supported.", name)
    for name in ("tool_choice", "function_call"):
        if getattr(body, name) not in (None, "none"):
            raise bad_request(f"{name} is not supported: tool calling is not; only 'none' is accepted.", name)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Chat messages as the chat template takes them: text only, content parts joined."""
    if not messages:
        raise bad_request("messages must contain at least one message.", "messages")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}]: only text content parts are supported.", f"messages[{i}].content"
                    )
                parts.append(part.text)
            content = "".join(parts)
        out.append({"role": message.role, "content": content or ""})
    return out


@dataclass(slots=True)
class Prepared:
    """A validated request, ready for admission."""

    request: GenerateRequest
    tokenizer: ModelTokenizer
    tier: str  # echoed service_tier: the class actually used
    stream: bool
    include_usage: bool
    echo_prompt: str = ""


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


@dataclass(slots=True)
class Flight:
    """One accepted request on its way; `finish()` runs exactly once, however it ends."""

    service: GenerationService
    prepared: Prepared
    tenant: TenantContext
    reservation: Reservation
    submission: Submission
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_time: float | None = None
    engine_first_token: float | None = None
    engine_first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    finished: bool = False
    deadline: float = math.inf  # event-loop time by which it must have ended (request_timeout_s)
    timed_out: bool = False
    # Output token ids observed and not yet logged with an event (the stream pump takes them: a
    # replica taking the generation over resumes after the tokens of the events logged).
    unlogged_tokens: list[int] = field(default_factory=list)
    _first: RequestDelta | None = None  # read ahead by `first_delta`, not yet yielded
    _iterator: AsyncIterator[RequestDelta] | None = None  # the one iterator over the submission
    # The deadline: one timer per request that cancels the task waiting in `_next` (one
    # `asyncio.timeout_at` per delta cost a timer and a context per token of every stream).
    _deadline_timer: asyncio.TimerHandle | None = None
    _waiter: asyncio.Task[Any] | None = None  # the task waiting in `_next`, if any
    _expired: bool = False  # the deadline passed

    @property
    def request_id(self) -> str:
        return self.prepared.request.request_id

    async def first_delta(self) -> None:
        """Waits (within the deadline) for the first delta, so that an expiry before it can be an
        HTTP error; `deltas()` yields it first. Raises `RequestTimedOut`."""
        with contextlib.suppress(StopAsyncIteration):  # ended with no delta: `deltas()` is empty
            self._first = await self._next()

    async def deltas(self) -> AsyncIterator[RequestDelta]:
        """The submission's deltas, ended by `RequestTimedOut` once the deadline passes."""
        if self._first is not None:
            first, self._first = self._first, None
            yield first
            if first.finish_reason is not None:
                return
        while True:
            try:
                delta = await self._next()
            except StopAsyncIteration:
                return
            yield delta

    def take_first(self) -> RequestDelta | None:
        """The delta `first_delta` read ahead (None: none, or taken): for a pushed stream, which
        takes the rest from the submission's listener instead of `deltas()`."""
        first, self._first = self._first, None
        return first

    def _arm_deadline(self) -> None:
        if self._deadline_timer is None and not self._expired and math.isfinite(self.deadline) and not self.finished:
            self._deadline_timer = asyncio.get_running_loop().call_at(self.deadline, self._expire)

    async def _next(self) -> RequestDelta:
        if self._iterator is None:
            self._iterator = aiter(self.submission)
        return await self.within_deadline(anext(self._iterator))

    async def within_deadline(self, step: Awaitable[T]) -> T:
        """Awaits `step`, raising `RequestTimedOut` once the deadline passes (its timer cancels the
        task waiting here; any other cancel, a disconnect's, propagates)."""
        self._arm_deadline()
        if self._expired:
            raise self._time_out()
        task = asyncio.current_task()
        assert task is not None  # always awaited from a task
        cancelling = task.cancelling()
        self._waiter = task
        try:
            return await step
        except asyncio.CancelledError:
            # The deadline's cancel, and no other (a disconnect's): the request timed out.
            if self._expired and task.uncancel() <= cancelling:
                raise self._time_out() from None
            raise
        finally:
            self._waiter = None

    def _expire(self) -> None:
        self._deadline_timer = None
        self._expired = True
        if self._waiter is not None:
            self._waiter.cancel()  # a delta already queued stays queued (Queue.get takes it only after)

    def _time_out(self) -> RequestTimedOut:
        self.timed_out = True
        return RequestTimedOut(self.service.request_timeout_s)

    def observe(self, delta: RequestDelta) -> None:
        """Bookkeeping for one delta: a few attribute writes, nothing per token."""
        # The first output: token ids from a worker; text alone from an upstream that sends no ids.
        if (delta.token_ids or delta.text) and self.first_token_time is None:
            self.first_token_time = time.time()
            self.engine_first_token = delta.first_token_time
            self.engine_first_scheduled = delta.first_scheduled_time
            self.service.quotas.mark_running(self.reservation)
        if delta.token_times:
            self.token_times.extend(delta.token_times)
        if delta.token_ids and self.prepared.stream:
            self.unlogged_tokens.extend(delta.token_ids)
        self.prompt_tokens = delta.num_prompt_tokens or self.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, delta.num_output_tokens)
        self.cached_tokens = delta.num_cached_tokens or self.cached_tokens
        if delta.finish_reason is not None:
            self.finish_reason = str(delta.finish_reason)
            self.error = delta.error

    def finish(self, *, aborted: bool = False) -> None:
        """Settle the reservation now; abort (when asked), usage and telemetry in the background."""
        if self.finished:
            return
        self.finished = True
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        prompt = self.prompt_tokens or len(self.prepared.request.prompt_token_ids)
        if aborted and self.finish_reason is None:
            self.finish_reason = "timeout" if self.timed_out else "abort"
        if self.timed_out and self.first_token_time is None:
            self.service.quotas.release(self.reservation)  # it never ran: nothing is charged
        else:
            self.service.quotas.settle(self.reservation, prompt, self.completion_tokens)
        self.service.spawn(self._after(prompt, aborted))

    async def settled(self) -> None:
        """After `finish()`: waits until the quota ledger has applied it (a shared ledger applies
        it in the background), so the client's next request, on any replica, finds it ended."""
        await self.service.quotas.settled(self.reservation)

    async def _after(self, prompt: int, aborted: bool) -> None:
        if aborted:
            try:
                await self.submission.abort()
            except Exception:
                log.warning("abort of %s failed", self.request_id, exc_info=True)
        request = self.prepared.request
        try:
            await self.service.usage.record(self.tenant.id, request.model, prompt, self.completion_tokens)
        except Exception:
            log.error("could not record usage of %s", self.request_id, exc_info=True)
        try:
            record = telemetry.make_record(
                request_id=request.request_id,
                tenant=self.tenant.name,
                model=request.model,
                priority_class=request.priority.label,
                worker=getattr(self.submission, "worker", ""),
                arrival=request.arrival_time,
                dispatch_time=getattr(self.submission, "dispatch_time", None),
                first_token_time=self.first_token_time,
                finish_time=time.time(),
                token_times=self.token_times,
                prompt_tokens=prompt,
                completion_tokens=self.completion_tokens,
                cached_tokens=self.cached_tokens,
                finish_reason=self.finish_reason or "abort",
                engine_first_scheduled=self.engine_first_scheduled,
                engine_first_token=self.engine_first_token,
            )
            telemetry.emit_record(record, self.token_times)
        except Exception:
            log.warning("could not emit the record of %s", self.request_id, exc_info=True)


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
    ) -> None:
        if not request_timeout_s > 0:
            raise ValueError(f"gateway.request_timeout_s must be positive, got {request_timeout_s}")
        self.backend = backend
        self.limits = SizeLimits(max_messages=max_messages, max_prompt_chars=max_prompt_chars)
        self._tokenize_slots = asyncio.Semaphore(TOKENIZE_THREADS)
        self.tokenizers = tokenizers
        self.quotas = quotas
        self.usage = usage
        self.request_timeout_s = request_timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ---- preparation ---------------------------------------------------------------------------

    def model_tokenizer(self, tenant: TenantContext, model: str) -> ModelTokenizer:
        """The tokenizer of a model this tenant may use: 404 for an unknown model, 403 for a forbidden one."""
        tokenizer = self.tokenizers.get(model)
        if not self.backend.could_serve(model):
            raise OpenAIError(
                404,
                f"The model `{model}` is not served by any worker.",
                param="model",
                code="model_not_found",
            )
        if not tenant.allows_model(model):
            raise OpenAIError(
                403,
                f"Your tenant may not use the model `{model}`.",
                type="permission_error",
                param="model",
                code="model_not_allowed",
            )
        return tokenizer

    async def prepare(self, tenant: TenantContext, body: ChatCompletionRequest | CompletionRequest) -> Prepared:
        """prepare_chat / prepare_completion, on a worker thread when the prompt is large."""
        prepare: Any = self.prepare_chat if isinstance(body, ChatCompletionRequest) else self.prepare_completion
        if self._prompt_chars(body) <= INLINE_PROMPT_CHARS:
            return prepare(tenant, body)
        async with self._tokenize_slots:
            return await asyncio.to_thread(prepare, tenant, body)

    def _prompt_chars(self, body: ChatCompletionRequest | CompletionRequest) -> int:
        """Characters to tokenize, counted cheaply (0 when a cheap limit will refuse the body at once)."""
        return 0 if size_fault(body, self.limits) is not None else prompt_chars(body)

    def _check_size(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        fault = size_fault(body, self.limits)
        if fault is not None:
            raise body_fault(fault)

    def prepare_chat(self, tenant: TenantContext, body: ChatCompletionRequest) -> Prepared:
        tokenizer = self.model_tokenizer(tenant, body.model)
        self._check_size(body)
        messages = template_messages(body.messages)
        _refuse_unsupported_chat_fields(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        prompt_ids = tokenizer.apply_chat(messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return self._finish_prepare(
            tenant,
            body,
            tokenizer,
            prompt_ids,
            max_tokens,
            max_tokens_param="max_tokens" if body.max_completion_tokens is None else "max_completion_tokens",
            default_max=None,
            logprobs=bool(body.logprobs),
            top_logprobs=body.top_logprobs or 0,
            prompt_param="messages",
        )

    def prepare_completion(self, tenant: TenantContext, body: CompletionRequest) -> Prepared:
        tokenizer = self.model_tokenizer(tenant, body.model)
        if body.echo:
            raise bad_request("echo is not supported.", "echo")
        self._check_size(body)
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt)
        elif len(prompt) >= tokenizer.max_model_len:  # before looking at each of them
            raise OpenAIError(
                400,
                f"This model's maximum context length is {tokenizer.max_model_len} tokens; your prompt has "
                f"{len(prompt)} tokens.",
                param="prompt",
                code="context_length_exceeded",
            )
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = [int(t) for t in prompt]
            if any(t < 0 or t >= tokenizer.vocab_size for t in prompt_ids):
                raise bad_request(
                    f"prompt token ids must be between 0 and {tokenizer.vocab_size - 1}.", "prompt"
                )
        elif all(isinstance(p, (str, list)) for p in prompt):
            raise bad_request("A list of prompts is not supported; send one prompt per request.", "prompt")
        else:
            raise bad_request("prompt must be a non-empty string or a non-empty list of token ids.", "prompt")
        logprobs = body.logprobs
        return self._finish_prepare(
            tenant,
            body,
            tokenizer,
            prompt_ids,
            body.max_tokens,
            default_max=COMPLETIONS_DEFAULT_MAX_TOKENS,
            logprobs=logprobs is not None,
            top_logprobs=logprobs or 0,
            prompt_param="prompt",
        )

    def _finish_prepare(
        self,
        tenant: TenantContext,
        body: _SamplingFields,
        tokenizer: ModelTokenizer,
        prompt_ids: list[int],
        max_tokens: int | None,
        *,
        max_tokens_param: str = "max_tokens",
        default_max: int | None,
        logprobs: bool,
        top_logprobs: int,
        prompt_param: str,
    ) -> Prepared:
        if body.logit_bias:
            raise bad_request("logit_bias is not supported (an empty object is accepted).", "logit_bias")
        # The body's types bound every number (schemas.py); what is left depends on the model and tenant.
        priority = resolve_priority(tenant, body.service_tier)
        context = tokenizer.max_model_len
        if len(prompt_ids) >= context:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {context} tokens; your prompt has "
                f"{len(prompt_ids)} tokens.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        room = context - len(prompt_ids)
        if max_tokens is None:
            max_tokens = min(room, default_max) if default_max is not None else room
            if tenant.limits.max_output_tokens is not None:
                max_tokens = min(max_tokens, tenant.limits.max_output_tokens)
        elif max_tokens > room:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {context} tokens; you requested "
                f"{len(prompt_ids)} prompt tokens + {max_tokens} {max_tokens_param}.",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        stop = body.stop
        stop_tuple = (stop,) if isinstance(stop, str) else tuple(stop or ())
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        if top_p == 0.0:  # keep only the most likely token: greedy, exactly as temperature 0
            temperature, top_p = 0.0, 1.0
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=max(body.top_k or 0, 0),  # vLLM clients send -1 for "off", as 0 is here
                min_p=body.min_p or 0.0,
                seed=body.seed,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                stop=stop_tuple,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=bool(body.ignore_eos),
                logprobs=logprobs,
                top_logprobs=top_logprobs,
            )
            sampling.validate()
        except ValueError as exc:
            message = str(exc)
            raise bad_request(message[:1].upper() + message[1:] + ".", _param_of(message)) from None
        stream = bool(body.stream)
        if body.stream_options is not None and not stream:
            raise bad_request("stream_options is only allowed when stream is true.", "stream_options")
        request = GenerateRequest(
            request_id=f"{'chatcmpl' if prompt_param == 'messages' else 'cmpl'}-{uuid.uuid4().hex}",
            tenant_id=tenant.id,
            model=tokenizer.name,
            priority=priority,
            prompt_token_ids=tuple(prompt_ids),
            sampling=sampling,
            cache_salt=tenant.id,
            arrival_time=time.time(),
            tenant_weight=tenant.weight,
        )
        return Prepared(
            request=request,
            tokenizer=tokenizer,
            tier=CLASS_TO_TIER[priority],
            stream=stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
        )

    # ---- admission -----------------------------------------------------------------------------

    async def launch(self, tenant: TenantContext, prepared: Prepared) -> Flight:
        """Quota admission, then submission; the reservation is refunded when submission fails."""
        request = prepared.request
        try:
            reservation = await self.quotas.admit(
                tenant, len(request.prompt_token_ids), request.sampling.max_tokens, request.priority
            )
        except QuotaExceeded as exc:
            telemetry.count_rejection(tenant.name, exc.code or "rate_limit_exceeded", request.priority.label)
            raise
        try:
            submission = await self.backend.submit(request)
        except BackendUnavailable as exc:
            self.quotas.release(reservation)
            await self.quotas.settled(reservation)  # a retry at once finds the slot free
            telemetry.count_rejection(tenant.name, "unavailable", request.priority.label)
            # The reason names internal addresses (the Kafka broker); it is for the operator's log.
            log.warning("request %s not accepted: %s", request.request_id, exc)
            raise service_unavailable() from None
        except BaseException:
            self.quotas.release(reservation)
            raise
        telemetry.count_admission(tenant.name, request.priority.label)
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        return Flight(self, prepared, tenant, reservation, submission, deadline=deadline)
