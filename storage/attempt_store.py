"""Shard attempts: a row per run of a shard, started when the shard is claimed and updated with the
engine counters the run has spent (at each result flush and heartbeat, and when it ends). The job's
cost is the sum over every attempt, not only over the attempt that finished each shard."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from storage.models import ShardAttempt, utcnow
from storage.status import AttemptOutcome

# Counters that are a maximum over the attempt, not an amount spent: over attempts they take the max.
PEAK_COUNTERS = frozenset({"peak_kv_utilization"})


def start_attempt(session: Session, *, job_id: str, shard_index: int, owner: str) -> int:
    """Record a new attempt, RUNNING with nothing spent yet; commits. Returns its id."""
    now = utcnow()
    attempt = ShardAttempt(
        job_id=job_id,
        shard_index=shard_index,
        owner=owner,
        started_at=now,
        updated_at=now,
        outcome=AttemptOutcome.RUNNING,
        counters={},
    )
    session.add(attempt)
    session.commit()
    return attempt.id


def record_attempt(
    session: Session,
    *,
    attempt_id: int,
    counters: Mapping[str, float],
    outcome: AttemptOutcome | None = None,
    commit: bool = True,
) -> None:
    """Store what the attempt has spent so far (cumulative, so a later write replaces an earlier one),
    and its outcome once it ended. commit=False leaves the commit to the caller, so the counters can
    land in the same transaction as the result rows they paid for."""
    values: dict[str, Any] = {"counters": dict(counters), "updated_at": utcnow()}
    if outcome is not None:
        values["outcome"] = outcome
    session.execute(update(ShardAttempt).where(ShardAttempt.id == attempt_id).values(**values))
    if commit:
        session.commit()


def attempts_of(session: Session, *, job_id: str, shard_index: int | None = None) -> list[ShardAttempt]:
    """The job's attempts (or one shard's), oldest first."""
    query = select(ShardAttempt).where(ShardAttempt.job_id == job_id)
    if shard_index is not None:
        query = query.where(ShardAttempt.shard_index == shard_index)
    return list(session.scalars(query.order_by(ShardAttempt.id)))


def attempt_totals(session: Session, *, job_id: str) -> dict[str, float]:
    """Each counter summed over every attempt of every shard of the job (peaks: their maximum).
    Summed here rather than in SQL: JSON arithmetic differs between Postgres and SQLite, and a job has
    a few rows per shard."""
    totals: dict[str, float] = {}
    for counters in session.scalars(select(ShardAttempt.counters).where(ShardAttempt.job_id == job_id)):
        for name, value in (counters or {}).items():
            if name in PEAK_COUNTERS:
                totals[name] = max(totals.get(name, 0.0), float(value))
            else:
                totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def attempted_shards(session: Session, *, job_id: str) -> set[int]:
    """Shards of the job with at least one attempt row (a shard finished before migration 0003 has
    none: its own stats are all that is known of its cost)."""
    query = select(ShardAttempt.shard_index).where(ShardAttempt.job_id == job_id).distinct()
    return set(session.scalars(query))
