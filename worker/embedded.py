"""`freight run`: the whole job in this process, on SQLite under FREIGHT_HOME, through the same
submit, shard and finalize code as the service. The engine is imported only when a job runs."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.domain.schemas import JobParams, job_params
from jobs.domain.service import LOCAL_TENANT, JobService
from jobs.domain.settings import Settings
from storage.blobs import BlobStore, results_name
from storage.db import make_engine, make_session_factory, upgrade
from storage.status import JobStatus

CHUNK_BYTES = 1 << 20


@dataclass
class EmbeddedResult:
    job_id: str
    status: str
    metrics: dict[str, Any]
    output_path: Path


@dataclass
class RunProgress:
    rows_done: int
    rows_total: int
    tokens_done: int
    elapsed_s: float


def run_embedded(
    input_path: Path,
    output_path: Path,
    params: JobParams | Mapping[str, Any],
    settings: Settings | None = None,
    on_progress: Callable[[RunProgress], None] | None = None,
    on_status: Callable[[str], None] | None = None,
) -> EmbeddedResult:
    from worker.finalize import finalize_job
    from worker.llm_pool import LLMPool
    from worker.model_registry import ModelRegistry
    from worker.retry import RetryPolicy, ShardRetry
    from worker.shard.context import WorkerContext
    from worker.shard.executor import ready_to_finalize, run_shard

    if not isinstance(params, JobParams):
        params = job_params(params)  # a params dict: the API's check and error (InputError)
    settings = settings or Settings()
    url = settings.embedded_database_url
    upgrade(url)
    engine = make_engine(url)
    try:
        sessions = make_session_factory(engine)
        # Nothing but a folder, whatever FREIGHT_STORAGE_URL says (as SQLite whatever FREIGHT_DATABASE_URL).
        blobs = BlobStore(settings.resolved_data_dir)
        service = JobService(settings, sessions, blobs, dispatcher=None, allow_any_model=True)
        pool = LLMPool(settings, ModelRegistry(sessions))
        # Recorded before validation: the job is checked against this model's own context, and a model
        # the engine cannot load is refused (InputError) before a job exists.
        pool.inspect(service.model_of(params))
        with open(input_path, "rb") as upload:
            job = service.submit(LOCAL_TENANT, upload, params)
        ctx = WorkerContext(settings=settings, sessions=sessions, blobs=blobs)
        if on_status:
            on_status(f"job {job.id}: {job.request_counts.total} rows; loading {job.model}")
        pool.get(service.resolve(params))  # load before the progress bar starts
        tracker = _ProgressTracker(job.request_counts.total, on_progress)
        policy = RetryPolicy.from_settings(settings)
        for shard_index in service.shard_indices(job.id):
            for _attempt in policy.attempts():
                try:
                    run_shard(ctx, pool, job.id, shard_index, on_progress=tracker.shard_update)
                    break
                except ShardRetry:
                    continue
            tracker.shard_done()
        if ready_to_finalize(ctx, job.id):
            finalize_job(ctx, job.id)
        final = service.get(LOCAL_TENANT, job.id)
        metrics = service.metrics(LOCAL_TENANT, job.id)
        if final.status == JobStatus.COMPLETED:
            output_path.parent.mkdir(parents=True, exist_ok=True)
            with blobs.open_input(results_name(job.id)) as source, open(output_path, "wb") as sink:
                shutil.copyfileobj(source, sink, CHUNK_BYTES)
        return EmbeddedResult(job.id, final.status, metrics, output_path)
    finally:
        engine.dispose()


class _ProgressTracker:
    """Turns per-shard cumulative progress into job-wide progress."""

    def __init__(self, rows_total: int, on_progress: Callable[[RunProgress], None] | None) -> None:
        self.rows_total = rows_total
        self.on_progress = on_progress
        self.started = time.monotonic()
        self.rows_before = 0  # rows of finished shards
        self.tokens_before = 0
        self.shard_rows = 0
        self.shard_tokens = 0

    def shard_update(self, update) -> None:
        self.shard_rows, self.shard_tokens = update.rows_done, update.tokens_done
        self._emit()

    def shard_done(self) -> None:
        self.rows_before += self.shard_rows
        self.tokens_before += self.shard_tokens
        self.shard_rows = self.shard_tokens = 0
        self._emit()

    def _emit(self) -> None:
        if self.on_progress is not None:
            self.on_progress(
                RunProgress(
                    rows_done=self.rows_before + self.shard_rows,
                    rows_total=self.rows_total,
                    tokens_done=self.tokens_before + self.shard_tokens,
                    elapsed_s=time.monotonic() - self.started,
                )
            )
