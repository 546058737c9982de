"""Thin controllers of the OpenAI-compatible API; the work is in generation/ and streams/."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath, FromQuery, JSONBody

from sluice import objectives
from sluice.gateway.admin.schemas import UsageList, usage_list
from sluice.gateway.auth.guards import current_tenant, tenant_guard
from sluice.gateway.auth.service import TenantContext
from sluice.gateway.edge.errors import OpenAIError, bad_request, error_responses
from sluice.gateway.edge.openapi import TENANT_SECURITY
from sluice.gateway.edge.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from sluice.gateway.generation.answers import complete, settled_refusal
from sluice.gateway.generation.choices import complete_all, fork, launch_all
from sluice.gateway.generation.flight import Flight
from sluice.gateway.generation.state import RequestState
from sluice.gateway.quotas.service import QuotaService
from sluice.gateway.services import Injected, Services
from sluice.gateway.streams.choices import ChoicesStream
from sluice.gateway.streams.frames import Framer
from sluice.gateway.streams.hub import (
    StreamHub,
    check_idempotency_key,
    disconnect_grace,
    not_found,
    parse_last_event_id,
    wants_ids,
)
from sluice.gateway.streams.log import Keyed
from sluice.gateway.streams.response import SSEResponse
from sluice.objectives import PREDICTED_TTFT_HEADER, Objective, format_predicted_ttft

T = TypeVar("T")

# A tenant route without a body: a malformed header or parameter, missing or wrong credentials.
_READ_ERRORS = error_responses(400, 401, 403)
_GENERATION_ERRORS = error_responses(
    400,
    401,
    403,
    404,
    413,
    422,
    429,
    503,
    notes={
        400: "Also when the prompt plus max_tokens exceeds the model's context or the tenant's per-request caps",
        404: "Unknown `model`",
    },
)
_SSE_NOTE = (
    " With `stream: true` the answer is `text/event-stream`: one `data: <chunk JSON>` event per "
    "delta, then `data: [DONE]`. With `X-Sluice-Resumable: 1` or an `Idempotency-Key` every event "
    "also has `id: <response id>:<seq>` (without: `data:` lines only); a client that lost the stream "
    "re-sends the POST with the same `Idempotency-Key` and `Last-Event-ID`, or attaches with "
    "`GET .../{id}/events` (docs/streams.md). `X-Sluice-Disconnect: abort` aborts on disconnect "
    "instead of after the grace window."
)
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _class_header(state: RequestState) -> dict[str, str]:
    """The class the request ran in (interactive, standard, batch); `service_tier` in the body
    echoes what the client asked for instead."""
    return {"x-sluice-class": state.request.priority.label}


async def _unless_disconnected(request: Request[Any, Any, Any], work: Coroutine[Any, Any, T]) -> T:
    """Runs a whole (non-streaming) generation, or the wait for a stream's first delta, in this
    task, cancelling it when the client goes away.

    The body has been read, so the next ASGI message is `http.disconnect`: a watcher task waits
    for it and cancels this task, which runs the work's cleanup (it aborts the request at the
    worker and settles its quota). The work runs here rather than in a task of its own, so its
    result needs no hop back to this task (one task and one loop turn less per request).
    """
    handler = asyncio.current_task()
    assert handler is not None  # called from a request handler; internal invariant
    gone = False

    async def disconnected() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        handler.cancel()

    watcher = asyncio.ensure_future(disconnected())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise  # cancelled from outside (the server stops): not ours to turn into an answer
        handler.uncancel()
        raise OpenAIError(499, "The client closed the connection.", code="client_closed_request") from None
    finally:
        watcher.cancel()


def _objective_header(request: Request[Any, Any, Any]) -> Objective | None:
    """`X-Sluice-Objective: ttft=1.5, itl=0.2`: targets that can only tighten the tenant's (a 400 on garbage)."""
    value = request.headers.get(objectives.HEADER)
    if value is None:
        return None
    try:
        return objectives.parse_header(value)
    except ValueError as exc:
        raise bad_request(f"{exc}.", "X-Sluice-Objective") from None


