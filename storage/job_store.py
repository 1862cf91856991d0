"""Jobs and their status history. Every status change is a conditional UPDATE, so two processes
racing for the same transition (say, two workers finishing the last shards) see exactly one win."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, delete, func, select, update
from sqlalchemy.orm import Session

from storage.models import Job, JobEvent, OpenAIBatch, ResultRow, Shard, as_utc, utcnow
from storage.priority import DEFAULT_PRIORITY
from storage.result_store import finish_reason_counts
from storage.shard_store import unfinished_shards
from storage.status import (
    ACTIVE_JOB_STATUSES,
    CANCELLABLE_JOB_STATUSES,
    COMPLETED_FINISH_REASONS,
    FINAL_JOB_STATUSES,
    FinishReason,
    JobStatus,
    allowed_sources,
)


def new_job_id() -> str:
    return f"job_{uuid.uuid4().hex}"


def create_job(
    session: Session,
    *,
    job_id: str,
    tenant: str,
    model: str,
    params: dict[str, Any],
    metadata: dict[str, str],
    input_name: str,
) -> Job:
    job = Job(
        id=job_id,
        tenant=tenant,
        status=JobStatus.VALIDATING,
        model=model,
        params=params,
        job_metadata=metadata,
        input_name=input_name,
        created_at=utcnow(),
    )
    session.add(job)
    session.add(JobEvent(job_id=job_id, status=JobStatus.VALIDATING, at=job.created_at))
    session.commit()
    return job


def create_queued_job(
    session: Session,
    *,
    job_id: str,
    tenant: str,
    model: str,
    params: dict[str, Any],
    metadata: dict[str, str],
    input_name: str,
    created_at: datetime,
    num_rows: int,
    shards: list[list[int]],
    also: Callable[[Session], None] | None = None,
    priority: str = DEFAULT_PRIORITY,
    deadline: datetime | None = None,
    deadline_warning: str | None = None,
    pieces: list[list[dict]] | None = None,  # an input by reference: each shard's row-group ranges
    quote: dict[str, Any] | None = None,  # the job's quote at submission
) -> None:
    """A validated job, its shards and its events (validating at `created_at`, then queued now) in one
    transaction: all of them are stored, or (on any failure) none. `also` adds rows made with the job
    (an OpenAI batch's row) to the same transaction, without committing it."""
    try:
        _add_job(
            session,
            Job(
                id=job_id,
                tenant=tenant,
                status=JobStatus.QUEUED,
                model=model,
                params=params,
                job_metadata=metadata,
                input_name=input_name,
                created_at=created_at,
                num_rows=num_rows,
                num_shards=len(shards),
                priority=priority,
                deadline=deadline,
                deadline_warning=deadline_warning,
                quote=quote,
            ),
        )
        _add_shards(session, job_id, shards, pieces)
        _add_events(session, job_id, [(JobStatus.VALIDATING, created_at), (JobStatus.QUEUED, utcnow())])
        if also is not None:
            also(session)
        session.commit()
    except BaseException:
        session.rollback()
        raise


def _add_job(session: Session, job: Job) -> None:
    session.add(job)
    session.flush()  # the job row first: shards and events refer to it


def _add_shards(
    session: Session, job_id: str, shards: list[list[int]], pieces: list[list[dict]] | None = None
) -> None:
    session.add_all(
        Shard(job_id=job_id, shard_index=index, row_indices=rows, pieces=pieces[index] if pieces else None)
        for index, rows in enumerate(shards)
    )
    session.flush()


def _add_events(session: Session, job_id: str, entered: list[tuple[JobStatus, datetime]]) -> None:
    session.add_all(JobEvent(job_id=job_id, status=status, at=at) for status, at in entered)
    session.flush()


def delete_job(session: Session, job_id: str) -> None:
    """The job's rows: its results, shards, events, the job, and the OpenAI batch made with it."""
    for table in (ResultRow, Shard, JobEvent, OpenAIBatch):
        session.execute(delete(table).where(table.job_id == job_id))
    session.execute(delete(Job).where(Job.id == job_id))
    session.commit()


def get_job(session: Session, job_id: str, tenant: str | None = None) -> Job | None:
    query = select(Job).where(Job.id == job_id)
    if tenant is not None:
        query = query.where(Job.tenant == tenant)
    return session.scalars(query).one_or_none()


def list_jobs(
    session: Session, tenant: str, *, status: str | None = None, after: str | None = None, limit: int = 20
) -> tuple[list[Job], bool]:
    """Newest first; `after` is the id of the last job of the previous page. Returns (jobs, has_more)."""
    query = select(Job).where(Job.tenant == tenant)
    if status is not None:
        query = query.where(Job.status == status)
    if after is not None:
        cursor_seq = session.scalar(select(Job.seq).where(Job.id == after, Job.tenant == tenant))
        if cursor_seq is None:
            raise LookupError(f"unknown cursor {after!r}")
        query = query.where(Job.seq < cursor_seq)
    rows = list(session.scalars(query.order_by(Job.seq.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def move(
    session: Session,
    job_id: str,
    *,
    to: JobStatus,
    only_from: Iterable[JobStatus] | None = None,
    extra: dict[str, Any] | None = None,
    commit: bool = True,
) -> bool:
    """Move the job to `to` if its status is one the lifecycle (JOB_TRANSITIONS) allows that move
    from, or one of `only_from` (a subset of those) when given; commits unless commit=False. True for
    the one caller that moved it."""
    sources = _sources(to, only_from)
    now = utcnow()
    values: dict[str, Any] = {"status": to}
    if to == JobStatus.IN_PROGRESS:
        values["started_at"] = now
    if to in FINAL_JOB_STATUSES:
        values["finished_at"] = now
    values.update(extra or {})
    result = session.execute(
        update(Job).where(Job.id == job_id, Job.status.in_(sorted(sources))).values(**values)
    )
    moved = result.rowcount == 1
    if moved:
        session.add(JobEvent(job_id=job_id, status=to, at=now))
    if commit:
        session.commit()
    return moved


def _sources(to: JobStatus, only_from: Iterable[JobStatus] | None) -> frozenset[JobStatus]:
    """The statuses the move may start from: those storage.status.JOB_TRANSITIONS allows, or the
    subset of them a caller names (`only_from`); a move the table does not allow is a bug."""
    allowed = allowed_sources(to)
    if only_from is None:
        sources = allowed
    else:
        sources = frozenset(JobStatus(status) for status in only_from)
    if not allowed or not sources <= allowed:
        raise ValueError(f"illegal job move to {to}: allowed only from {sorted(allowed)}")
    return sources


def mark_finalizing(session: Session, job_id: str) -> bool:
    """Once every shard is finished, move the job to finalizing. True when the job is finalizing now
    (moved by this call or by another). Safe from many processes at once: the conditional update lets
    exactly one of them move the job."""
    if unfinished_shards(session, job_id):
        return False
    move(session, job_id, to=JobStatus.FINALIZING)
    return job_status(session, job_id) == JobStatus.FINALIZING


def note_error(session: Session, *, job_id: str, error: str, commit: bool = True) -> None:
    """Record why the job cannot succeed while its shards still finish (the first reason stays);
    finalizing then ends it failed with this error. Commits unless commit=False."""
    session.execute(update(Job).where(Job.id == job_id, Job.error.is_(None)).values(error=error))
    if commit:
        session.commit()


def request_cancel(session: Session, job_id: str, *, commit: bool = True) -> bool:
    return move(session, job_id, to=JobStatus.CANCELLING, extra={"cancel_requested": True}, commit=commit)


def expire_overdue(session: Session, *, now: datetime) -> list[str]:
    """Cancel the jobs still running past their deadline and note when they expired, each in one
    transaction: finished rows are kept, the rest are never run (as an OpenAI batch past its window).
    Returns their ids."""
    overdue = session.scalars(
        select(Job.id).where(
            Job.deadline < now, Job.expired_at.is_(None), Job.status.in_(list(CANCELLABLE_JOB_STATUSES))
        )
    ).all()
    expired = []
    for job_id in overdue:
        if move(session, job_id, to=JobStatus.CANCELLING, extra={"cancel_requested": True, "expired_at": now}):
            expired.append(job_id)
    return expired


def job_status(session: Session, job_id: str) -> str | None:
    return session.scalar(select(Job.status).where(Job.id == job_id))


def events(session: Session, job_id: str) -> list[JobEvent]:
    return list(session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))


def request_counts(session: Session, job_id: str, total: int) -> dict[str, int]:
    """The job's rows: total, completed (COMPLETED_FINISH_REASONS) and failed so far."""
    by_reason = finish_reason_counts(session, job_id=job_id)
    completed = sum(by_reason.get(reason, 0) for reason in COMPLETED_FINISH_REASONS)
    return {"total": total, "completed": completed, "failed": by_reason.get(FinishReason.ERROR, 0)}


def seconds_between(start: datetime | None, end: datetime | None) -> float:
    if start is None or end is None:
        return 0.0
    return max(0.0, (as_utc(end) - as_utc(start)).total_seconds())


def active_jobs(session: Session, *, created_before: datetime) -> list[Job]:
    """Jobs whose shards may still need a message (ACTIVE_JOB_STATUSES) or that are finalizing."""
    statuses = [*ACTIVE_JOB_STATUSES, JobStatus.FINALIZING]
    return list(session.scalars(select(Job).where(Job.status.in_(statuses), Job.created_at < created_before)))


def validating_jobs(session: Session, *, created_before: datetime) -> list[tuple[str, str]]:
    """(job id, input name) of the jobs still validating that were created before `created_before`."""
    query = select(Job.id, Job.input_name).where(
        Job.status == JobStatus.VALIDATING, Job.created_at < created_before
    )
    return [(job_id, input_name) for job_id, input_name in session.execute(query)]


def jobs_by_status(*, engine: Engine) -> dict[str, tuple[int, int]]:
    """{status: (jobs, rows)} over every job (one connection, no session: a metrics scrape)."""
    query = select(Job.status, func.count(), func.coalesce(func.sum(Job.num_rows), 0)).group_by(Job.status)
    with engine.connect() as connection:
        return {status: (count, rows) for status, count, rows in connection.execute(query)}
