"""Job operations shared by the HTTP API and the embedded `freight run`: submit (store, validate,
shard, enqueue), read, list, cancel, results and metrics, each scoped to one tenant."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from sqlalchemy.orm import Session, sessionmaker

from jobs.domain.broker import TaskLabels
from jobs.domain.deadline import job_deadline
from jobs.domain.errors import Conflict, InputError, NotFound
from jobs.domain.grammar_check import GrammarChecker, GrammarRefusal, SubmissionGrammar
from jobs.domain.input_refs import CheckedReference, check_reference
from jobs.domain.metrics import compute_metrics
from jobs.domain.quote import JobQuote, estimate, with_deadline
from jobs.domain.results import write_partial_results
from jobs.domain.schemas import JobEventOut, JobList, JobObject, JobParams, RequestCounts, ResolvedParams
from jobs.domain.served_models import ServedModel, served_model
from jobs.domain.settings import Settings
from jobs.domain.sharding import cut_shards
from jobs.domain.summarize import check_summarize_file, task_fields
from jobs.domain.text_rule import repaired
from jobs.domain.validation import ValidatedInput, validate_parquet
from storage import job_store, model_store
from storage.arrow_path import ArrowPath
from storage.blobs import BlobStore, UploadTooLarge, input_name, results_name, staging_name
from storage.input_set import manifest_name
from storage.models import Job, utcnow
from storage.shard_store import shard_indices
from storage.status import FINAL_JOB_STATUSES, JobStatus
from storage.storage_url import s3_filesystem

log = logging.getLogger(__name__)
LOCAL_TENANT = "local"  # the one tenant of the embedded database (`freight run`, `freight summarize`)


class Dispatcher(Protocol):
    def dispatch(
        self, job_id: str, model: str, shard_indices: list[int], labels: TaskLabels | None = None
    ) -> None: ...

    def withdraw(self, job_id: str, model: str) -> int: ...


class BrokerUnavailable(Exception):
    pass


class JobService:
    def __init__(
        self,
        settings: Settings,
        session_factory: sessionmaker[Session],
        blobs: BlobStore,
        dispatcher: Dispatcher | None,
        *,
        allow_any_model: bool = False,  # the embedded runner loads whatever the user names
        grammar: GrammarChecker | None = None,  # asks the grammar engine at submission
    ) -> None:
        self.settings = settings
        self.sessions = session_factory
        self.blobs = blobs
        self.dispatcher = dispatcher
        self.allow_any_model = allow_any_model
        self.grammar = grammar

    def grammar_session(self) -> SubmissionGrammar:
        """The grammar check of one submission: one time budget, each constraint asked once."""
        return SubmissionGrammar(self.grammar, self.settings.grammar_budget_seconds)

    def model_of(self, params: JobParams) -> str:
        return params.model or self.settings.default_model

    def served(self, model: str) -> ServedModel:
        """What the model registry says of `model` (its context; why the engine cannot load it)."""
        if self.sessions is None:  # a service without a database (tests of the checks alone) knows none
            return served_model(model, None, self.settings.max_model_len)
        with self.sessions() as session:
            record = model_store.get_model(session, name=model)
        return served_model(model, record, self.settings.max_model_len)

    def resolve(self, params: JobParams) -> ResolvedParams:
        return self._resolve(params, self.served, self.grammar_session())[0]

    def resolver(self, grammar: GrammarRefusal | None = None) -> Callable[[JobParams], ResolvedParams]:
        """`resolve` reading each model's registry row once: a batch file checks every line."""
        served = cache(self.served)
        return lambda params: self._resolve(params, served, grammar)[0]

    def _resolve(
        self, params: JobParams, served_of: Callable[[str], ServedModel], grammar: GrammarRefusal | None
    ) -> tuple[ResolvedParams, ServedModel]:
        settings = self.settings
        model = self.model_of(params)
        if not self.allow_any_model and model not in settings.accepted_models():
            raise InputError(
                f"unknown model {model!r}; this service serves {settings.accepted_models()}", field="model"
            )
        served = served_of(model)
        if served.refusal is not None:
            raise InputError(served.refusal, field="model")
        if params.max_tokens >= served.context_len:
            raise InputError(
                f"max_tokens is {params.max_tokens}; it must be below the model context of "
                f"{served.context_len} tokens",
                field="max_tokens",
            )
        quantization = params.quantization or settings.quantization
        by_task = task_fields(params, served.context_len)
        resolved = ResolvedParams(
            model=model,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop=params.stop,
            template=params.template,
            prompt_column=params.prompt_column,
            chat=params.chat,
            truncate=params.truncate,
            dtype=params.dtype or settings.dtype,
            quantization=None if quantization in (None, "none") else quantization,
            kv_cache_dtype=params.kv_cache_dtype or settings.kv_cache_dtype,
            structured=params.structured(),
            reuse_results=params.reuse_results,
        )
        if resolved.structured is not None and grammar is not None:
            refused = grammar(resolved.structured)
            if refused is not None:
                raise InputError(refused, field=resolved.structured.kind)
        return resolved.model_copy(update=by_task), served

    def checked_params(
        self, params: JobParams, grammar: GrammarRefusal | None
    ) -> tuple[ResolvedParams, ServedModel]:
        """The submission's checks of its params (model, context, constraints), for a quote too."""
        return self._resolve(params, self.served, grammar)

    def check_input(
        self, where: ArrowPath, resolved: ResolvedParams, served: ServedModel, grammar: GrammarRefusal | None
    ) -> tuple[ValidatedInput, list[list[int]]]:
        """The submission's checks of its file, and the shards it is cut into. A quote runs the same
        ones (jobs/domain/quote.py), so a file is refused by both or by neither, with the same answer."""
        if resolved.summarize is not None:
            check_summarize_file(where, resolved.summarize)
        validated = validate_parquet(where, resolved, served.context_len, grammar)
        return validated, cut_shards(validated.prompt_chars, self.settings.shard_size)

    def submit(
        self,
        tenant: str,
        upload: BinaryIO,
        params: JobParams,
        grammar: SubmissionGrammar | None = None,
        *,
        with_job: Callable[[Session, str], None] | None = None,
    ) -> JobObject:
        """Validate everything, then store the job in one step that completes or leaves nothing.

        The upload waits under a staging name (no row points to it) while it is validated. Then the file
        moves to its place, the job, its shards and events are inserted in one transaction, and the shard
        messages are sent. A failure at any point removes what was made: the file, the rows (once
        committed) and the messages already sent. `grammar` is the submission's grammar check (one budget
        for the whole submission; a batch passes the one its lines were checked with). `with_job` adds rows
        made with the job (a batch's row; given the session and the job id) to the job's transaction."""
        grammar = grammar or self.grammar_session()
        created_at = utcnow()
        due = job_deadline(completion_window=params.completion_window, deadline=params.deadline, now=created_at)
        resolved, served = self._resolve(params, self.served, grammar)
        job_id = job_store.new_job_id()
        staged, name = staging_name(job_id), input_name(job_id)
        stored = False
        try:
            try:
                self.blobs.write_stream(staged, upload, self.settings.max_upload_bytes)
            except UploadTooLarge as exc:
                raise InputError(str(exc), status_code=413) from exc
            validated, shards = self.check_input(self.blobs.arrow(staged), resolved, served, grammar)
            quoted = self._submission_quote(params, resolved, validated, len(shards), due)
            self.blobs.rename(staged, name)
            self._store_job(
                job_id, tenant, params, resolved, input_name=name, created_at=created_at,
                num_rows=validated.num_rows, shards=shards, deadline=due,
                deadline_warning=quoted.deadline_warning, quote=quoted.model_dump(mode="json"),
                also=None if with_job is None else lambda session: with_job(session, job_id),
            )  # fmt: skip
            stored = True
            self._dispatch(job_id, resolved.model, len(shards), TaskLabels.of(tenant, params.priority, due))
        except BaseException:
            self._undo_submission(job_id, resolved.model, stored)
            raise
        return self.get(tenant, job_id)

    def submit_by_reference(self, tenant: str, uris: list[str], params: JobParams) -> JobObject:
        """A job whose input stays where it is (s3:// URIs under FREIGHT_INPUT_ALLOW, docs/storage.md):
        every check runs on the files in place before anything is stored; then the manifest of the files,
        the job and its row-group shards are stored and the shard messages sent, or (on a failure) none."""
        grammar = self.grammar_session()
        created_at = utcnow()
        due = job_deadline(completion_window=params.completion_window, deadline=params.deadline, now=created_at)
        resolved, served = self._resolve(params, self.served, grammar)
        checked = self.check_reference(uris, resolved, served, grammar)
        quoted = self._submission_quote(params, resolved, checked.validated, len(checked.pieces), due)
        job_id = job_store.new_job_id()
        stored = False
        try:
            self.blobs.write_text(manifest_name(job_id), checked.inputs.to_json())
            self._store_job(
                job_id, tenant, params, resolved, input_name=manifest_name(job_id), created_at=created_at,
                num_rows=checked.num_rows, shards=[[] for _ in checked.pieces], deadline=due,
                deadline_warning=quoted.deadline_warning, quote=quoted.model_dump(mode="json"),
                pieces=checked.pieces,
            )  # fmt: skip
            stored = True
            self._dispatch(
                job_id, resolved.model, len(checked.pieces), TaskLabels.of(tenant, params.priority, due)
            )
        except BaseException:
            self._undo_submission(job_id, resolved.model, stored)
            raise
        return self.get(tenant, job_id)

    def check_reference(
        self, uris: list[str], resolved: ResolvedParams, served: ServedModel, grammar: GrammarRefusal | None
    ) -> CheckedReference:
        """The submission's checks of an input by reference, read in place, and its row-group shards. A
        quote runs the same ones (jobs/domain/quote.py)."""
        return check_reference(
            uris,
            resolved,
            served.context_len,
            grammar,
            allow=self.settings.input_allow,
            filesystem=s3_filesystem(self.settings.s3_endpoint_url),
            shard_size=self.settings.shard_size,
        )

    def _store_job(
        self,
        job_id: str,
        tenant: str,
        params: JobParams,
        resolved: ResolvedParams,
        *,
        input_name: str,
        created_at: datetime,
        num_rows: int,
        shards: list[list[int]],
        deadline: datetime | None,
        **extra: Any,
    ) -> None:
        """The job, its shards and events in one transaction (either submission path); `extra` is what only
        one path has: a warning, row-group pieces, rows stored with the job."""
        with self.sessions() as session:
            job_store.create_queued_job(
                session,
                job_id=job_id,
                tenant=tenant,
                model=resolved.model,
                params=resolved.model_dump(),
                metadata=params.metadata,
                input_name=input_name,
                created_at=created_at,
                num_rows=num_rows,
                shards=shards,
                priority=params.priority,
                deadline=deadline,
                **extra,
            )

    def _submission_quote(
        self,
        params: JobParams,
        resolved: ResolvedParams,
        validated: ValidatedInput,
        shards: int,
        due: datetime | None,
    ) -> JobQuote:
        """The job's quote, kept with it (its report sets it beside what the job cost; prompt tokens
        estimated from characters: the exact count is the quote endpoint's). With a deadline it says
        whether the ETA meets it; with strict_deadline a job that misses it is refused instead (422,
        before anything is stored)."""
        quote = estimate(self.settings, self.sessions, resolved, validated, shards, priority=params.priority)
        quoted = with_deadline(quote, due, utcnow())
        if quoted.deadline_warning is not None and params.strict_deadline:
            raise InputError(f"strict_deadline: {quoted.deadline_warning}", field="deadline")
        return quoted

    def _dispatch(self, job_id: str, model: str, num_shards: int, labels: TaskLabels) -> None:
        if self.dispatcher is None:
            return
        try:
            self.dispatcher.dispatch(job_id, model, list(range(num_shards)), labels)
        except Exception as exc:
            log.exception("could not enqueue job %s", job_id)
            raise BrokerUnavailable(str(exc)) from exc

    def undo_submission(self, job_id: str) -> None:
        """Remove a submitted job that must not stay: its messages, rows (a batch made with it too) and files."""
        with self.sessions() as session:
            job = job_store.get_job(session, job_id)
            model = job.model if job is not None else self.settings.default_model
        self._undo_submission(job_id, model, stored=True)

    def _undo_submission(self, job_id: str, model: str, stored: bool) -> None:
        """Remove whatever a failed submission made: queue messages, rows, files. Each step is tried even
        when an earlier one fails (the broker may be the reason we are here)."""
        if stored and self.dispatcher is not None:
            try:
                self.dispatcher.withdraw(job_id, model)
            except Exception:
                log.warning("could not withdraw the messages of job %s", job_id, exc_info=True)
        if stored:
            try:
                with self.sessions() as session:
                    job_store.delete_job(session, job_id)
            except Exception:
                log.warning("could not delete the rows of job %s", job_id, exc_info=True)
        try:  # an object store may be what failed: its error must not hide the submission's own
            self.blobs.delete(staging_name(job_id))
            self.blobs.delete_job(job_id)
        except Exception:
            log.warning("could not delete the files of job %s", job_id, exc_info=True)

    def _job(self, session: Session, tenant: str, job_id: str) -> Job:
        job = job_store.get_job(session, job_id, tenant=tenant)
        if job is None:
            raise NotFound(f"no job {job_id!r}")
        return job

    def view(self, session: Session, job: Job) -> JobObject:
        return JobObject(
            id=job.id,
            status=JobStatus(job.status),
            model=job.model,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            request_counts=RequestCounts(**job_store.request_counts(session, job.id, job.num_rows)),
            # Stored values are rendered whatever they hold (text_rule.repaired): a read never fails on them.
            params=repaired(job.params),
            metadata=repaired(job.job_metadata),
            error=repaired(job.error),
            priority=job.priority,
            deadline=job.deadline,
            deadline_warning=job.deadline_warning,
            expired_at=job.expired_at,
            quote=repaired(job.quote),
        )

    def get(self, tenant: str, job_id: str) -> JobObject:
        with self.sessions() as session:
            return self.view(session, self._job(session, tenant, job_id))

    def list(self, tenant: str, status: str | None, after: str | None, limit: int) -> JobList:
        with self.sessions() as session:
            try:
                jobs, has_more = job_store.list_jobs(session, tenant, status=status, after=after, limit=limit)
            except LookupError as exc:
                raise InputError(str(exc), field="after") from exc
            data = [self.view(session, job) for job in jobs]
        return JobList(data=data, has_more=has_more, last_id=data[-1].id if data else None)

    def events(self, tenant: str, job_id: str) -> list[JobEventOut]:
        with self.sessions() as session:
            self._job(session, tenant, job_id)
            return [
                JobEventOut(status=JobStatus(e.status), at=e.at) for e in job_store.events(session, job_id)
            ]

    def cancel(self, tenant: str, job_id: str) -> JobObject:
        with self.sessions() as session:
            job = self._job(session, tenant, job_id)
            # Cancelling twice is fine; cancelling a finished (or finishing) job is a conflict.
            if job.status != JobStatus.CANCELLING and not job_store.request_cancel(session, job_id):
                status = job_store.job_status(session, job_id)
                if status != JobStatus.CANCELLING:
                    raise Conflict(f"job {job_id} is {status}; only a queued or running job can be cancelled")
            session.refresh(job)
            return self.view(session, job)

    def results_source(self, tenant: str, job_id: str, scratch: Path) -> tuple[ArrowPath, bool]:
        """(where, is_final): the final results file, or the rows finished so far written to the local
        file `scratch`."""
        with self.sessions() as session:
            job = self._job(session, tenant, job_id)
            final_name = results_name(job_id)
            if job.status in FINAL_JOB_STATUSES and self.blobs.exists(final_name):
                return self.blobs.arrow(final_name), True
            write_partial_results(session, job_id, scratch)
            return ArrowPath.local(scratch), False

    def metrics(self, tenant: str, job_id: str) -> dict:
        with self.sessions() as session:
            job = self._job(session, tenant, job_id)
            if job.metrics is not None and job.status in FINAL_JOB_STATUSES:
                return job.metrics
            return compute_metrics(session, job, self.settings)

    def shard_indices(self, job_id: str) -> list[int]:
        with self.sessions() as session:
            return shard_indices(session, job_id)