def _objective_answer(state: RequestState) -> dict[str, str]:
    """The targets served against, and the TTFT predicted at admission when there was one."""
    generate = state.request
    headers = {objectives.HEADER: objectives.format_header(generate.ttft_target_s, generate.itl_target_s)}
    if state.predicted_ttft_s is not None:
        headers[PREDICTED_TTFT_HEADER] = format_predicted_ttft(state.predicted_ttft_s)
    return headers


async def _answer(request: Request[Any, Any, Any], services: Services, tenant: TenantContext,
                  state: RequestState) -> Response[Any]:
    """Launches a prepared request; answers with an SSE stream when it asked for one, else the whole body."""
    if state.stream and state.envelope.choices > 1:
        return await _answer_choices_stream(request, services, tenant, state)
    if state.stream:
        return await _answer_stream(request, services, tenant, state)
    services.drain.refuse_new()
    generation = services.generation
    tokenizer = generation.tokenizers.get(state.request.model)
    if state.envelope.choices > 1:  # n > 1: one request per choice (generation/choices.py)
        flights = await launch_all(generation.launch, tenant, fork(state))
        body = await _unless_disconnected(request, complete_all(flights, tokenizer))
        return Response(body, headers={**services.quotas.headers(tenant), **_class_header(state)})
    flight = await generation.launch(tenant, state)
    body = await _unless_disconnected(request, complete(flight, tokenizer))
    return Response(body, headers={**services.quotas.headers(tenant), **_class_header(state),
                                   **_objective_answer(state)})


async def _answer_stream(request: Request[Any, Any, Any], services: Services, tenant: TenantContext,
                         state: RequestState) -> Response[Any]:
    """A streamed request: filed in the stream log, generated by a pump, followed by this response.

    With an `Idempotency-Key` this tenant already used (within the retention), nothing new runs:
    the answer follows that response from after `Last-Event-ID` (or from its start).
    """
    streams, generation = services.streams, services.generation
    headers = request.headers
    key = check_idempotency_key(headers.get("idempotency-key"))
    default_grace_s = streams.grace_s if tenant.disconnect_grace_s is None else tenant.disconnect_grace_s
    grace_s = disconnect_grace(headers.get("x-sluice-disconnect"), default_grace_s)
    last_id, after = parse_last_event_id(headers.get("last-event-id"), None)
    with_ids = wants_ids(headers.get("x-sluice-resumable"), key)
    response_id = state.request_id
    if last_id is not None and key is None:
        raise OpenAIError(
            400, "Last-Event-ID on a POST needs the Idempotency-Key it was sent with.", code="missing_idempotency_key"
        )
    fingerprint = request_fingerprint(state)
    filed = None if key is None else await streams.log.by_key(tenant.id, key)
    if filed is not None:
        if last_id is not None and last_id != filed.response_id:
            raise OpenAIError(400, "Last-Event-ID names another response than this Idempotency-Key's.")
        _same_request(filed, fingerprint)
        return await _attach(streams, services.quotas, tenant, filed.response_id, after, with_ids=with_ids)
    if last_id is not None:  # a resume whose original is gone: starting over would repeat events
        raise not_found(last_id)
    services.drain.refuse_new()  # attaching (above) is still served while draining
    flight = await generation.launch(tenant, state)
    # Filed once durable (launch returns after the Kafka ack): a key is never filed for a request
    # that was not accepted, so a client whose POST broke before that starts afresh with it, and
    # a filed key's response always has a record some replica holds (and can take over).
    try:
        filed = await streams.log.create(response_id, tenant.id, key, grace_s=grace_s, envelope=state.envelope,
                                         fingerprint=fingerprint)
    except BaseException:
        flight.finish(aborted=True)
        raise
    if filed is not None:  # a concurrent POST with this key was filed first: follow that one
        flight.finish(aborted=True)
        _same_request(filed, fingerprint)
        return await _attach(streams, services.quotas, tenant, filed.response_id, after,
                             metered=False, with_ids=with_ids)  # counted: launched
    try:  # the first delta before the first byte: an expiry until then is an HTTP error
        await _unless_disconnected(request, flight.first_delta())
    except BaseException:
        flight.finish(aborted=True)
        await streams.log.drop(response_id, tenant.id, key)  # nothing was streamed: a retry starts anew
        raise
    if flight.submission.refusal() is not None:  # an upstream's 4xx: an HTTP error, as when not streamed
        await streams.log.drop(response_id, tenant.id, key)
        raise await settled_refusal(flight)
    streams.start(flight, Framer(state, generation.tokenizers.get(state.request.model)), grace_s)
    events = streams.follow(response_id, -1, with_ids=with_ids)
    return SSEResponse(events, {**services.quotas.headers(tenant), **_class_header(state),
                                **_objective_answer(state), **_SSE_HEADERS})


