"""Thin controllers of the OpenAI-compatible API; the work is in generation.py and streaming.py."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromQuery, JSONBody
from litestar.response import Stream

from sluice.gateway.admin.schemas import UsageList, usage_list
from sluice.gateway.api.generation import Flight, GenerationService, Prepared
from sluice.gateway.api.streaming import complete_chat, complete_text, stream_chat, stream_completion
from sluice.gateway.auth import TenantContext, current_tenant, tenant_guard
from sluice.gateway.errors import OpenAIError, error_responses
from sluice.gateway.openapi import TENANT_SECURITY
from sluice.gateway.quotas import QuotaService
from sluice.gateway.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from sluice.gateway.usage import UsageService

T = TypeVar("T")

# A tenant route without a body: a malformed header or parameter, missing or wrong credentials.
_READ_ERRORS = error_responses(400, 401, 403)
_GENERATION_ERRORS = error_responses(
    400,
    401,
    403,
    404,
    413,
    429,
    503,
    notes={
        400: "Also when the prompt plus max_tokens exceeds the model's context or the tenant's per-request caps",
        404: "Unknown `model`",
    },
)
_SSE_NOTE = (
    " With `stream: true` the answer is `text/event-stream`: one `data: <chunk JSON>` event per "
    "delta, then `data: [DONE]`."
)


async def _unless_disconnected(request: Request[Any, Any, Any], work: Coroutine[Any, Any, T]) -> T:
    """Runs a whole (non-streaming) generation, cancelling it when the client goes away.

    The body has been read, so the next ASGI message is `http.disconnect`. Cancelling the work
    runs its cleanup, which aborts the request at the worker and settles its quota.
    """
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let its cleanup run
    if task.cancelled():
        raise OpenAIError(499, "The client closed the connection.", code="client_closed_request")
    return task.result()


async def _answer(
    request: Request[Any, Any, Any],
    generation: GenerationService,
    tenant: TenantContext,
    prepared: Prepared,
    stream: Callable[[Flight], AsyncIterator[bytes]],
    complete: Callable[[Flight], Coroutine[Any, Any, T]],
) -> Response[T]:
    """Launches a prepared request; answers with an SSE stream when it asked for one, else the whole body."""
    flight = await generation.launch(tenant, prepared)
    quotas = generation.quotas
    if prepared.stream:
        try:  # the first delta before the first byte: an expiry until then is an HTTP error
            await _unless_disconnected(request, flight.first_delta())
        except BaseException:
            flight.finish(aborted=True)
            raise
        return Stream(
            stream(flight),
            media_type="text/event-stream",  # type: ignore[return-value]
            headers={**quotas.headers(tenant), "cache-control": "no-cache", "x-accel-buffering": "no"},
        )
    body = await _unless_disconnected(request, complete(flight))
    return Response(body, headers=quotas.headers(tenant))


class OpenAIController(Controller):
    path = "/v1"
    tags = ["OpenAI"]  # noqa: RUF012
    guards = [tenant_guard]  # noqa: RUF012
    security = TENANT_SECURITY
    dependencies = {"tenant": Provide(current_tenant, sync_to_thread=False)}  # noqa: RUF012

    @get("/models", summary="List models", responses=_READ_ERRORS)
    async def list_models(
        self, request: Request[Any, Any, Any], tenant: NamedDependency[TenantContext]
    ) -> Response[ModelList]:
        generation: GenerationService = request.app.state.generation
        cards = [
            ModelCard(id=m.name, created=request.app.state.started_at, max_model_len=m.max_model_len)
            for m in generation.backend.served_models()
            if tenant.allows_model(m.name) and generation.backend.could_serve(m.name)
        ]
        quotas: QuotaService = request.app.state.quotas
        return Response(ModelList(data=cards), headers=quotas.headers(tenant))

    @post(
        "/chat/completions",
        status_code=200,
        summary="Create a chat completion",
        description="OpenAI chat completions." + _SSE_NOTE,
        responses=_GENERATION_ERRORS,
    )
    async def chat_completions(
        self,
        request: Request[Any, Any, Any],
        tenant: NamedDependency[TenantContext],
        data: JSONBody[ChatCompletionRequest],
    ) -> Response[ChatCompletion]:
        generation: GenerationService = request.app.state.generation
        prepared = await generation.prepare(tenant, data)
        return await _answer(request, generation, tenant, prepared, stream_chat, complete_chat)

    @post(
        "/completions",
        status_code=200,
        summary="Create a completion",
        description="OpenAI (legacy) completions." + _SSE_NOTE,
        responses=_GENERATION_ERRORS,
    )
    async def completions(
        self,
        request: Request[Any, Any, Any],
        tenant: NamedDependency[TenantContext],
        data: JSONBody[CompletionRequest],
    ) -> Response[Completion]:
        generation: GenerationService = request.app.state.generation
        prepared = await generation.prepare(tenant, data)
        return await _answer(request, generation, tenant, prepared, stream_completion, complete_text)

    @get("/usage", summary="Your own token usage per model and UTC day", responses=_READ_ERRORS)
    async def usage(
        self,
        request: Request[Any, Any, Any],
        tenant: NamedDependency[TenantContext],
        start: FromQuery[dt.date | None] = None,
        end: FromQuery[dt.date | None] = None,
    ) -> Response[UsageList]:
        usage: UsageService = request.app.state.usage
        rows = await usage.query(tenant.id, start, end)  # always this tenant's own rows, never another's
        quotas: QuotaService = request.app.state.quotas
        return Response(usage_list(rows, start, end), headers=quotas.headers(tenant))
