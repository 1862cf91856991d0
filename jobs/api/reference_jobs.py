"""POST /v1/jobs/by-reference: a job whose input stays in the tenant's bucket. The body is JSON,
`{"input_uris": ["s3://bucket/docs/*.parquet", ...], "params": {...}}` (or one `input_uri`), bounded like
every JSON the API parses; the URIs are checked against FREIGHT_INPUT_ALLOW and read in place
(jobs/domain/input_refs.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from jobs.api.auth import Service, Tenant
from jobs.api.edge import parse_json_input
from jobs.domain.errors import InputError, clip, clip_repr
from jobs.domain.input_refs import FIELD, MAX_INPUT_URIS
from jobs.domain.json_limits import JsonLimits
from jobs.domain.schemas import JobObject, job_params
from jobs.domain.text_rule import tree_problem


class ReferenceJob(BaseModel):
    """A submission by reference: one `input_uri` or a list of `input_uris`, and the job's params."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input_uri: str | None = Field(None, description="s3://bucket/key.parquet, a folder (.../) or a glob")
    input_uris: list[str] | None = Field(None, max_length=MAX_INPUT_URIS, description="several of them")
    params: dict[str, Any] = Field(default_factory=dict, description="the job parameters, as for an upload")

    @model_validator(mode="after")
    def _one_way(self) -> ReferenceJob:
        if (self.input_uri is None) == (self.input_uris is None):
            raise ValueError("name the input with exactly one of input_uri and input_uris")
        return self

    @property
    def uris(self) -> list[str]:
        return [self.input_uri] if self.input_uri is not None else list(self.input_uris or [])


REFERENCE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ReferenceJob.model_json_schema()}},
    }
}


async def read_reference_body(request: Request, limits: JsonLimits) -> ReferenceJob:
    content_type = request.headers.get("content-type", "")
    raw = await request.body()
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise InputError(
            "send the job as a JSON object with Content-Type: application/json"
            + (f" (got {clip_repr(content_type, 60)})" if content_type else " (the request has no Content-Type)"),
            status_code=415,
            field="body",
        )
    payload = parse_json_input(raw, "the body", limits)
    if not isinstance(payload, dict):
        raise InputError("the body must be a JSON object with input_uris (or input_uri) and params", field="body")
    problem = tree_problem(payload, "")  # the text rule: URIs and params are stored
    if problem is not None:
        raise InputError(f"invalid body: {problem}", field="body")
    try:
        return ReferenceJob.model_validate(payload)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(clip(part, 64) for part in error['loc']) or 'body'}: {clip(error['msg'], 200)}"
            for error in exc.errors()[:5]
        )
        raise InputError(f"invalid job: {problems}", field=FIELD) from exc


def add_reference_routes(app: FastAPI, limits: JsonLimits) -> None:
    @app.post(
        "/v1/jobs/by-reference",
        status_code=201,
        response_model=JobObject,
        tags=["jobs"],
        openapi_extra=REFERENCE_BODY,
    )
    async def submit_job_by_reference(request: Request, tenant: Tenant, service: Service) -> JobObject:
        """Submit a job whose input Parquet files are read where they are (s3:// URIs the operator allows
        in FREIGHT_INPUT_ALLOW): validated and sharded in place, nothing copied; 4xx naming the URI when
        one is not allowed, not s3://, missing or not Parquet, before anything is stored."""
        body = await read_reference_body(request, limits)
        params = job_params(body.params)
        return await run_in_threadpool(service.submit_by_reference, tenant, body.uris, params)
