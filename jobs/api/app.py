"""The HTTP API (FastAPI; OpenAPI docs at /docs). Every /v1 route needs `Authorization: Bearer <key>`
and sees only the jobs of the key's tenant."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from jobs.api.auth import Service, Tenant
from jobs.api.downloads import file_response, open_file_response
from jobs.api.edge import BodyTimeout, InternalErrors, check_query_text, parse_json_input
from jobs.api.multipart import FormSpec, file_part, form_dependency, read_form
from jobs.api.openai_batch import openai_batch_router
from jobs.api.prometheus import install_metrics
from jobs.api.reference_jobs import REFERENCE_BODY, add_reference_routes, read_reference_body
from jobs.api.upload_limit import UploadLimit
from jobs.domain.broker import CeleryDispatcher
from jobs.domain.errors import Conflict, InputError, NotFound, clip, clip_repr, error_body
from jobs.domain.grammar_check import GrammarChecker
from jobs.domain.json_limits import JsonLimits
from jobs.domain.quote import JobQuote, QuoteService
from jobs.domain.recovery import start_recovery
from jobs.domain.report import job_report_html
from jobs.domain.results_url import DEFAULT_EXPIRY_S, MAX_EXPIRY_S, ResultsURL, results_url
from jobs.domain.schemas import JobEventOut, JobList, JobMetrics, JobObject, JobParams, job_params
from jobs.domain.service import BrokerUnavailable, JobService
from jobs.domain.settings import Settings, blob_store
from storage.db import make_engine, make_session_factory
from storage.scratch import scratch_file
from storage.status import JobStatus

PARQUET_MEDIA_TYPE = "application/vnd.apache.parquet"
# What storage.job_store.new_job_id makes: anything else names no job (and may not even be storable in
# Postgres, e.g. a NUL), so the API answers it without a query.
JOB_ID_PATTERN = re.compile(r"job_[0-9a-f]{32}")
MAX_VALIDATION_MESSAGE_CHARS = 300


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_engine(settings.resolved_database_url)
        dispatcher = CeleryDispatcher(settings) if settings.broker_url else None
        app.state.engine = engine
        app.state.dispatcher = dispatcher
        grammar = GrammarChecker() if settings.grammar_check else None
        app.state.service = JobService(
            settings, make_session_factory(engine), blob_store(settings), dispatcher,
            grammar=grammar,
        )  # fmt: skip
        recovery = None
        if dispatcher is not None:
            service = app.state.service
            recovery = start_recovery(settings, service.sessions, service.blobs, dispatcher)
        yield
        if recovery is not None:
            thread, stop, sweeper = recovery
            stop.set()
            thread.join(10)
            sweeper.close()
        if grammar is not None:
            grammar.close()
        engine.dispose()

    app = FastAPI(
        title="Freight",
        version="0.1.0",
        description="Batch LLM inference jobs: upload a Parquet file, get a Parquet file back.",
        lifespan=lifespan,
        # The text rule (text_rule.py) for every query parameter of every route, before any route runs.
        dependencies=[Depends(check_query_text)],
    )
    _add_error_handlers(app)
    _add_routes(app, settings)
    add_reference_routes(app, settings.json_limits)
    app.include_router(openai_batch_router())
    install_metrics(app)
    app.add_middleware(UploadLimit, max_upload_bytes=settings.max_upload_bytes)
    # Outermost: a body that stops arriving is answered 408 whatever reads it.
    app.add_middleware(BodyTimeout, idle_seconds=settings.body_idle_timeout_seconds)
    app.add_middleware(InternalErrors)  # outermost of ours: whatever fails inside is a JSON 500
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answer has one shape (jobs/domain/errors.py): {"error": {message, type, param, code}}."""

    @app.exception_handler(InputError)
    async def input_error(_request: Request, exc: InputError) -> JSONResponse:
        return JSONResponse({"error": exc.as_dict()}, status_code=exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status_code, clip(exc.detail, MAX_VALIDATION_MESSAGE_CHARS)),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer repeats the input; this one names the parameter and what is wrong with it.
        problems = []
        param = None
        for error in exc.errors():
            location = ".".join(str(part) for part in error.get("loc", ())[1:]) or "request"
            param = param or location
            problems.append(f"{location}: {clip(error.get('msg', 'invalid'), MAX_VALIDATION_MESSAGE_CHARS)}")
        return JSONResponse(error_body(422, "; ".join(problems[:5]), param=param), status_code=422)

    @app.exception_handler(NotFound)
    async def not_found(_request: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse(error_body(404, str(exc)), status_code=404)

    @app.exception_handler(Conflict)
    async def conflict(_request: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse(error_body(409, str(exc)), status_code=409)

    @app.exception_handler(BrokerUnavailable)
    async def broker_down(_request: Request, exc: BrokerUnavailable) -> JSONResponse:
        return JSONResponse(error_body(503, f"the job queue is unavailable: {exc}"), status_code=503)

    @app.exception_handler(OperationalError)
    async def database_down(_request: Request, exc: OperationalError) -> JSONResponse:
        # A dropped or refused database connection: nothing was half-done; ask the client to retry.
        return JSONResponse(
            error_body(503, f"the database is unavailable: {exc.orig.__class__.__name__}"),
            status_code=503,
            headers={"Retry-After": "1"},
        )


def _job_id(job_id: Annotated[str, PathParam(description="a job id, job_ followed by 32 hex digits")]) -> str:
    """Job ids have one format (JobService makes them); anything else names no job. Checked here, before
    the database sees it (a NUL, for one, cannot even be sent to Postgres)."""
    if not JOB_ID_PATTERN.fullmatch(job_id):
        raise NotFound(f"no job {clip_repr(job_id)}")
    return job_id


JobId = Annotated[str, Depends(_job_id)]


JOB_FORM = FormSpec(files=("file",), fields=("params",), required=("file",), what="the job")
JobForm = Annotated[FormData, Depends(form_dependency(JOB_FORM))]
SUBMIT_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": "the input Parquet file",
                        },
                        "params": {"type": "string", "description": "job parameters as a JSON object"},
                    },
                }
            }
        },
    }
}