async def _answer_choices_stream(request: Request[Any, Any, Any], services: Services, tenant: TenantContext,
                                 state: RequestState) -> Response[Any]:
    """A streamed answer of n > 1 choices (streams/choices.py): not resumable, so the headers that
    ask for resuming are refused."""
    headers = request.headers
    if headers.get("idempotency-key") is not None or headers.get("last-event-id") is not None or wants_ids(
            headers.get("x-sluice-resumable"), None):
        raise bad_request("A stream of n > 1 choices cannot be resumed: send it without Idempotency-Key, "
                          "Last-Event-ID and X-Sluice-Resumable, or stream one request per choice.", "n")
    services.drain.refuse_new()
    generation = services.generation
    flights = await launch_all(generation.launch, tenant, fork(state))
    try:  # every choice's first delta before the first byte: an expiry until then is an HTTP error
        await _unless_disconnected(request, _first_deltas(flights))
        refused = next((flight for flight in flights if flight.submission.refusal() is not None), None)
        if refused is not None:  # an upstream's 4xx: an HTTP error, as when not streamed
            raise await settled_refusal(refused)
    except BaseException:
        for flight in flights:
            flight.finish(aborted=True)
        raise
    events = ChoicesStream(flights, generation.tokenizers.get(state.request.model))
    return SSEResponse(events, {**services.quotas.headers(tenant), **_class_header(state), **_SSE_HEADERS})


async def _first_deltas(flights: list[Flight]) -> None:
    await asyncio.gather(*(flight.first_delta() for flight in flights))


def request_fingerprint(state: RequestState) -> str:
    """What makes two POSTs the same request: endpoint, model, prompt ids and sampling (not the
    JSON's spelling). An Idempotency-Key replays only the request it was first sent with."""
    request = state.request
    parts = (state.envelope.endpoint, request.model, request.prompt_token_ids, request.sampling,
             state.envelope.include_usage)
    return hashlib.sha256(msgspec.msgpack.encode(parts)).hexdigest()[:32]


def _same_request(filed: Keyed, fingerprint: str) -> None:
    """422 for an Idempotency-Key reused with another body or endpoint (as payment APIs answer);
    a key filed without a fingerprint (before an upgrade) is taken as the same request."""
    if filed.fingerprint and filed.fingerprint != fingerprint:
        raise OpenAIError(
            422, "This Idempotency-Key was used with another request (body or endpoint); a key replays only "
            "the request it was first sent with. Use a new key for a new request.",
            param="Idempotency-Key", code="idempotency_key_reused",
        )


async def _attach(streams: StreamHub, quotas: QuotaService, tenant: TenantContext, response_id: str,
                  after: int, *, metered: bool = True, with_ids: bool = True) -> Response[Any]:
    """Follows a kept response; an attach counts against the tenant's requests/min (429 past it).
    An attach by GET always has ids (only a resuming client uses it)."""
    if metered:
        await quotas.count_request(tenant, refuse=True)
    await streams.check_owner(response_id, tenant.id, after)
    events = streams.follow(response_id, after, with_ids=with_ids)
    return SSEResponse(events, {**quotas.headers(tenant), **_SSE_HEADERS})


