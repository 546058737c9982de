"""OpenAI-compatible Files and Batches routes (thin: the work is in service.py)."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.datastructures import UploadFile
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, FromQuery, JSONBody

from sluice.gateway.auth import TenantContext, current_tenant, tenant_guard
from sluice.gateway.batches.service import BatchService
from sluice.gateway.batches.views import file_view
from sluice.gateway.errors import OpenAIError


class BatchCreate(msgspec.Struct, kw_only=True):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def _service(request: Request[Any, Any, Any]) -> BatchService:
    service = getattr(request.app.state, "batches", None)
    if service is None:
        raise OpenAIError(503, "The Batch API is starting; try again shortly.", type="server_error")
    return service


class FilesController(Controller):
    path = "/v1/files"
    tags = ("Files",)
    guards = (tenant_guard,)
    dependencies = {"tenant": Provide(current_tenant, sync_to_thread=False)}  # noqa: RUF012

    @post("", status_code=200, summary="Upload a batch input file (multipart: file, purpose=batch)")
    async def create(
        self, request: Request[Any, Any, Any], tenant: NamedDependency[TenantContext]
    ) -> dict[str, Any]:
        form = await request.form()
        upload = form.get("file")
        purpose = form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise OpenAIError(400, "Send the file as multipart form field 'file'.", param="file")
        if not isinstance(purpose, str):
            raise OpenAIError(400, "The form field 'purpose' is required (use 'batch').", param="purpose")
        content = await upload.read()
        return await _service(request).create_file(tenant.id, upload.filename or "", purpose, content)

    @get("", summary="List your files")
    async def list(
        self,
        request: Request[Any, Any, Any],
        tenant: NamedDependency[TenantContext],
        purpose: FromQuery[str | None] = None,
        after: FromQuery[str | None] = None,
        limit: FromQuery[int] = 100,
    ) -> dict[str, Any]:
        return await _service(request).list_files(tenant.id, purpose, after, limit)

    @get("/{file_id:str}", summary="Retrieve a file")
    async def retrieve(
        self, request: Request[Any, Any, Any], tenant: NamedDependency[TenantContext], file_id: FromPath[str]
    ) -> dict[str, Any]:
        return file_view(await _service(request).file_row(tenant.id, file_id))

    @get("/{file_id:str}/content", summary="Download a file's content")
    async def content(
        self, request: Request[Any, Any, Any], tenant: NamedDependency[TenantContext], file_id: FromPath[str]
    ) -> Response[bytes]:
        row = await _service(request).file_row(tenant.id, file_id)
        return Response(row.content, media_type="application/jsonl")

    @delete("/{file_id:str}", status_code=200, summary="Delete a file")
    async def remove(
        self, request: Request[Any, Any, Any], tenant: NamedDependency[TenantContext], file_id: FromPath[str]
    ) -> dict[str, Any]:
        return await _service(request).delete_file(tenant.id, file_id)


class BatchesController(Controller):
    path = "/v1/batches"
    tags = ("Batches",)
    guards = (tenant_guard,)
    dependencies = {"tenant": Provide(current_tenant, sync_to_thread=False)}  # noqa: RUF012

    @post("", status_code=200, summary="Create a batch; answers once every line is durably queued")
    async def create(
        self,
        request: Request[Any, Any, Any],
        tenant: NamedDependency[TenantContext],
        data: JSONBody[BatchCreate],
    ) -> dict[str, Any]:
        return await _service(request).create_batch(
            tenant, data.input_file_id, data.endpoint, data.completion_window, data.metadata
        )

    @get("", summary="List your batches, newest first")
    async def list(
        self,
        request: Request[Any, Any, Any],
        tenant: NamedDependency[TenantContext],
        after: FromQuery[str | None] = None,
        limit: FromQuery[int] = 20,
    ) -> dict[str, Any]:
        return await _service(request).list_batches(tenant.id, after, limit)

    @get("/{batch_id:str}", summary="Retrieve a batch")
    async def retrieve(
        self, request: Request[Any, Any, Any], tenant: NamedDependency[TenantContext], batch_id: FromPath[str]
    ) -> dict[str, Any]:
        service = _service(request)
        return await service.view(await service.batch_row(tenant.id, batch_id))

    @post("/{batch_id:str}/cancel", status_code=200, summary="Cancel a batch")
    async def cancel(
        self, request: Request[Any, Any, Any], tenant: NamedDependency[TenantContext], batch_id: FromPath[str]
    ) -> dict[str, Any]:
        return await _service(request).cancel_batch(tenant.id, batch_id)
