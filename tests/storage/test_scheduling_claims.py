"""The workers' claim of the next shard (storage.shard_store.claim_next_shard) on real Postgres: priority
class, then fair share between tenants (weighted), then earliest deadline, then submission order;
cancelled jobs' shards first; concurrent claims take different shards; overdue jobs expire."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from storage import job_store
from storage.db import make_engine, make_session_factory
from storage.models import utcnow
from storage.shard_store import FairShare, claim_next_shard, finish_shard, get_shard
from storage.status import JobStatus, ShardStatus

LEASE = 60.0


@pytest.fixture
def sessions(pg_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(pg_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def model() -> str:
    return f"model-{uuid.uuid4().hex[:8]}"  # each test claims from its own model's shards only


def _job(sessions, model: str, shards: int, *, tenant: str = "t", priority: str = "normal", due=None) -> str:
    job_id = job_store.new_job_id()
    with sessions() as session:
        job_store.create_queued_job(
            session,
            job_id=job_id,
            tenant=tenant,
            model=model,
            params={},
            metadata={},
            input_name=f"jobs/{job_id}/input.parquet",
            created_at=utcnow(),
            num_rows=shards,
            shards=[[index] for index in range(shards)],
            priority=priority,
            deadline=due,
        )
    return job_id


def _claim(sessions, model: str, fair: FairShare | None = None, owner: str = "w:1:1"):
    with sessions() as session:
        return claim_next_shard(session, model=model, owner=owner, lease_seconds=LEASE, fair_share=fair)


def _finish(sessions, claimed, owner: str = "w:1:1") -> None:
    with sessions() as session:
        assert finish_shard(session, *claimed, owner, ShardStatus.DONE, None)


def test_priority_then_deadline_then_submission_order(sessions, model: str) -> None:
    now = utcnow()
    week = _job(sessions, model, 2, due=now + timedelta(days=7))
    undated = _job(sessions, model, 1)
    hour = _job(sessions, model, 1, due=now + timedelta(hours=1))
    low = _job(sessions, model, 1, priority="low", due=now + timedelta(minutes=5))
    high = _job(sessions, model, 1, priority="high")
    order = []
    while (claimed := _claim(sessions, model)) is not None:
        order.append(claimed)
        _finish(sessions, claimed)
    assert order == [(high, 0), (hour, 0), (week, 0), (week, 1), (undated, 0), (low, 0)]
    # A claimed shard runs under the claimer's lease, like claim_shard's.
    with sessions() as session:
        shard = get_shard(session, high, 0)
        assert (shard.status, shard.owner, shard.attempts) == (ShardStatus.DONE, "w:1:1", 1)


def test_fair_share_between_tenants_by_weight(sessions, model: str) -> None:
    big = _job(sessions, model, 6, tenant="a")
    small = _job(sessions, model, 2, tenant="b")
    since = utcnow() - timedelta(minutes=10)
    equal = FairShare(since=since)
    first = _claim(sessions, model, equal)
    assert first == (big, 0)  # a tie (nobody runs anything): submission order
    # a runs one shard: b's next, then a tie again, then b's last, then a's for good.
    second = _claim(sessions, model, equal, owner="w:2:1")
    assert second == (small, 0)
    _finish(sessions, first)
    _finish(sessions, second, owner="w:2:1")  # done within the window: still counts
    assert _claim(sessions, model, equal) == (big, 1)
    assert _claim(sessions, model, equal) == (small, 1)
    assert _claim(sessions, model, equal) == (big, 2)
    # Weights: b weighs 3, so b (2 shards / 3) goes before a (3 shards / 1) even as b's use grows.
    b_more = _job(sessions, model, 2, tenant="b")
    weighted = FairShare(since=since, weights={"b": 3.0})
    assert _claim(sessions, model, weighted) == (b_more, 0)
    # Without fair share the order is submission order whoever runs what.
    assert _claim(sessions, model, None) == (big, 3)


def test_cancelled_first_lapsed_leases_retaken_and_concurrent_claims_differ(sessions, model: str) -> None:
    queued = _job(sessions, model, 4)
    cancelled = _job(sessions, model, 1, priority="low")
    with sessions() as session:
        assert job_store.request_cancel(session, cancelled)
    assert _claim(sessions, model) == (cancelled, 0)  # only needs marking cancelled: it goes first
    with ThreadPoolExecutor(4) as pool:
        claims = list(pool.map(lambda n: _claim(sessions, model, owner=f"w:{n}:1"), range(4)))
    assert sorted(claims) == [(queued, index) for index in range(4)]  # SKIP LOCKED: one each
    assert _claim(sessions, model) is None  # all held by live leases
    with sessions() as session:  # one worker died: its lease lapsed
        shard = get_shard(session, queued, 2)
        shard.lease_until = utcnow() - timedelta(seconds=1)
        session.commit()
    assert _claim(sessions, model, owner="w:9:1") == (queued, 2)


def test_overdue_jobs_expire_keeping_their_place_in_history(sessions, model: str) -> None:
    now = utcnow()
    late = _job(sessions, model, 1, due=now - timedelta(seconds=1))
    due_later = _job(sessions, model, 1, due=now + timedelta(hours=1))
    undated = _job(sessions, model, 1)
    with sessions() as session:
        expired = job_store.expire_overdue(session, now=now)
        assert late in expired and due_later not in expired and undated not in expired
        assert job_store.expire_overdue(session, now=now) == []  # once only
        job = job_store.get_job(session, late)
        assert (job.status, job.cancel_requested, job.expired_at) == (JobStatus.CANCELLING, True, now)
        assert job_store.get_job(session, due_later).status == JobStatus.QUEUED


def test_a_failed_shard_waits_out_its_retry_delay(sessions, model: str) -> None:
    """A failed attempt's retry delay holds off every claim by ticket: the next ticket runs another
    shard, or finds none (HELD for its own shard), until the delay is over; then the shard is claimed
    again. The embedded runner's own claim (no wait_retry) retries at once, as before."""
    import time

    from storage.shard_store import Claim, claim_shard, release_shard

    delay = 1.5
    failing = _job(sessions, model, 1)
    other = _job(sessions, model, 1)
    first = _claim(sessions, model)
    assert first == (failing, 0)
    with sessions() as session:
        assert release_shard(session, failing, 0, "w:1:1", "boom", retry_after_seconds=delay)
        released_at = utcnow()
    assert _claim(sessions, model, owner="w:2:1") == (other, 0)  # not the failed one, though it is first
    assert _claim(sessions, model, owner="w:3:1") is None
    with sessions() as session:  # its own ticket, found nothing better: looks again later
        assert claim_shard(session, failing, 0, "w:3:1", LEASE, wait_retry=True) == Claim.HELD
    time.sleep(max(0.0, delay - (utcnow() - released_at).total_seconds()) + 0.2)
    assert _claim(sessions, model, owner="w:3:1") == (failing, 0)
    with sessions() as session:
        shard = get_shard(session, failing, 0)
        assert (shard.attempts, shard.retry_at) == (2, None)
        # Back to back, as the embedded runner retries: no wait.
        assert release_shard(session, failing, 0, "w:3:1", "boom again", retry_after_seconds=60)
        assert claim_shard(session, failing, 0, "w:4:1", LEASE) == Claim.CLAIMED
