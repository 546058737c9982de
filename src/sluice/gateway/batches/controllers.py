"""OpenAI-compatible Files and Batches routes (thin: the work is in service.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller, Response, delete, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import UploadFile
from litestar.di import NamedDependency, Provide
from litestar.enums import RequestEncodingType
from litestar.handlers.base import BaseRouteHandler
from litestar.params import Body, JSONBody, QueryParameter

from sluice.gateway.auth.guards import current_tenant, tenant_guard
from sluice.gateway.auth.service import TenantContext
from sluice.gateway.batches.service import BatchService
from sluice.gateway.batches.views import file_view
from sluice.gateway.edge.errors import OpenAIError, error_responses
from sluice.gateway.edge.openapi import TENANT_SECURITY, IdPath, IdQuery
from sluice.gateway.services import Injected, Services, services

MAX_FILENAME_CHARS = 255

# Every route: a malformed header or parameter, missing/wrong credentials, the service starting.
_BASE = (400, 401, 403, 503)
_BY_ID = error_responses(*_BASE, 404)
_LIST = error_responses(*_BASE, 404, notes={404: "`after` names no object of yours"})


class BatchCreate(msgspec.Struct, kw_only=True):
    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"] = "24h"
    metadata: (
        Annotated[
            dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
            msgspec.Meta(max_length=16),
        ]
        | None
    ) = None


@dataclass
class FileUpload:
    """The multipart form of an upload: a JSONL file of batch requests."""

    file: UploadFile
    purpose: Literal["batch"]


def _service(services: Services) -> BatchService:
    service = services.batches
    if service is None:
        raise OpenAIError(
            503, "The Batch API is starting; try again shortly.", type="server_error", code="service_unavailable"
        )
    return service


class _TenantController(Controller):
    """A tenant's own resources: its API key is required and its tenant is injected."""

    guards = (tenant_guard,)
    security = TENANT_SECURITY
    dependencies = {"tenant": Provide(current_tenant, sync_to_thread=False)}  # noqa: RUF012


async def _metered_upload(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """An upload counts against the tenant's requests/min, and is refused (429) before its body is read."""
    await services(connection).quotas.count_request(current_tenant(connection), refuse=True)


class FilesController(_TenantController):
    path = "/v1/files"
    tags = ("Files",)

    @post(
        "",
        status_code=200,
        summary="Upload a batch input file (multipart: file, purpose=batch)",
        responses=error_responses(
            *_BASE, 413, 429, notes={400: "`param` is `file` for a bad file, its name or a bad line, or files "
                                     "over the tenant's storage limit (`file_storage_exceeded`)"}
        ),
        guards=[_metered_upload],
    )
    async def create(
        self,
        services: Injected[Services],
        tenant: NamedDependency[TenantContext],
        data: Annotated[FileUpload, Body(media_type=RequestEncodingType.MULTI_PART)],
    ) -> dict[str, Any]:
        service = _service(services)
        filename = data.file.filename or ""
        if len(filename) > MAX_FILENAME_CHARS:
            raise OpenAIError(
                400,
                f"The file name has {len(filename)} characters; at most {MAX_FILENAME_CHARS} are allowed.",
                param="file",
                code="filename_too_long",
            )
        content = await data.file.read()
        return await service.create_file(tenant.id, filename, data.purpose, content)

    @get("", summary="List your files", responses=_LIST)
    async def list(
        self,
        services: Injected[Services],
        tenant: NamedDependency[TenantContext],
        purpose: Annotated[str | None, QueryParameter(pattern=r"^[a-z_-]{1,32}$")] = None,
        after: IdQuery = None,
        limit: Annotated[int, QueryParameter(ge=1, le=100)] = 100,
    ) -> dict[str, Any]:
        return await _service(services).list_files(tenant.id, purpose, after, limit)

    @get("/{file_id:str}", summary="Retrieve a file", responses=_BY_ID)
    async def retrieve(
        self, services: Injected[Services], tenant: NamedDependency[TenantContext], file_id: IdPath
    ) -> dict[str, Any]:
        return file_view(await _service(services).file_row(tenant.id, file_id))

    @get(
        "/{file_id:str}/content",
        summary="Download a file's content",
        media_type="application/jsonl",
        responses=_BY_ID,
    )
    async def content(
        self, services: Injected[Services], tenant: NamedDependency[TenantContext], file_id: IdPath
    ) -> Response[bytes]:
        row = await _service(services).file_row(tenant.id, file_id, content=True)
        return Response(row.content, media_type="application/jsonl")

    @delete("/{file_id:str}", status_code=200, summary="Delete a file", responses=_BY_ID)
    async def remove(
        self, services: Injected[Services], tenant: NamedDependency[TenantContext], file_id: IdPath
    ) -> dict[str, Any]:
        return await _service(services).delete_file(tenant.id, file_id)


class BatchesController(_TenantController):
    path = "/v1/batches"
    tags = ("Batches",)

    @post(
        "",
        status_code=200,
        summary="Create a batch; answers once every line is durably queued",
        description="A file with bad lines gives a batch with status `failed` and the errors listed.",
        responses=error_responses(*_BASE, 404, 413, notes={404: "`input_file_id` names no file of yours"}),
    )
    async def create(
        self,
        services: Injected[Services],
        tenant: NamedDependency[TenantContext],
        data: JSONBody[BatchCreate],
    ) -> dict[str, Any]:
        services.drain.refuse_new()  # a draining replica starts no new work (gateway/cluster/drain.py)
        return await _service(services).create_batch(
            tenant, data.input_file_id, data.endpoint, data.completion_window, data.metadata
        )

    @get("", summary="List your batches, newest first", responses=_LIST)
    async def list(
        self,
        services: Injected[Services],
        tenant: NamedDependency[TenantContext],
        after: IdQuery = None,
        limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20,
    ) -> dict[str, Any]:
        return await _service(services).list_batches(tenant.id, after, limit)

    @get("/{batch_id:str}", summary="Retrieve a batch", responses=_BY_ID)
    async def retrieve(
        self, services: Injected[Services], tenant: NamedDependency[TenantContext], batch_id: IdPath
    ) -> dict[str, Any]:
        service = _service(services)
        return await service.view(await service.batch_row(tenant.id, batch_id))

    @post(
        "/{batch_id:str}/cancel",
        status_code=200,
        summary="Cancel a batch",
        responses=error_responses(*_BASE, 404, notes={400: "The batch has already ended"}),
    )
    async def cancel(
        self, services: Injected[Services], tenant: NamedDependency[TenantContext], batch_id: IdPath
    ) -> dict[str, Any]:
        return await _service(services).cancel_batch(tenant.id, batch_id)