# A quote takes either body of a submission: the upload's multipart form, or the JSON of a job by reference.
QUOTE_BODY = {
    "requestBody": {
        "required": True,
        "content": {**SUBMIT_BODY["requestBody"]["content"], **REFERENCE_BODY["requestBody"]["content"]},
    }
}


def _parse_params(raw: str | None, limits: JsonLimits) -> JobParams:
    if raw is None:
        return JobParams()
    if not raw.strip():
        raise InputError("params is empty: send a JSON object (or leave the part out)", field="params")
    payload = parse_json_input(raw, "params", limits)
    if not isinstance(payload, dict):
        raise InputError("params must be a JSON object", field="params")
    return job_params(payload)


def _add_routes(app: FastAPI, settings: Settings) -> None:
    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    def readyz(request: Request) -> JSONResponse:
        checks: dict[str, str] = {}
        try:
            with request.app.state.engine.connect() as connection:
                connection.execute(text("SELECT 1"))
            checks["database"] = "ok"
        except Exception as exc:  # any failure means not ready; say which
            checks["database"] = f"unreachable: {exc.__class__.__name__}"
        dispatcher = request.app.state.dispatcher
        if dispatcher is None:
            checks["broker"] = "unreachable: FREIGHT_BROKER_URL is not set"
        else:
            try:
                dispatcher.ping()
                checks["broker"] = "ok"
            except Exception as exc:
                checks["broker"] = f"unreachable: {exc.__class__.__name__}"
        ready = all(value == "ok" for value in checks.values())
        return JSONResponse(
            {"status": "ready" if ready else "not ready", **checks}, status_code=200 if ready else 503
        )

    def check_length(request: Request) -> None:
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > settings.max_upload_bytes + 1024 * 1024:
            raise InputError(
                f"upload is larger than the limit of {settings.max_upload_mb} MB", status_code=413
            )

    @app.post("/v1/jobs", status_code=201, response_model=JobObject, tags=["jobs"], openapi_extra=SUBMIT_BODY)
    def submit_job(request: Request, tenant: Tenant, service: Service, form: JobForm) -> JobObject:
        file, params = file_part(form, "file"), form.get("params")
        check_length(request)
        return service.submit(tenant, file.file, _parse_params(params, settings.json_limits))

    @app.post("/v1/jobs/quote", response_model=JobQuote, tags=["jobs"], openapi_extra=QUOTE_BODY)
    async def quote_job(request: Request, _tenant: Tenant, service: Service) -> JobQuote:
        """What the job would cost and when it would finish: the body of a submission (a multipart upload
        as for POST /v1/jobs, or the JSON of POST /v1/jobs/by-reference), the submission's checks (the
        same 4xx), and nothing stored or queued."""
        quotes = QuoteService(service)
        if request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/json":
            body = await read_reference_body(request, settings.json_limits)
            return await run_in_threadpool(quotes.quote_by_reference, body.uris, job_params(body.params))
        form = await read_form(request, JOB_FORM)
        try:
            file, params = file_part(form, "file"), form.get("params")
            check_length(request)
            parsed = _parse_params(params, settings.json_limits)
            return await run_in_threadpool(quotes.quote, file.file, parsed)
        finally:
            await form.close()

    @app.get("/v1/jobs", response_model=JobList, tags=["jobs"])
    def list_jobs(
        tenant: Tenant,
        service: Service,
        status: JobStatus | None = None,
        after: Annotated[str | None, Query(description="id of the last job of the previous page")] = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
    ) -> JobList:
        if after is not None and not JOB_ID_PATTERN.fullmatch(after):
            raise InputError(f"unknown cursor {clip_repr(after)}", field="after")
        return service.list(tenant, status, after, limit)

    @app.get("/v1/jobs/{job_id}", response_model=JobObject, tags=["jobs"])
    def get_job(tenant: Tenant, service: Service, job_id: JobId) -> JobObject:
        return service.get(tenant, job_id)

    @app.get("/v1/jobs/{job_id}/events", response_model=list[JobEventOut], tags=["jobs"])
    def job_events(tenant: Tenant, service: Service, job_id: JobId) -> list[JobEventOut]:
        return service.events(tenant, job_id)

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobObject, tags=["jobs"])
    def cancel_job(tenant: Tenant, service: Service, job_id: JobId) -> JobObject:
        return service.cancel(tenant, job_id)

    @app.get("/v1/jobs/{job_id}/results", tags=["jobs"], response_class=FileResponse)
    def job_results(tenant: Tenant, service: Service, job_id: JobId) -> Response:
        filename = f"{job_id}-results.parquet"
        # The rows finished so far go to a scratch file whose name is gone before the response is sent:
        # the open handle serves them, and no path is left behind on any path (storage/scratch.py).
        with scratch_file("freight-partial-", ".parquet") as scratch:
            where, final = service.results_source(tenant, job_id, scratch)
            if not final:
                partial = open(scratch, "rb")  # noqa: SIM115 - the response closes it
        if final:
            return file_response(
                where, media_type=PARQUET_MEDIA_TYPE, filename=filename, headers={"X-Freight-Results": "final"}
            )
        return open_file_response(
            partial, media_type=PARQUET_MEDIA_TYPE, filename=filename, headers={"X-Freight-Results": "partial"}
        )

    @app.get("/v1/jobs/{job_id}/results/url", response_model=ResultsURL, tags=["jobs"])
    def job_results_url(
        tenant: Tenant,
        service: Service,
        job_id: JobId,
        expires_in: Annotated[int, Query(ge=1, le=MAX_EXPIRY_S, description="seconds")] = DEFAULT_EXPIRY_S,
    ) -> ResultsURL:
        """A pre-signed URL of the final results in the S3 store (409 on a local-folder store, or before
        the job is final): anyone holding it can GET the file until it expires, so it goes to the job's
        own tenant only."""
        return results_url(service, tenant, job_id, expires_in)

    @app.get("/v1/jobs/{job_id}/metrics", response_model=JobMetrics, tags=["jobs"])
    def job_metrics(tenant: Tenant, service: Service, job_id: JobId) -> dict:
        return service.metrics(tenant, job_id)

    @app.get("/v1/jobs/{job_id}/report", tags=["jobs"], response_class=HTMLResponse)
    def job_report(tenant: Tenant, service: Service, job_id: JobId) -> HTMLResponse:
        """One self-contained HTML page: parameters, status, cost table and plots."""
        return HTMLResponse(job_report_html(service, tenant, job_id))
