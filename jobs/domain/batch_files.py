"""The output and error files of an OpenAI batch, written once, when its job becomes final.

The worker that finalizes the job writes them (worker/finalize.py); for a job finalized without it (the
worker died in between, or its write failed) the API's recovery sweep does (recovery.py); a batch that
failed before it had a job gets its error file from the request that created it. A read never writes:
until the files are recorded, a batch whose job is final shows `finalizing` (OpenAI's word for "the
results are being prepared"), so a client that sees a final status always finds its files.

Two writers at once (a worker and a sweep) may both write them; one conditional update
(openai_store.set_outputs) picks the files that count and the other's are deleted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, nullcontext
from datetime import datetime
from typing import Any

import pyarrow.parquet as pq
from sqlalchemy.orm import Session

from jobs.domain.openai_batch import LineError, error_line, jsonl, output_line
from jobs.domain.openai_objects import BatchRequestOutput
from jobs.domain.service import JobService
from storage import job_store, openai_store
from storage.arrow_path import parquet_file
from storage.models import Job, OpenAIBatch, as_utc, utcnow
from storage.scratch import scratch_file
from storage.status import COMPLETED_FINISH_REASONS, FinishReason, JobStatus

OUTPUT_PURPOSE = "batch_output"
RESULT_BATCH_ROWS = 4096
FINAL_BATCH_STATUSES = frozenset({"completed", "failed", "cancelled", "expired"})


def batch_status(job_status: str | None, expired: bool) -> str:
    """The batch's status from its job's (None: the batch failed before it had a job)."""
    if job_status is None:
        return "failed"
    status = JobStatus(job_status)
    if expired and status != JobStatus.FAILED:
        # Cancelled for its window: finishing what runs, then expired (keeping what finished).
        return "expired" if status in (JobStatus.CANCELLED, JobStatus.COMPLETED) else "finalizing"
    if status in (JobStatus.QUEUED, JobStatus.IN_PROGRESS):
        return "in_progress"
    return status.value  # finalizing, completed, failed, cancelling, cancelled: the same words


def shown_status(row: OpenAIBatch, job_status: str | None) -> str:
    """The status a read shows: final only once the batch's files are recorded."""
    status = batch_status(job_status, row.expired_at is not None)
    if status in FINAL_BATCH_STATUSES and not row.outputs_ready:
        return "finalizing"
    return status


def _ts(moment: datetime | None) -> int | None:
    return None if moment is None else int(as_utc(moment).timestamp())


class BatchFiles:
    """Writes a final batch's files from its refused lines and its job's results."""

    def __init__(self, jobs: JobService) -> None:
        self.jobs = jobs
        self.sessions = jobs.sessions
        self.blobs = jobs.blobs

    def write_for_job(self, job_id: str) -> bool:
        """The files of the batch made with job `job_id`, if there is one whose files are due and not
        written yet. True when this call recorded them."""
        with self.sessions() as session:
            row = openai_store.batch_of_job(session, job_id)
            if row is None or row.outputs_ready:
                return False
            return self.write(session, row, job_store.get_job(session, job_id))

    def write(self, session: Session, row: OpenAIBatch, job: Job | None) -> bool:
        """Write the output file (answered rows) and the error file (refused lines, failed rows, rows
        cancelled or expired), streaming the job's results, and record them unless another writer
        recorded its own first. A file with no line is not made (its id stays null). Nothing happens
        while the job runs. True when this call recorded the files."""
        status = batch_status(job.status if job is not None else None, row.expired_at is not None)
        if status not in FINAL_BATCH_STATUSES or row.outputs_ready:
            return False
        written: dict[str, tuple[str, str, int]] = {}  # kind -> (file id, blob name, bytes)
        with ExitStack() as stack:
            sinks = {}
            counts = {"output": 0, "error": 0}
            for kind in ("output", "error"):
                file_id = openai_store.new_file_id()
                name = openai_store.file_blob_name(file_id)
                temp = stack.enter_context(self.blobs.atomic_path(name))
                sinks[kind] = stack.enter_context(open(temp, "wb"))
                written[kind] = (file_id, name, 0)
            for kind, line in self._lines(row, job, status):
                sinks[kind].write(jsonl([line]))
                counts[kind] += 1
            for kind, sink in sinks.items():
                file_id, name, _ = written[kind]
                written[kind] = (file_id, name, sink.tell())
        for kind in ("output", "error"):
            if not counts[kind]:
                self.blobs.delete(written.pop(kind)[1])
        files = [
            {
                "file_id": file_id,
                "tenant": row.tenant,
                "purpose": OUTPUT_PURPOSE,
                "filename": f"{row.id}_{kind}.jsonl",
                "size": size,
                "blob_name": name,
            }
            for kind, (file_id, name, size) in written.items()
        ]
        ids = {
            f"{kind}_file_id": written[kind][0] if kind in written else None for kind in ("output", "error")
        }
        if openai_store.set_outputs(session, row.id, files, **ids):
            return True
        for file in files:  # another writer recorded its files first
            self.blobs.delete(file["blob_name"])
        return False

    def _lines(
        self, row: OpenAIBatch, job: Job | None, status: str
    ) -> Iterator[tuple[str, BatchRequestOutput]]:
        """("output" | "error", line) for every request of the batch: refused lines first, then the
        job's rows in row order."""
        for error in map(LineError.from_dict, row.line_errors):
            yield (
                "error",
                error_line(
                    batch_id=row.id,
                    key=f"line{error.line}",
                    custom_id=error.custom_id,
                    code=error.code,
                    message=error.message,
                    status_code=400,
                ),
            )
        if job is None:
            return
        cancelled_code = "batch_expired" if status == "expired" else "batch_cancelled"
        created = _ts(job.finished_at) or _ts(utcnow())
        for record in self._results(row.tenant, job.id):
            if record["finish_reason"] in COMPLETED_FINISH_REASONS:
                yield (
                    "output",
                    output_line(
                        batch_id=row.id,
                        row_index=record["row_index"],
                        custom_id=record["custom_id"],
                        endpoint=row.endpoint,
                        model=job.model,
                        created=created,
                        text=record["output_text"],
                        finish_reason=record["finish_reason"],
                        prompt_tokens=record["prompt_tokens"],
                        output_tokens=record["output_tokens"],
                    ),
                )
                continue
            cancelled = record["finish_reason"] == FinishReason.CANCELLED
            yield (
                "error",
                error_line(
                    batch_id=row.id,
                    key=str(record["row_index"]),
                    custom_id=record["custom_id"],
                    code=cancelled_code if cancelled else "request_failed",
                    message=record["error"] or "the request failed",
                    status_code=None,
                ),
            )

    def _results(self, tenant: str, job_id: str) -> Iterator[dict[str, Any]]:
        """The job's result rows in row order, a Parquet batch at a time: its final results file
        (every row), or, for a job that failed before writing one, the rows stored."""
        # The stored rows go to a scratch file whose name is removed before they are read: the open
        # handle reads them, so no path is left behind however the files' writing ends (storage/scratch.py).
        with scratch_file("freight-batch-", ".parquet") as scratch:
            source, final = self.jobs.results_source(tenant, job_id, scratch)
            stored = None if final else open(scratch, "rb")  # noqa: SIM115 - closed below
        with stored or nullcontext():
            parquet = parquet_file(source) if stored is None else pq.ParquetFile(stored)
            for batch in parquet.iter_batches(batch_size=RESULT_BATCH_ROWS):
                yield from batch.to_pylist()
