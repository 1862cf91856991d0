"""The HTTP API (FastAPI; OpenAPI docs at /docs). Every /v1 route needs `Authorization: Bearer <key>`
and sees only the jobs of the key's tenant."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

from fastapi import Depends, FastAPI, File, Form, HTTPException, Query, Request, UploadFile
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError
from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from starlette.background import BackgroundTask

from jobs.api.prometheus import install_metrics
from jobs.api.report import job_report_html
from jobs.api.upload_limit import UploadLimit
from jobs.domain.broker import CeleryDispatcher
from jobs.domain.errors import Conflict, InputError, NotFound
from jobs.domain.recovery import start_recovery
from jobs.domain.schemas import JobEventOut, JobList, JobMetrics, JobObject, JobParams
from jobs.domain.service import BrokerUnavailable, JobService
from jobs.domain.settings import Settings
from storage.blobs import BlobStore
from storage.db import make_engine, make_session_factory
from storage.keys import tenant_for_key
from storage.status import JobStatus

bearer = HTTPBearer(auto_error=False, description="an API key from `freight keys create --tenant NAME`")
PARQUET_MEDIA_TYPE = "application/vnd.apache.parquet"


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_engine(settings.resolved_database_url)
        dispatcher = CeleryDispatcher(settings) if settings.broker_url else None
        app.state.engine = engine
        app.state.dispatcher = dispatcher
        app.state.service = JobService(
            settings, make_session_factory(engine), BlobStore(settings.resolved_data_dir), dispatcher
        )
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
        engine.dispose()

    app = FastAPI(
        title="Freight",
        version="0.1.0",
        description="Batch LLM inference jobs: upload a Parquet file, get a Parquet file back.",
        lifespan=lifespan,
    )
    _add_error_handlers(app)
    _add_routes(app, settings)
    install_metrics(app)
    app.add_middleware(UploadLimit, max_upload_bytes=settings.max_upload_bytes)
    return app


def _service(request: Request) -> JobService:
    return request.app.state.service


def _tenant(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> str:
    unauthorized = {"WWW-Authenticate": "Bearer"}
    if credentials is None:
        raise HTTPException(401, "missing API key: send Authorization: Bearer <key>", headers=unauthorized)
    with _service(request).sessions() as session:
        tenant = tenant_for_key(session, credentials.credentials)
    if tenant is None:
        raise HTTPException(401, "invalid or revoked API key", headers=unauthorized)
    return tenant


Tenant = Annotated[str, Depends(_tenant)]
Service = Annotated[JobService, Depends(_service)]


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(InputError)
    async def input_error(_request: Request, exc: InputError) -> JSONResponse:
        return JSONResponse({"error": exc.as_dict()}, status_code=exc.status_code)

    @app.exception_handler(NotFound)
    async def not_found(_request: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=404)

    @app.exception_handler(Conflict)
    async def conflict(_request: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=409)

    @app.exception_handler(BrokerUnavailable)
    async def broker_down(_request: Request, exc: BrokerUnavailable) -> JSONResponse:
        return JSONResponse({"error": {"message": f"the job queue is unavailable: {exc}"}}, status_code=503)

    @app.exception_handler(OperationalError)
    async def database_down(_request: Request, exc: OperationalError) -> JSONResponse:
        # A dropped or refused database connection: nothing was half-done; ask the client to retry.
        return JSONResponse(
            {"error": {"message": f"the database is unavailable: {exc.orig.__class__.__name__}"}},
            status_code=503,
            headers={"Retry-After": "1"},
        )


def _parse_params(raw: str) -> JobParams:
    try:
        payload = json.loads(raw or "{}")
    except json.JSONDecodeError as exc:
        raise InputError(f"params is not valid JSON: {exc}", field="params") from exc
    if not isinstance(payload, dict):
        raise InputError("params must be a JSON object", field="params")
    try:
        return JobParams.model_validate(payload)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'params'}: {error['msg']}"
            for error in exc.errors()
        )
        raise InputError(f"invalid params: {problems}", field="params") from exc


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

    @app.post("/v1/jobs", status_code=201, response_model=JobObject, tags=["jobs"])
    def submit_job(
        request: Request,
        tenant: Tenant,
        service: Service,
        file: Annotated[UploadFile, File(description="the input Parquet file")],
        params: Annotated[str, Form(description="job parameters as a JSON object")] = "{}",
    ) -> JobObject:
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > settings.max_upload_bytes + 1024 * 1024:
            raise InputError(
                f"upload is larger than the limit of {settings.max_upload_mb} MB", status_code=413
            )
        return service.submit(tenant, file.file, _parse_params(params))

    @app.get("/v1/jobs", response_model=JobList, tags=["jobs"])
    def list_jobs(
        tenant: Tenant,
        service: Service,
        status: JobStatus | None = None,
        after: Annotated[str | None, Query(description="id of the last job of the previous page")] = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
    ) -> JobList:
        return service.list(tenant, status, after, limit)

    @app.get("/v1/jobs/{job_id}", response_model=JobObject, tags=["jobs"])
    def get_job(job_id: str, tenant: Tenant, service: Service) -> JobObject:
        return service.get(tenant, job_id)

    @app.get("/v1/jobs/{job_id}/events", response_model=list[JobEventOut], tags=["jobs"])
    def job_events(job_id: str, tenant: Tenant, service: Service) -> list[JobEventOut]:
        return service.events(tenant, job_id)

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobObject, tags=["jobs"])
    def cancel_job(job_id: str, tenant: Tenant, service: Service) -> JobObject:
        return service.cancel(tenant, job_id)

    @app.get("/v1/jobs/{job_id}/results", tags=["jobs"], response_class=FileResponse)
    def job_results(job_id: str, tenant: Tenant, service: Service) -> FileResponse:
        handle, scratch = tempfile.mkstemp(suffix=".parquet", prefix="freight-partial-")
        os.close(handle)
        try:
            path, final = service.results_path(tenant, job_id, Path(scratch))
        except BaseException:
            os.unlink(scratch)
            raise
        cleanup = BackgroundTask(os.unlink, scratch)
        if final:
            os.unlink(scratch)
            cleanup = None
        return FileResponse(
            path,
            media_type=PARQUET_MEDIA_TYPE,
            filename=f"{job_id}-results.parquet",
            headers={"X-Freight-Results": "final" if final else "partial"},
            background=cleanup,
        )

    @app.get("/v1/jobs/{job_id}/metrics", response_model=JobMetrics, tags=["jobs"])
    def job_metrics(job_id: str, tenant: Tenant, service: Service) -> dict:
        return service.metrics(tenant, job_id)

    @app.get("/v1/jobs/{job_id}/report", tags=["jobs"], response_class=HTMLResponse)
    def job_report(job_id: str, tenant: Tenant, service: Service) -> HTMLResponse:
        """One self-contained HTML page: parameters, status, cost table and plots."""
        return HTMLResponse(job_report_html(service, tenant, job_id))
