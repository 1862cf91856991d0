"""Shards and their leases: a worker claims a shard by a conditional UPDATE, renews the lease while it
runs (the heartbeat), and finishes or releases it. A second delivery of the same shard (broker
redelivery, two workers) finds the lease held and backs off; a lapsed lease can be taken over."""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from storage.models import Shard, utcnow
from storage.status import FINAL_SHARD_STATUSES, ShardStatus


class Claim(StrEnum):
    CLAIMED = "claimed"
    FINISHED = "finished"  # already done, cancelled or failed: nothing to run
    HELD = "held"  # another owner holds a live lease
    MISSING = "missing"


def claim_shard(session: Session, job_id: str, shard_index: int, owner: str, lease_seconds: float) -> Claim:
    now = utcnow()
    result = session.execute(
        update(Shard)
        .where(
            Shard.job_id == job_id,
            Shard.shard_index == shard_index,
            _free(now, owner=owner),
        )
        .values(
            status=ShardStatus.RUNNING,
            owner=owner,
            lease_until=now + timedelta(seconds=lease_seconds),
            heartbeat_at=now,
            attempts=Shard.attempts + 1,
            started_at=func.coalesce(Shard.started_at, now),
        )
    )
    session.commit()
    if result.rowcount == 1:
        return Claim.CLAIMED
    status = session.scalar(
        select(Shard.status).where(Shard.job_id == job_id, Shard.shard_index == shard_index)
    )
    if status is None:
        return Claim.MISSING
    return Claim.FINISHED if status in FINAL_SHARD_STATUSES else Claim.HELD


def renew_lease(session: Session, job_id: str, shard_index: int, owner: str, lease_seconds: float) -> bool:
    """The heartbeat. False when the lease was lost (taken over after it lapsed)."""
    now = utcnow()
    result = session.execute(
        update(Shard)
        .where(*_held_by(job_id, shard_index, owner))
        .values(lease_until=now + timedelta(seconds=lease_seconds), heartbeat_at=now)
    )
    session.commit()
    return result.rowcount == 1


def finish_shard(
    session: Session,
    job_id: str,
    shard_index: int,
    owner: str,
    status: ShardStatus,
    stats: dict[str, Any] | None,
    error: str | None = None,
) -> bool:
    result = session.execute(
        update(Shard)
        .where(*_held_by(job_id, shard_index, owner))
        .values(status=status, stats=stats, error=error, finished_at=utcnow(), lease_until=None)
    )
    session.commit()
    return result.rowcount == 1


def release_shard(
    session: Session,
    job_id: str,
    shard_index: int,
    owner: str,
    error: str | None,
    *,
    count_attempt: bool = True,
) -> bool:
    """Hand the shard back (a failed attempt, a worker shutting down) so the next delivery runs it.
    A hand-back on shutdown is not a failed attempt: count_attempt=False takes the claim back."""
    attempts = Shard.attempts if count_attempt else Shard.attempts - 1
    result = session.execute(
        update(Shard)
        .where(*_held_by(job_id, shard_index, owner))
        .values(status=ShardStatus.PENDING, owner=None, lease_until=None, error=error, attempts=attempts)
    )
    session.commit()
    return result.rowcount == 1


def _free(now: datetime, *, owner: str | None = None):
    """Nobody runs the shard: pending, or running under a lease that has lapsed (or that `owner`
    itself holds: its own message redelivered)."""
    lapsed = Shard.lease_until < now
    if owner is not None:
        lapsed = or_(lapsed, Shard.owner == owner)
    return or_(Shard.status == ShardStatus.PENDING, (Shard.status == ShardStatus.RUNNING) & lapsed)


def idle_shards(session: Session, *, job_id: str, now: datetime) -> list[int]:
    """Shards of the job nobody is running: pending, or running under a lease that has lapsed."""
    return list(session.scalars(select(Shard.shard_index).where(Shard.job_id == job_id, _free(now))))


def _held_by(job_id: str, shard_index: int, owner: str) -> tuple:
    return (
        Shard.job_id == job_id,
        Shard.shard_index == shard_index,
        Shard.owner == owner,
        Shard.status == ShardStatus.RUNNING,
    )


def get_shard(session: Session, job_id: str, shard_index: int) -> Shard | None:
    return session.get(Shard, (job_id, shard_index))


def unfinished_shards(session: Session, job_id: str) -> int:
    return session.scalar(
        select(func.count())
        .select_from(Shard)
        .where(Shard.job_id == job_id, Shard.status.not_in(list(FINAL_SHARD_STATUSES)))
    )


def shards_of(session: Session, job_id: str) -> list[Shard]:
    return list(session.scalars(select(Shard).where(Shard.job_id == job_id).order_by(Shard.shard_index)))


def shard_indices(session: Session, job_id: str) -> list[int]:
    return list(
        session.scalars(select(Shard.shard_index).where(Shard.job_id == job_id).order_by(Shard.shard_index))
    )
