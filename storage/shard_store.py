"""Shards and their leases: a worker claims a shard by a conditional UPDATE, renews the lease while it
runs (the heartbeat), and finishes or releases it. A second delivery of the same shard (broker
redelivery, two workers) finds the lease held and backs off; a lapsed lease can be taken over."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import Float, and_, case, cast, func, literal, not_, or_, select, tuple_, update
from sqlalchemy.orm import Session, aliased

from storage.db import chunked
from storage.models import Job, Shard, utcnow
from storage.priority import PRIORITY_RANK
from storage.status import ACTIVE_JOB_STATUSES, FINAL_SHARD_STATUSES, ShardStatus


class Claim(StrEnum):
    CLAIMED = "claimed"
    FINISHED = "finished"  # already done, cancelled or failed: nothing to run
    HELD = "held"  # another owner holds a live lease
    MISSING = "missing"


def claim_shard(
    session: Session,
    job_id: str,
    shard_index: int,
    owner: str,
    lease_seconds: float,
    *,
    wait_retry: bool = False,
) -> Claim:
    """Claim one shard. `wait_retry`: a shard still in its retry delay is HELD (a broker's message looks
    again later); the embedded runner, which retries back to back, does not wait."""
    now = utcnow()
    waited = [_retry_due(now)] if wait_retry else []
    result = session.execute(
        update(Shard)
        .where(
            Shard.job_id == job_id,
            Shard.shard_index == shard_index,
            _free(now, owner=owner),
            *waited,
        )
        .values(
            status=ShardStatus.RUNNING,
            owner=owner,
            lease_until=now + timedelta(seconds=lease_seconds),
            heartbeat_at=now,
            attempts=Shard.attempts + 1,
            started_at=func.coalesce(Shard.started_at, now),
            retry_at=None,
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


@dataclass(frozen=True)
class FairShare:
    """How claim_next_shard shares a model's workers between tenants of one priority class: a tenant's
    use is its shards of the model running now plus those done since `since`, divided by its weight
    (1 for a tenant not in `weights`); the least used tenant goes first."""

    since: datetime
    weights: dict[str, float] = field(default_factory=dict)


def claim_next_shard(
    session: Session, *, model: str, owner: str, lease_seconds: float, fair_share: FairShare | None
) -> tuple[str, int] | None:
    """Claim the best shard of `model` nobody runs, in any active job, and return its (job id, shard
    index); None when there is none. Best: shards of a cancelled job first (they only need marking),
    then by priority class, then (with `fair_share`) the least used tenant, then the earliest deadline
    (none last), then submission order. SKIP LOCKED lets workers claiming at once take different shards.
    A shard whose last attempt failed waits out its retry delay (`retry_at`, set by `release_shard`):
    another job's ticket does not retake it at once."""
    now = utcnow()
    rank = case(PRIORITY_RANK, value=Job.priority, else_=len(PRIORITY_RANK))
    order: list[Any] = [Job.cancel_requested.desc(), rank]
    query = (
        select(Shard.job_id, Shard.shard_index)
        .join(Job, Job.id == Shard.job_id)
        .where(
            Job.model == model,
            Job.status.in_(list(ACTIVE_JOB_STATUSES)),
            _free(now),
            _retry_due(now),
        )
    )
    if fair_share is not None:
        used = _tenant_use(model, fair_share.since)
        query = query.outerjoin(used, used.c.tenant == Job.tenant)
        weight = (
            case(fair_share.weights, value=Job.tenant, else_=1.0) if fair_share.weights else literal(1.0)
        )
        order.append(cast(func.coalesce(used.c.shards, 0), Float) / weight)
    order += [Job.deadline.asc().nulls_last(), Job.seq, Shard.shard_index]
    found = session.execute(
        query.order_by(*order).limit(1).with_for_update(of=Shard, skip_locked=True)
    ).first()
    if found is None:
        session.commit()
        return None
    job_id, shard_index = found
    # The row is locked by this transaction: the conditional claim cannot lose a race.
    claimed = claim_shard(session, job_id, shard_index, owner, lease_seconds)
    return (job_id, shard_index) if claimed == Claim.CLAIMED else None


def _tenant_use(model: str, since: datetime):
    """(tenant, shards): each tenant's shards of `model` running now or done since `since`."""
    job, shard = aliased(Job), aliased(Shard)
    return (
        select(job.tenant.label("tenant"), func.count().label("shards"))
        .select_from(shard)
        .join(job, job.id == shard.job_id)
        .where(
            job.model == model,
            # Only jobs that can hold such shards: the scan stays off the model's whole history.
            or_(job.status.in_(list(ACTIVE_JOB_STATUSES)), job.finished_at >= since),
            or_(
                shard.status == ShardStatus.RUNNING,
                and_(shard.status == ShardStatus.DONE, shard.finished_at >= since),
            ),
        )
        .group_by(job.tenant)
        .subquery()
    )


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
    retry_after_seconds: float = 0.0,
) -> bool:
    """Hand the shard back (a failed attempt, a worker shutting down) so the next delivery runs it.
    A hand-back on shutdown is not a failed attempt: count_attempt=False takes the claim back. A failed
    attempt's retry delay (`retry_after_seconds`) holds off claims by ticket (claim_next_shard) as the
    broker holds off the shard's own retried message."""
    attempts = Shard.attempts if count_attempt else Shard.attempts - 1
    retry_at = utcnow() + timedelta(seconds=retry_after_seconds) if retry_after_seconds > 0 else None
    result = session.execute(
        update(Shard)
        .where(*_held_by(job_id, shard_index, owner))
        .values(
            status=ShardStatus.PENDING,
            owner=None,
            lease_until=None,
            error=error,
            attempts=attempts,
            retry_at=retry_at,
        )
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


def _retry_due(now: datetime):
    """The shard is not waiting out a failed attempt's retry delay."""
    return or_(Shard.retry_at.is_(None), Shard.retry_at <= now)


def idle_shards(session: Session, *, job_id: str, now: datetime) -> list[int]:
    """Shards of the job nobody is running: pending, or running under a lease that has lapsed."""
    return list(session.scalars(select(Shard.shard_index).where(Shard.job_id == job_id, _free(now))))


def not_idle_shards(session: Session, keys: list[tuple[str, int]], *, now: datetime) -> set[tuple[str, int]]:
    """Of the (job id, shard index) pairs, the shards that exist and that nobody needs to run: running
    under a live lease, or finished (the recovery sweep counts the tickets of such shards as spare)."""
    found: set[tuple[str, int]] = set()
    for chunk in chunked(sorted(set(keys))):
        query = select(Shard.job_id, Shard.shard_index).where(
            tuple_(Shard.job_id, Shard.shard_index).in_(chunk), not_(_free(now))
        )
        found.update((job_id, index) for job_id, index in session.execute(query))
    return found


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
