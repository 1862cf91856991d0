"""A quote before the run: what a job would cost and when it would finish, from the same body as a
submission. It runs the submission's own checks (so the same input gets the same 4xx), then prices the
job with the model's measured throughput (jobs/domain/throughput.py); it stores nothing and queues
nothing: the upload lives in a temporary local file for the length of the request."""

from __future__ import annotations

import math
import tempfile
from datetime import datetime, timedelta
from pathlib import Path
from typing import BinaryIO, Literal, Protocol

from pydantic import BaseModel, Field
from sqlalchemy.orm import Session, sessionmaker

from jobs.domain.deadline import job_deadline, missed_by
from jobs.domain.errors import InputError
from jobs.domain.grammar_check import GrammarRefusal, SubmissionGrammar
from jobs.domain.input_refs import CheckedReference
from jobs.domain.prompt_tokens import TokenCounter, exact_prompt_tokens
from jobs.domain.schemas import JobParams, ResolvedParams
from jobs.domain.served_models import ServedModel
from jobs.domain.settings import Settings
from jobs.domain.throughput import Fit, Rates, fit_rates
from jobs.domain.validation import ValidatedInput
from storage.arrow_path import ArrowPath
from storage.blobs import UploadTooLarge
from storage.models import utcnow
from storage.priority import at_or_above
from storage.profile_store import backlog_rows, profiles_of, worker_processes


class SubmissionChecks(Protocol):
    """What a quote needs of the job service (jobs/domain/service.py, which prices submissions with
    `estimate` below, so this module does not import it): the submission's own checks."""

    settings: Settings
    sessions: sessionmaker[Session]
    grammar: TokenCounter | None  # the grammar check's child counts the exact prompt tokens

    def grammar_session(self) -> SubmissionGrammar: ...

    def checked_params(
        self, params: JobParams, grammar: GrammarRefusal | None
    ) -> tuple[ResolvedParams, ServedModel]: ...

    def check_input(
        self, where: ArrowPath, resolved: ResolvedParams, served: ServedModel, grammar: GrammarRefusal | None
    ) -> tuple[ValidatedInput, list[list[int]]]: ...

    def check_reference(
        self, uris: list[str], resolved: ResolvedParams, served: ServedModel, grammar: GrammarRefusal | None
    ) -> CheckedReference: ...

# The API has no tokenizer (it never loads torch: tests/test_architecture.py); its grammar check's child
# counts exact prompt tokens (jobs/domain/prompt_tokens.py). Where it cannot, prompt tokens are estimated
# from characters at the usual ~4 characters per BPE token of English text; the quote says so
# (prompt_tokens_exact: false).
CHARS_PER_TOKEN = 4.0
COPY_CHUNK_BYTES = 1 << 20


class ThroughputOut(BaseModel):
    """The measured rates the quote used: every finished shard of the model, all worker classes."""

    prompt_tokens_per_second: float | None
    output_tokens_per_second: float | None
    seconds_per_row: float
    shards_measured: int
    worker_classes: list[str]
    fit: Fit = Field(description="how the rates were fitted from the profile (jobs/domain/throughput.py)")


class QueueOut(BaseModel):
    backlog_rows: int = Field(
        description="rows of the model's queued and running jobs not finished yet, in the job's priority "
        "class and those above it"
    )
    backlog_device_seconds: float | None
    workers: int = Field(description="worker processes the ETA divides the work among")
    workers_source: Literal["observed", "setting"] = Field(
        description="observed: processes that wrote a shard attempt of the model within the last shard lease; "
        "setting: none did, FREIGHT_QUOTE_ASSUMED_WORKERS"
    )


