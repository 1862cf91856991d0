"""Throughput profiles and what a quote reads besides them: each finished shard adds its measured work
to its (model, worker class) row; a quote reads a model's rows, the rows still to run for that model
and how many worker processes are working on it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from storage.models import Job, ResultRow, ShardAttempt, ThroughputProfile, utcnow
from storage.status import ACTIVE_JOB_STATUSES, JobStatus


@dataclass(frozen=True)
class ShardWork:
    """What one finished shard ran: the engine counters of the attempt that finished it."""

    rows: int
    prompt_tokens: int
    output_tokens: int
    busy_seconds: float
    # Generate shards only (0 otherwise): rows x the job's max_tokens, the cap their output tokens had.
    max_tokens: int = 0


# Columns a shard adds to, each with the shard's value.
def _increments(work: ShardWork) -> dict[str, float | int]:
    p, o, s = float(work.prompt_tokens), float(work.output_tokens), float(work.busy_seconds)
    return {
        "shards": 1,
        "rows": work.rows,
        "prompt_tokens": work.prompt_tokens,
        "output_tokens": work.output_tokens,
        "busy_seconds": s,
        "sum_pp": p * p,
        "sum_po": p * o,
        "sum_oo": o * o,
        "sum_ps": p * s,
        "sum_os": o * s,
        "capped_output_tokens": work.output_tokens if work.max_tokens else 0,
        "capped_max_tokens": work.max_tokens,
    }


def record_shard(
    session: Session, *, model: str, worker_class: str, work: ShardWork, commit: bool = True
) -> None:
    """Add a finished shard's work to its profile row, creating the row on the first shard. One
    statement (an upsert whose update adds), so two workers finishing shards together both count."""
    increments = _increments(work)
    now = utcnow()
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    statement = insert(ThroughputProfile).values(
        model=model, worker_class=worker_class, updated_at=now, **increments
    )
    added = {name: getattr(ThroughputProfile, name) + statement.excluded[name] for name in increments}
    session.execute(
        statement.on_conflict_do_update(
            index_elements=["model", "worker_class"], set_={**added, "updated_at": now}
        )
    )
    if commit:
        session.commit()


def profiles_of(session: Session, *, model: str) -> list[ThroughputProfile]:
    """The model's profile rows, one per worker class, most shards first."""
    query = select(ThroughputProfile).where(ThroughputProfile.model == model)
    return list(
        session.scalars(query.order_by(ThroughputProfile.shards.desc(), ThroughputProfile.worker_class))
    )


# Jobs whose rows may still run: queued and running ones (a cancelling job runs nothing new).
BACKLOG_STATUSES = sorted(ACTIVE_JOB_STATUSES - {JobStatus.CANCELLING})


def backlog_rows(session: Session, *, model: str, priorities: list[str] | None = None) -> int:
    """Rows of the model's queued and running jobs that have no stored result yet; with `priorities`,
    of the jobs in those priority classes only (the work that goes before a job of a given class)."""
    where = [Job.model == model, Job.status.in_(BACKLOG_STATUSES)]
    if priorities is not None:
        where.append(Job.priority.in_(priorities))
    jobs = select(Job.id).where(*where)
    total = session.scalar(select(func.coalesce(func.sum(Job.num_rows), 0)).where(*where))
    stored = session.scalar(select(func.count()).select_from(ResultRow).where(ResultRow.job_id.in_(jobs)))
    return max(0, int(total) - int(stored))


def worker_processes(session: Session, *, model: str, since: datetime) -> int:
    """Worker processes (host:pid) whose attempt at a shard of the model was written since `since`:
    running attempts write at every heartbeat and flush, so these are the workers busy on the model
    now or a moment ago. A process's threads share one engine, so threads do not count apart."""
    owners = session.scalars(
        select(ShardAttempt.owner)
        .join(Job, Job.id == ShardAttempt.job_id)
        .where(Job.model == model, ShardAttempt.updated_at >= since)
        .distinct()
    )
    return len({owner.rsplit(":", 1)[0] for owner in owners})  # owner is host:pid:thread
