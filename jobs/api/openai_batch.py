"""The OpenAI-compatible Batch API: /v1/files and /v1/batches, so that an OpenAI SDK batch script runs
against Freight with only its base_url and api_key changed. Same tenants and keys as the native
routes; another tenant's file or batch is a 404. Each batch is one Freight job
(jobs/domain/openai_service.py); every answer is one of OpenAI's objects (jobs/domain/openai_objects.py),
so the OpenAPI page shows their schemas."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.responses import Response

from jobs.api.auth import Tenant
from jobs.api.downloads import file_response
from jobs.api.edge import parse_json_input
from jobs.api.multipart import FormSpec, file_part, form_dependency
from jobs.domain.errors import InputError, NotFound, clip, clip_repr
from jobs.domain.json_limits import JsonLimits
from jobs.domain.openai_objects import (
    Batch,
    BatchList,
    BatchRequestInput,
    BatchRequestOutput,
    FileDeleted,
    FileList,
    FileObject,
)
from jobs.domain.openai_service import BatchService

# What storage.openai_store makes; anything else names nothing, answered before any query.
FILE_ID_PATTERN = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID_PATTERN = re.compile(r"batch_[0-9a-f]{32}")
JSONL_MEDIA_TYPE = "application/jsonl"


class JsonlResponse(Response):
    """A file's content: JSONL, one object a line (documents the route's media type)."""

    media_type = JSONL_MEDIA_TYPE


CONTENT_RESPONSES = {
    200: {
        "model": BatchRequestInput | BatchRequestOutput,
        "description": "JSONL: a request a line (input file), or a request's output (output and error files)",
    }
}


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


FILE_FORM = FormSpec(files=("file",), fields=("purpose",), required=("file", "purpose"), what="the file")
FileForm = Annotated[FormData, Depends(form_dependency(FILE_FORM))]
FILE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": "the batch input, JSONL: a BatchRequestInput a line",
                        },
                        "purpose": {"type": "string", "description": "batch"},
                    },
                }
            }
        },
    }
}
BATCH_BODY = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": CreateBatch.model_json_schema()}}}
}


async def _create_batch_body(request: Request, limits: JsonLimits) -> CreateBatch:
    """The body of POST /v1/batches: JSON (Content-Type application/json), bounded like every JSON the
    API parses (duplicate keys refused), then the strict model. Each refusal says what is wrong."""
    content_type = request.headers.get("content-type", "")
    raw = await request.body()
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise InputError(
            "send the batch as a JSON object with Content-Type: application/json"
            + (f" (got {clip_repr(content_type, 60)})" if content_type else " (the request has no Content-Type)"),
            status_code=415,
            field="body",
        )
    if not raw.strip():
        raise InputError("the body is empty: send a JSON object with input_file_id, endpoint and "
                         "completion_window", field="body")  # fmt: skip
    payload = parse_json_input(raw, "the body", limits)
    if not isinstance(payload, dict):
        raise InputError("the body must be a JSON object", field="body")
    try:
        return CreateBatch.model_validate(payload)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(clip(part, 64) for part in error['loc']) or 'body'}: {clip(error['msg'], 200)}"
            for error in exc.errors()[:5]
        )
        first = exc.errors()[0]["loc"] if exc.errors() else ()
        raise InputError(f"invalid batch: {problems}", field=str(first[0]) if first else "body") from exc


def _batches(request: Request) -> BatchService:
    return BatchService(request.app.state.service)


Batches = Annotated[BatchService, Depends(_batches)]


def _file_id(file_id: Annotated[str, PathParam(description="a file id, file- and 24 hex digits")]) -> str:
    if not FILE_ID_PATTERN.fullmatch(file_id):
        raise NotFound(f"no file {clip_repr(file_id)}")
    return file_id


def _batch_id(batch_id: Annotated[str, PathParam(description="a batch id, batch_ and 32 hex digits")]) -> str:
    if not BATCH_ID_PATTERN.fullmatch(batch_id):
        raise NotFound(f"no batch {clip_repr(batch_id)}")
    return batch_id


FileId = Annotated[str, Depends(_file_id)]
BatchId = Annotated[str, Depends(_batch_id)]
Limit = Annotated[int, Query(ge=1, le=100)]


def _cursor(after: str | None, pattern: re.Pattern[str]) -> str | None:
    if after is not None and not pattern.fullmatch(after):
        raise InputError(f"unknown cursor {clip_repr(after)}", field="after")
    return after


def openai_batch_router() -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["openai batch"])

    @router.post("/files", openapi_extra=FILE_BODY)
    def create_file(tenant: Tenant, batches: Batches, form: FileForm) -> FileObject:
        file = file_part(form, "file")
        return batches.upload(tenant, file.file, file.filename, str(form.get("purpose")))

    @router.get("/files")
    def list_files(
        tenant: Tenant,
        batches: Batches,
        purpose: str | None = None,
        after: str | None = None,
        limit: Limit = 20,
    ) -> FileList:
        return batches.list_files(tenant, purpose, _cursor(after, FILE_ID_PATTERN), limit)

    @router.get("/files/{file_id}")
    def get_file(tenant: Tenant, batches: Batches, file_id: FileId) -> FileObject:
        return batches.get_file(tenant, file_id)

    @router.get("/files/{file_id}/content", response_class=JsonlResponse, responses=CONTENT_RESPONSES)
    def file_content(tenant: Tenant, batches: Batches, file_id: FileId) -> Response:
        return file_response(batches.file_source(tenant, file_id), media_type=JSONL_MEDIA_TYPE)

    @router.delete("/files/{file_id}")
    def delete_file(tenant: Tenant, batches: Batches, file_id: FileId) -> FileDeleted:
        return batches.delete_file(tenant, file_id)

    @router.post("/batches", openapi_extra=BATCH_BODY)
    async def create_batch(request: Request, tenant: Tenant, batches: Batches) -> Batch:
        body = await _create_batch_body(request, batches.settings.json_limits)
        _file_id(body.input_file_id)
        return await run_in_threadpool(
            batches.create,
            tenant,
            input_file_id=body.input_file_id,
            endpoint=body.endpoint,
            completion_window=body.completion_window,
            metadata=body.metadata,
        )

    @router.get("/batches")
    def list_batches(
        tenant: Tenant, batches: Batches, after: str | None = None, limit: Limit = 20
    ) -> BatchList:
        return batches.list(tenant, _cursor(after, BATCH_ID_PATTERN), limit)

    @router.get("/batches/{batch_id}")
    def get_batch(tenant: Tenant, batches: Batches, batch_id: BatchId) -> Batch:
        return batches.get(tenant, batch_id)

    @router.post("/batches/{batch_id}/cancel")
    def cancel_batch(tenant: Tenant, batches: Batches, batch_id: BatchId) -> Batch:
        return batches.cancel(tenant, batch_id)

    return router