_ATTACH_ERRORS = error_responses(400, 401, 403, 404, 410, 429, notes={404: "Unknown, expired, or another tenant's"})
_ATTACH_NOTE = (
    "Attach to a streamed response: its SSE events after `Last-Event-ID` (none: from the first), then "
    "the live rest, then `[DONE]`; during the generation and for `gateway.stream_retention_s` after it."
)


class OpenAIController(Controller):
    """Each route takes one injected dependency, `services`, and the caller's tenant from its guard
    (`current_tenant`): a second injected dependency makes Litestar resolve them in an anyio task
    group, two tasks per request (measured: +0.16 ms of gateway CPU per request at 200 streams)."""

    path = "/v1"
    tags = ["OpenAI"]  # noqa: RUF012
    guards = [tenant_guard]  # noqa: RUF012
    security = TENANT_SECURITY

    @get("/models", summary="List models", responses=_READ_ERRORS)
    async def list_models(self, request: Request[Any, Any, Any], services: Injected[Services]) -> Response[ModelList]:
        tenant = current_tenant(request)
        backend = services.backend
        cards = [
            ModelCard(id=m.name, created=services.started_at,
                      max_model_len=min(m.max_model_len, backend.link_limits(m.name).max_model_len or m.max_model_len))
            for m in backend.served_models()
            if tenant.allows_model(m.name) and backend.could_serve(m.name)
        ]
        return Response(ModelList(data=cards), headers=services.quotas.headers(tenant))

    @post(
        "/chat/completions",
        status_code=200,
        summary="Create a chat completion",
        description="OpenAI chat completions." + _SSE_NOTE,
        responses=_GENERATION_ERRORS,
    )
    async def chat_completions(
        self, request: Request[Any, Any, Any], services: Injected[Services], data: JSONBody[ChatCompletionRequest],
    ) -> Response[ChatCompletion]:
        tenant = current_tenant(request)
        state = await services.generation.prepare(tenant, data, _objective_header(request))
        return await _answer(request, services, tenant, state)

    @post(
        "/completions",
        status_code=200,
        summary="Create a completion",
        description="OpenAI (legacy) completions." + _SSE_NOTE,
        responses=_GENERATION_ERRORS,
    )
    async def completions(
        self, request: Request[Any, Any, Any], services: Injected[Services], data: JSONBody[CompletionRequest],
    ) -> Response[Completion]:
        tenant = current_tenant(request)
        state = await services.generation.prepare(tenant, data, _objective_header(request))
        return await _answer(request, services, tenant, state)

    @get(
        ["/chat/completions/{response_id:str}/events", "/completions/{response_id:str}/events"],
        summary="Attach to a streamed (chat) completion",
        description=_ATTACH_NOTE,
        responses=_ATTACH_ERRORS,
    )
    async def stream_events(
        self, request: Request[Any, Any, Any], services: Injected[Services], response_id: FromPath[str]
    ) -> Response[Any]:
        kind = "chatcmpl-" if "/chat/completions/" in request.url.path else "cmpl-"
        if not response_id.startswith(kind):
            raise not_found(response_id)
        _, after = parse_last_event_id(request.headers.get("last-event-id"), response_id)
        return await _attach(services.streams, services.quotas, current_tenant(request), response_id, after)

    @get("/usage", summary="Your own token usage per model and UTC day", responses=_READ_ERRORS)
    async def usage(
        self,
        request: Request[Any, Any, Any],
        services: Injected[Services],
        start: FromQuery[dt.date | None] = None,
        end: FromQuery[dt.date | None] = None,
    ) -> Response[UsageList]:
        tenant = current_tenant(request)
        rows = await services.usage.query(tenant.id, start, end)  # always this tenant's own rows, never another's
        return Response(usage_list(rows, start, end), headers=services.quotas.headers(tenant))
