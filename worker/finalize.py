"""Finalize a job: write the results Parquet and the metrics JSON, then set the final status (failed
when its shards noted an error on it: job_store.note_error). It is idempotent (files are replaced
atomically) and the status moves exactly once, so a redelivered or duplicated finalize is harmless.
A job made for an OpenAI batch then gets the batch's output and error files (jobs/domain/batch_files.py),
so that no read of the batch has to write them."""

from __future__ import annotations

import json
import logging

from sqlalchemy.exc import DBAPIError

from jobs.domain.batch_files import BatchFiles
from jobs.domain.metrics import compute_metrics
from jobs.domain.results import write_final_results
from jobs.domain.service import JobService
from jobs.domain.summary_results import add_summary_columns
from storage import job_store
from storage.blobs import metrics_name, results_name, store_unreachable
from storage.models import utcnow
from storage.status import FINAL_JOB_STATUSES, JobStatus
from worker.inputs import open_job_input
from worker.shard.context import WorkerContext

log = logging.getLogger(__name__)


def finalize_job(ctx: WorkerContext, job_id: str) -> str | None:
    """Returns the job's status afterwards (None for an unknown job)."""
    status = _finalize(ctx, job_id)
    if status in FINAL_JOB_STATUSES:  # a redelivered finalize too: the files may not be written yet
        write_batch_files(ctx, job_id)
    return status


def write_batch_files(ctx: WorkerContext, job_id: str) -> None:
    """The files of the OpenAI batch made with the job, if any and not written yet. The job is final
    whatever happens here: a failure leaves the files to the API's recovery sweep, not to a retry."""
    try:
        jobs = JobService(ctx.settings, ctx.sessions, ctx.blobs, dispatcher=None)
        BatchFiles(jobs).write_for_job(job_id)
    except Exception:
        log.exception("writing the batch files of %s failed; the recovery sweep writes them", job_id)


def _finalize(ctx: WorkerContext, job_id: str) -> str | None:
    with ctx.sessions() as session:
        job = job_store.get_job(session, job_id)
        if job is None or job.status != JobStatus.FINALIZING:
            return job.status if job is not None else None
        try:
            with ctx.blobs.atomic_path(results_name(job_id)) as temp:
                write_final_results(session, job, open_job_input(ctx.blobs, ctx.settings, job.input_name), temp)
                if job.params.get("task") == "summarize":
                    add_summary_columns(session, job, ctx.blobs.arrow(job.input_name), temp)
            finished_at = utcnow()
            metrics = compute_metrics(session, job, ctx.settings, finished_at=finished_at)
            ctx.blobs.write_text(metrics_name(job_id), json.dumps(metrics, indent=2))
            final = JobStatus.COMPLETED
            if job.error:  # noted while the shards ran: the model cannot be served
                final = JobStatus.FAILED
            if job.cancel_requested:
                final = JobStatus.CANCELLED
            job_store.move(session, job_id, to=final, extra={"metrics": metrics, "finished_at": finished_at})
        except Exception as exc:
            if (isinstance(exc, DBAPIError) and exc.connection_invalidated) or store_unreachable(exc):
                raise  # the database or the store is unreachable: the task tries again, the job is fine
            log.exception("finalizing %s failed", job_id)
            session.rollback()
            job_store.move(
                session,
                job_id,
                to=JobStatus.FAILED,
                only_from=[JobStatus.FINALIZING],
                extra={"error": f"finalize failed: {exc.__class__.__name__}: {exc}"},
            )
        return job_store.job_status(session, job_id)
