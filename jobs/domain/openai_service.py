"""The OpenAI-compatible Batch API over the job machinery: files (stored in the blob store), and
batches, each of which is one Freight job (one JSONL line = one row) submitted through
JobService.submit, so validation, sharding, crash safety and cost metrics are the native ones.
BatchService has this one role: it holds a JobService for the job lifecycle (submit, view, cancel,
results) and answers with OpenAI's objects (openai_objects.py); JobService knows nothing of batches.

One source of truth: a batch's status and timestamps are read from its job (status and events,
storage/status.py JOB_TRANSITIONS); the batch row holds only what the job does not (endpoint, input
file, window, metadata, refused lines, output and error files, when it expired).

Reads (retrieve, list) never write. The output and error files are written when the job becomes final,
by the worker or the recovery sweep (batch_files.py). Expiry is the recovery sweep's too (recovery.py,
expire_if_due below): a batch past its `expires_at` whose job still runs is cancelled (the job's own
cancel: finished rows are kept, the rest are never run) and noted as expired in the same transaction;
it shows `expired` once the job is final, its unrun rows in the error file as `batch_expired`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import BinaryIO

from sqlalchemy.orm import Session

from jobs.domain.batch_files import BatchFiles, shown_status
from jobs.domain.deadline import window_length
from jobs.domain.errors import Conflict, InputError, NotFound, clip_repr
from jobs.domain.openai_batch import ENDPOINTS, MAX_NAMED_LINE_ERRORS, LineError, batch_job_params
from jobs.domain.openai_objects import (
    Batch,
    BatchError,
    BatchErrors,
    BatchList,
    BatchRequestCounts,
    BatchUsage,
    FileDeleted,
    FileList,
    FileObject,
    InputTokensDetails,
    OutputTokensDetails,
)
from jobs.domain.openai_rows import read_batch_rows
from jobs.domain.schemas import job_params
from jobs.domain.service import JobService
from jobs.domain.text_rule import repaired, text_problem
from storage import job_store, openai_store
from storage.arrow_path import ArrowPath
from storage.blobs import UploadTooLarge
from storage.models import OpenAIBatch, OpenAIFile, as_utc, utcnow
from storage.status import CANCELLABLE_JOB_STATUSES, JobStatus

INPUT_PURPOSE = "batch"
MAX_FILENAME_CHARS = 1024
Errors = list[BatchError] | None  # why a batch failed (its `errors`), None for a batch with a job
# Adds the batch row (job id, refused lines, errors) to the session's transaction, not committing it.
StoreBatch = Callable[[Session, str | None, list[LineError], Errors], None]


def _ts(moment: datetime) -> int:
    return int(as_utc(moment).timestamp())


def _ts_or_none(moment: datetime | None) -> int | None:
    return None if moment is None else _ts(moment)


def file_object(row: OpenAIFile) -> FileObject:
    return FileObject(
        id=row.id,
        bytes=row.bytes,
        created_at=_ts(row.created_at),
        filename=repaired(row.filename),
        purpose=row.purpose,
    )


class BatchService:
    def __init__(self, jobs: JobService) -> None:
        self.jobs = jobs
        self.sessions = jobs.sessions
        self.blobs = jobs.blobs
        self.settings = jobs.settings
        self.files = BatchFiles(jobs)

    # ---- files ---------------------------------------------------------------------------------

    def upload(self, tenant: str, source: BinaryIO, filename: str | None, purpose: str) -> FileObject:
        if purpose != INPUT_PURPOSE:
            raise InputError(
                f"purpose {clip_repr(purpose)} is not supported; upload batch input files with purpose "
                f"{INPUT_PURPOSE!r}",
                field="purpose",
            )
        filename = filename or "upload.jsonl"
        problem = text_problem(filename)  # the text rule: the name is stored
        if len(filename) > MAX_FILENAME_CHARS or problem is not None:
            raise InputError(
                f"the filename must have at most {MAX_FILENAME_CHARS} characters of valid text and no NUL"
                + (f"; it {problem}" if problem else ""),
                field="file",
            )
        file_id = openai_store.new_file_id()
        name = openai_store.file_blob_name(file_id)
        try:
            size = self.blobs.write_stream(name, source, self.settings.max_upload_bytes)
        except UploadTooLarge as exc:
            self.blobs.delete(name)
            raise InputError(str(exc), status_code=413, field="file") from exc
        with self.sessions() as session:
            row = openai_store.add_file(
                session,
                file_id=file_id,
                tenant=tenant,
                purpose=purpose,
                filename=filename,
                size=size,
                blob_name=name,
            )
            return file_object(row)

    def _file(self, session: Session, tenant: str, file_id: str) -> OpenAIFile:
        row = openai_store.get_file(session, file_id, tenant)
        if row is None:
            raise NotFound(f"no file {file_id!r}")
        return row

    def get_file(self, tenant: str, file_id: str) -> FileObject:
        with self.sessions() as session:
            return file_object(self._file(session, tenant, file_id))

    def file_source(self, tenant: str, file_id: str) -> ArrowPath:
        with self.sessions() as session:
            return self.blobs.arrow(self._file(session, tenant, file_id).blob_name)

    def list_files(self, tenant: str, purpose: str | None, after: str | None, limit: int) -> FileList:
        with self.sessions() as session:
            try:
                rows, has_more = openai_store.list_files(
                    session, tenant, purpose=purpose, after=after, limit=limit
                )
            except LookupError as exc:
                raise InputError(str(exc), field="after") from exc
            return FileList.of([file_object(row) for row in rows], has_more)

    def delete_file(self, tenant: str, file_id: str) -> FileDeleted:
        with self.sessions() as session:
            row = self._file(session, tenant, file_id)
            name = row.blob_name
            if not openai_store.delete_file(session, file_id, tenant):
                raise NotFound(f"no file {file_id!r}")
        self.blobs.delete(name)
        return FileDeleted(id=file_id, deleted=True)

    # ---- batches -------------------------------------------------------------------------------

    def create(
        self,
        tenant: str,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
    ) -> Batch:
        if endpoint not in ENDPOINTS:
            raise InputError(f"endpoint must be one of {list(ENDPOINTS)}", field="endpoint")
        try:  # OpenAI takes "24h" only; Freight takes any window its jobs take ("1h", "7d"), and schedules by it
            window = window_length(completion_window)
        except ValueError as exc:
            raise InputError(str(exc), field="completion_window") from None
        metadata = job_params({"metadata": metadata or {}}).metadata  # the job's metadata rules
        with self.sessions() as session:
            source = openai_store.get_file(session, input_file_id, tenant)
            if source is None:
                raise NotFound(f"no file {input_file_id!r}")
            if source.purpose != INPUT_PURPOSE:
                raise InputError(
                    f"file {input_file_id} has purpose {source.purpose!r}; a batch reads a {INPUT_PURPOSE!r} file",
                    field="input_file_id",
                )
            blob_name = source.blob_name
        created_at = utcnow()
        batch_id = openai_store.new_batch_id()

        def store(session: Session, job_id: str | None, line_errors: list[LineError], errors: Errors) -> None:
            openai_store.add_batch(
                session,
                batch_id=batch_id,
                tenant=tenant,
                job_id=job_id,
                endpoint=endpoint,
                input_file_id=input_file_id,
                completion_window=completion_window,
                metadata=metadata,
                created_at=created_at,
                expires_at=created_at + window,
                line_errors=[error.as_dict() for error in line_errors],
                errors=None if errors is None else [error.model_dump() for error in errors],
                commit=False,
            )

        failed = self._submit(tenant, blob_name, endpoint, completion_window, store)
        if failed is not None:  # no job: the failed batch's row alone, final at once, with its error file
            with self.sessions() as session:
                store(session, None, *failed)
                session.commit()
                self.files.write(session, self._batch(session, tenant, batch_id), None)
        return self.get(tenant, batch_id)

    def _submit(
        self, tenant: str, blob_name: str, endpoint: str, completion_window: str, store: StoreBatch
    ) -> tuple[list[LineError], Errors] | None:
        """Make the good lines one job, stored with its batch row (`store`) in one transaction: None.
        When no job is made: (refused lines, errors of the failed batch), nothing stored. The input file
        is read from the store a chunk at a time and its rows written to a local temporary Parquet file
        (openai_rows.py): neither the file nor its requests are held whole."""
        grammar = self.jobs.grammar_session()  # one budget for the lines and the rows they become
        try:
            with self.blobs.open_input(blob_name) as stream:
                rows = read_batch_rows(
                    stream.read, endpoint, self.jobs.resolver(), grammar, self.settings.json_limits
                )
        except InputError as exc:
            return [], [BatchError(code="invalid_file", message=exc.message, param=exc.field)]
        with rows:
            if rows.first is None:
                named = [
                    BatchError(code=error.code, message=error.message, param=error.param, line=error.line)
                    for error in rows.errors[:MAX_NAMED_LINE_ERRORS]
                ]
                return rows.errors, named
            # chat outputs are bounded by the context alone: this model's (the registry's, or the default)
            context_len = self.jobs.served(rows.first.model).context_len
            params = batch_job_params(endpoint, rows.first, chat_max_tokens=context_len - 1)
            # the batch's window is its job's deadline: shards are scheduled by it (docs/scheduling.md)
            params = params.model_copy(update={"completion_window": completion_window})
            try:
                self.jobs.submit(
                    tenant,
                    rows.file,
                    params,
                    grammar,
                    with_job=lambda session, job_id: store(session, job_id, rows.errors, None),
                )
            except InputError as exc:
                row = exc.row
                line = rows.row_lines[row] if row is not None and 0 <= row < rows.rows else None
                return rows.errors, [BatchError(code="invalid_file", message=exc.message, line=line)]
        return None

    def _batch(self, session: Session, tenant: str, batch_id: str) -> OpenAIBatch:
        row = openai_store.get_batch(session, batch_id, tenant)
        if row is None:
            raise NotFound(f"no batch {batch_id!r}")
        return row

    def get(self, tenant: str, batch_id: str) -> Batch:
        with self.sessions() as session:
            return self._view(session, tenant, self._batch(session, tenant, batch_id))

    def list(self, tenant: str, after: str | None, limit: int) -> BatchList:
        with self.sessions() as session:
            try:
                rows, has_more = openai_store.list_batches(session, tenant, after=after, limit=limit)
            except LookupError as exc:
                raise InputError(str(exc), field="after") from exc
            return BatchList.of([self._view(session, tenant, row) for row in rows], has_more)

    def cancel(self, tenant: str, batch_id: str) -> Batch:
        with self.sessions() as session:
            row = self._batch(session, tenant, batch_id)
            if row.job_id is None:
                raise Conflict(f"batch {batch_id} is failed; only a running batch can be cancelled")
            job_id = row.job_id
        try:
            self.jobs.cancel(tenant, job_id)
        except Conflict as exc:
            raise Conflict(str(exc).replace(f"job {job_id}", f"batch {batch_id}")) from exc
        return self.get(tenant, batch_id)

    # ---- the batch object ----------------------------------------------------------------------

    def _view(self, session: Session, tenant: str, row: OpenAIBatch) -> Batch:
        """The batch object, read only: nothing here writes (files and expiry are the worker's and the
        recovery sweep's)."""
        job = job_store.get_job(session, row.job_id, tenant=tenant) if row.job_id else None
        status = shown_status(row, job.status if job else None)
        entered: dict[str, datetime] = {}
        if job is not None:
            for event in job_store.events(session, job.id):
                entered.setdefault(event.status, event.at)
        finished = job.finished_at if job is not None else row.created_at
        refused = len(row.line_errors)  # lines that never became rows: failed requests
        counts = BatchRequestCounts(total=refused, completed=0, failed=refused)
        usage = None
        if job is not None:
            rows = self.jobs.view(session, job).request_counts
            counts = BatchRequestCounts(
                total=refused + rows.total, completed=rows.completed, failed=refused + rows.failed
            )
            metrics = self.jobs.metrics(tenant, job.id)
            cached = metrics.get("cached_prompt_tokens", 0)
            usage = BatchUsage(
                input_tokens=metrics["prompt_tokens"],
                input_tokens_details=InputTokensDetails(cached_tokens=cached),
                output_tokens=metrics["output_tokens"],
                output_tokens_details=OutputTokensDetails(),
                total_tokens=metrics["prompt_tokens"] + metrics["output_tokens"],
            )
        expired = row.expired_at is not None

        def final_at(when: str) -> int | None:
            return _ts_or_none(finished) if status == when else None

        # Stored values are rendered whatever they hold (text_rule.repaired): a read never fails on them.
        errors = None
        if row.errors:
            errors = BatchErrors(data=[BatchError.model_validate(error) for error in repaired(row.errors)])
        return Batch(
            id=row.id,
            endpoint=row.endpoint,
            model=job.model if job is not None else None,
            errors=errors,
            input_file_id=row.input_file_id,
            completion_window=row.completion_window,
            status=status,
            output_file_id=row.output_file_id,
            error_file_id=row.error_file_id,
            created_at=_ts(row.created_at),
            in_progress_at=_ts_or_none(entered.get(JobStatus.QUEUED)),
            expires_at=_ts(row.expires_at),
            finalizing_at=_ts_or_none(entered.get(JobStatus.FINALIZING)),
            completed_at=final_at("completed"),
            failed_at=final_at("failed"),
            expired_at=_ts_or_none(row.expired_at),
            cancelling_at=None if expired else _ts_or_none(entered.get(JobStatus.CANCELLING)),
            cancelled_at=final_at("cancelled"),
            request_counts=counts,
            usage=usage,
            metadata=repaired(row.batch_metadata),
        )


def expire_if_due(session: Session, row: OpenAIBatch, job_status: str, now: datetime) -> bool:
    """A batch past its window whose job still runs: cancel the job (finished rows are kept) and note
    the expiry. The API's recovery sweep calls it (a read does not: reads never write). True when this
    call expired it."""
    if row.expired_at is not None or row.job_id is None or now < as_utc(row.expires_at):
        return False
    # The cancel and the note in one transaction: the worker that finalizes the cancelled job writes the
    # batch's files, and must see why it was cancelled (batch_expired, not batch_cancelled).
    if job_status in CANCELLABLE_JOB_STATUSES and job_store.request_cancel(session, row.job_id, commit=False):
        return openai_store.mark_expired(session, row.id, now)
    return False