class JobQuote(BaseModel):
    """What `POST /v1/jobs/quote` answers: the job as a submission would make it, priced."""

    model: str
    rows: int
    rows_to_run: int = Field(description="rows with a prompt (null or empty ones become error rows unrun)")
    shards: int
    prompt_chars: int
    prompt_tokens: int
    prompt_tokens_exact: bool = Field(
        description="true: counted with the model's tokenizer as the worker tokenizes (template, chat "
        "template, truncation); false: estimated from characters, template tokens not counted (the API's "
        "grammar check cannot run, the model's files are not on the API's host, or a summarize job)"
    )
    max_tokens: int
    output_tokens_max: int = Field(
        description="the rows to run's max_tokens summed: a row's own max_tokens column cell where set, else the job's"
    )
    output_tokens_expected: int
    output_tokens_basis: Literal["history", "max_tokens"] = Field(
        description="history: max tokens scaled by what past generate rows of the model used of theirs"
    )
    device_seconds: float | None
    device_seconds_unknown_reason: str | None = None
    throughput: ThroughputOut | None
    device_hour_usd: float
    cost_usd: float | None
    queue: QueueOut
    eta_seconds: float | None = Field(description="from now until the job's last shard is done, estimated")
    deadline: datetime | None = Field(None, description="when the job would be due (its completion window)")
    deadline_met: bool | None = Field(
        None, description="whether the ETA is within the deadline; null without a deadline or an ETA"
    )
    deadline_warning: str | None = Field(None, description="why the ETA misses the deadline")


class QuoteService:
    def __init__(self, jobs: SubmissionChecks) -> None:
        self.jobs = jobs
        self.settings = jobs.settings

    def quote(self, upload: BinaryIO, params: JobParams) -> JobQuote:
        jobs = self.jobs
        now = utcnow()
        due = job_deadline(completion_window=params.completion_window, deadline=params.deadline, now=now)
        grammar = jobs.grammar_session()
        resolved, served = jobs.checked_params(params, grammar)
        with tempfile.TemporaryDirectory(prefix="freight-quote-") as scratch:
            local = Path(scratch) / "input.parquet"
            _copy_limited(upload, local, self.settings.max_upload_bytes)
            validated, shards = jobs.check_input(ArrowPath.local(local), resolved, served, grammar)
            exact = exact_prompt_tokens(
                jobs.grammar,
                local,
                validated,
                resolved,
                context_len=served.context_len,
                models_dir=self.settings.models_dir,
            )
        quoted = estimate(
            self.settings,
            jobs.sessions,
            resolved,
            validated,
            len(shards),
            priority=params.priority,
            prompt_tokens=exact,
        )
        return with_deadline(quoted, due, now)

    def quote_by_reference(self, uris: list[str], params: JobParams) -> JobQuote:
        """The quote of a job whose input is named by s3:// URIs: the by-reference submission's checks
        (the files read in place, nothing copied) and its row-group shards; prompt tokens estimated from
        characters."""
        jobs = self.jobs
        now = utcnow()
        due = job_deadline(completion_window=params.completion_window, deadline=params.deadline, now=now)
        grammar = jobs.grammar_session()
        resolved, served = jobs.checked_params(params, grammar)
        checked = jobs.check_reference(uris, resolved, served, grammar)
        shards = len(checked.pieces)
        quoted = estimate(self.settings, jobs.sessions, resolved, checked.validated, shards, priority=params.priority)
        return with_deadline(quoted, due, now)


def estimate(
    settings: Settings,
    sessions: sessionmaker[Session],
    resolved: ResolvedParams,
    validated: ValidatedInput,
    shards: int,
    *,
    priority: str,
    prompt_tokens: int | None = None,
) -> JobQuote:
    """The quote of a validated job: the model's profile, and the backlog of its priority class and
    those above it (lower classes wait for it: docs/scheduling.md). `prompt_tokens`: counted exactly
    (prompt_tokens.py), else estimated from characters."""
    since = utcnow() - timedelta(seconds=settings.shard_lease_seconds)
    with sessions() as session:
        rates = fit_rates(profiles_of(session, model=resolved.model))
        backlog = backlog_rows(session, model=resolved.model, priorities=at_or_above(priority))
        seen_workers = worker_processes(session, model=resolved.model, since=since)
    return price(
        model=resolved.model,
        rows=validated.num_rows,
        rows_to_run=validated.num_rows - validated.null_or_empty_rows,
        shards=shards,
        prompt_chars=validated.total_prompt_chars,
        exact_prompt_tokens=prompt_tokens,
        max_tokens=resolved.max_tokens,
        output_tokens_max=validated.total_max_tokens,
        rates=rates,
        backlog=backlog,
        seen_workers=seen_workers,
        assumed_workers=settings.quote_assumed_workers,
        device_hour_usd=settings.device_hour_usd,
    )


def with_deadline(quote: JobQuote, deadline: datetime | None, now: datetime) -> JobQuote:
    """The quote with its verdict on `deadline` (unchanged without one)."""
    if deadline is None:
        return quote
    warning = missed_by(deadline=deadline, eta_seconds=quote.eta_seconds, now=now)
    met = None if quote.eta_seconds is None else warning is None
    return quote.model_copy(update={"deadline": deadline, "deadline_met": met, "deadline_warning": warning})


def price(
    *,
    model: str,
    rows: int,
    rows_to_run: int,
    shards: int,
    prompt_chars: int,
    max_tokens: int,
    rates: Rates | None,
    output_tokens_max: int,  # the rows to run's max_tokens summed (validation.py: total_max_tokens)
    exact_prompt_tokens: int | None = None,
    backlog: int,
    seen_workers: int,
    assumed_workers: int,
    device_hour_usd: float,
) -> JobQuote:
    """The quote from the job's counts and the model's rates (pure: the tests check the arithmetic)."""
    exact = exact_prompt_tokens is not None
    prompt_tokens = exact_prompt_tokens if exact else math.ceil(prompt_chars / CHARS_PER_TOKEN)
    output_max = output_tokens_max
    from_history = rates is not None and rates.output_fraction is not None
    output_expected = round(output_max * rates.output_fraction) if from_history else output_max
    workers = seen_workers or assumed_workers
    queue = QueueOut(
        backlog_rows=backlog,
        backlog_device_seconds=None if rates is None else round(backlog * rates.seconds_per_row, 3),
        workers=workers,
        workers_source="observed" if seen_workers else "setting",
    )
    device_seconds = eta = cost = None
    reason = throughput = None
    if rates is None:
        reason = (
            f"no shard of model {model!r} has finished yet: there is no measured throughput to price it with"
        )
    else:
        device_seconds = rates.device_seconds(prompt_tokens, output_expected)
        cost = round(device_seconds / 3600.0 * device_hour_usd, 8)
        # The backlog is shared by every worker; the job itself spreads over at most one worker per shard.
        eta = round(queue.backlog_device_seconds / workers + device_seconds / max(1, min(workers, shards)), 3)
        device_seconds = round(device_seconds, 3)
        throughput = ThroughputOut(
            prompt_tokens_per_second=_per_second(rates.prompt_seconds_per_token),
            output_tokens_per_second=_per_second(rates.output_seconds_per_token),
            seconds_per_row=round(rates.seconds_per_row, 6),
            shards_measured=rates.shards,
            worker_classes=list(rates.worker_classes),
            fit=rates.fit,
        )
    return JobQuote(
        model=model,
        rows=rows,
        rows_to_run=rows_to_run,
        shards=shards,
        prompt_chars=prompt_chars,
        prompt_tokens=prompt_tokens,
        prompt_tokens_exact=exact,
        max_tokens=max_tokens,
        output_tokens_max=output_max,
        output_tokens_expected=output_expected,
        output_tokens_basis="history" if from_history else "max_tokens",
        device_seconds=device_seconds,
        device_seconds_unknown_reason=reason,
        throughput=throughput,
        device_hour_usd=device_hour_usd,
        cost_usd=cost,
        queue=queue,
        eta_seconds=eta,
    )


def _per_second(seconds_per_token: float) -> float | None:
    """Tokens per second; None for a rate the fit set to zero (that kind of token was not measurable)."""
    return round(1.0 / seconds_per_token, 3) if seconds_per_token > 0 else None


def _copy_limited(source: BinaryIO, target: Path, max_bytes: int) -> None:
    """The upload into a local file, refused past max_bytes with the submission's 413."""
    written = 0
    with open(target, "wb") as sink:
        while chunk := source.read(COPY_CHUNK_BYTES):
            written += len(chunk)
            if written > max_bytes:
                raise InputError(str(UploadTooLarge(max_bytes)), status_code=413)
            sink.write(chunk)
