"""Job, shard, attempt and result stores on real Postgres: leases, exactly-once transitions, deduplicated
rows, attempt costs summed over a job."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy.orm import Session, sessionmaker

from storage import job_store
from storage.attempt_store import attempt_totals, attempted_shards, attempts_of, record_attempt, start_attempt
from storage.db import make_engine, make_session_factory
from storage.models import utcnow
from storage.result_store import insert_results, iter_results, stored_row_indices, token_sums
from storage.shard_store import (
    Claim,
    claim_shard,
    finish_shard,
    get_shard,
    release_shard,
    renew_lease,
    unfinished_shards,
)
from storage.status import AttemptOutcome, JobStatus, ShardStatus


@pytest.fixture
def sessions(pg_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(pg_url)
    yield make_session_factory(engine)
    engine.dispose()


def _queued_job(sessions: sessionmaker[Session], shards: list[list[int]]) -> str:
    job_id = job_store.new_job_id()
    with sessions() as session:
        job_store.create_queued_job(
            session,
            job_id=job_id,
            tenant="t",
            model="m",
            params={},
            metadata={},
            input_name=f"jobs/{job_id}/input.parquet",
            created_at=utcnow(),
            num_rows=sum(map(len, shards)),
            shards=shards,
        )
    return job_id


def _row(job_id: str, index: int, tokens: int = 3) -> dict:
    return {
        "job_id": job_id,
        "row_index": index,
        "custom_id": f"id-{index}",
        "output_text": f"out {index}",
        "prompt_tokens": tokens,
        "output_tokens": 2 * tokens,
        "finish_reason": "stop",
        "error": None,
        "shard_index": 0,
    }


def test_a_held_lease_keeps_other_owners_out_until_it_lapses(sessions: sessionmaker[Session]) -> None:
    job_id = _queued_job(sessions, [[0, 1], [2]])
    with sessions() as session:
        assert claim_shard(session, job_id, 0, "worker-a", lease_seconds=60) == Claim.CLAIMED
        assert claim_shard(session, job_id, 0, "worker-b", lease_seconds=60) == Claim.HELD
        assert renew_lease(session, job_id, 0, "worker-a", lease_seconds=0.2)
        assert not renew_lease(session, job_id, 0, "worker-b", lease_seconds=60)
        time.sleep(0.3)
        # The lease lapsed (its owner died): another worker takes the shard over; the old owner lost it.
        assert claim_shard(session, job_id, 0, "worker-b", lease_seconds=60) == Claim.CLAIMED
        assert not renew_lease(session, job_id, 0, "worker-a", lease_seconds=60)
        assert not finish_shard(session, job_id, 0, "worker-a", ShardStatus.DONE, None)
        assert finish_shard(session, job_id, 0, "worker-b", ShardStatus.DONE, {"engine": {}})
        assert claim_shard(session, job_id, 0, "worker-c", lease_seconds=60) == Claim.FINISHED
        assert claim_shard(session, job_id, 7, "worker-c", lease_seconds=60) == Claim.MISSING

        assert claim_shard(session, job_id, 1, "worker-a", lease_seconds=60) == Claim.CLAIMED
        assert release_shard(session, job_id, 1, "worker-a", "boom")
        assert unfinished_shards(session, job_id) == 1
        assert claim_shard(session, job_id, 1, "worker-b", lease_seconds=60) == Claim.CLAIMED
        shard = get_shard(session, job_id, 1)
        session.refresh(shard)
        assert (shard.attempts, shard.owner, shard.error) == (2, "worker-b", "boom")


def test_concurrent_claims_and_transitions_have_exactly_one_winner(sessions: sessionmaker[Session]) -> None:
    job_id = _queued_job(sessions, [[0]])

    def claim(owner: str) -> Claim:
        with sessions() as session:
            return claim_shard(session, job_id, 0, owner, lease_seconds=60)

    def finalize(_: int) -> bool:
        with sessions() as session:
            return job_store.move(session, job_id, to=JobStatus.FINALIZING)

    with ThreadPoolExecutor(8) as pool:
        claims = list(pool.map(claim, [f"w{i}" for i in range(8)]))
        wins = list(pool.map(finalize, range(8)))
    assert claims.count(Claim.CLAIMED) == 1 and claims.count(Claim.HELD) == 7
    assert wins.count(True) == 1
    with sessions() as session:
        statuses = [event.status for event in job_store.events(session, job_id)]
    assert statuses == [JobStatus.VALIDATING, JobStatus.QUEUED, JobStatus.FINALIZING]


def test_result_inserts_skip_rows_already_stored(sessions: sessionmaker[Session]) -> None:
    job_id = _queued_job(sessions, [list(range(10))])
    with sessions() as session:
        insert_results(session, [_row(job_id, i) for i in (0, 1, 2)])
        # A re-run shard sends rows 1 and 2 again (with different text): the first stored copy stays.
        insert_results(session, [{**_row(job_id, i), "output_text": "again"} for i in (1, 2, 3)])
        assert stored_row_indices(session, job_id, list(range(10))) == {0, 1, 2, 3}
        assert token_sums(session, job_id) == (4, 12, 24)
        rows = [row for batch in iter_results(session, job_id, batch_rows=3) for row in batch]
        assert [row.row_index for row in rows] == [0, 1, 2, 3]
        assert [row.output_text for row in rows] == ["out 0", "out 1", "out 2", "again"]
        counts = job_store.request_counts(session, job_id, total=10)
        assert counts == {"total": 10, "completed": 4, "failed": 0}


def test_cancel_is_accepted_only_before_the_job_finishes(sessions: sessionmaker[Session]) -> None:
    job_id = _queued_job(sessions, [[0]])
    with sessions() as session:
        assert job_store.request_cancel(session, job_id)
        assert not job_store.request_cancel(session, job_id)  # already cancelling
        assert job_store.get_job(session, job_id).cancel_requested
        assert job_store.move(session, job_id, to=JobStatus.FINALIZING)
        assert job_store.move(session, job_id, to=JobStatus.CANCELLED)
        assert not job_store.request_cancel(session, job_id)
        job = job_store.get_job(session, job_id)
        session.refresh(job)
        assert job.status == JobStatus.CANCELLED and job.finished_at is not None


def test_listing_pages_newest_first_per_tenant(sessions: sessionmaker[Session]) -> None:
    tenant = f"pager-{time.monotonic_ns()}"
    ids = []
    with sessions() as session:
        for _ in range(5):
            job_id = job_store.new_job_id()
            job_store.create_job(
                session, job_id=job_id, tenant=tenant, model="m", params={}, metadata={}, input_name="x"
            )
            ids.append(job_id)
        first, more = job_store.list_jobs(session, tenant, limit=2)
        second, more2 = job_store.list_jobs(session, tenant, limit=2, after=first[-1].id)
        third, more3 = job_store.list_jobs(session, tenant, limit=2, after=second[-1].id)
        assert [j.id for j in first + second + third] == ids[::-1]
        assert (more, more2, more3) == (True, True, False)
        assert job_store.list_jobs(session, "someone-else", limit=10) == ([], False)
        with pytest.raises(LookupError):
            job_store.list_jobs(session, "someone-else", after=ids[0])


def test_attempt_costs_add_up_over_every_attempt_of_every_shard(sessions: sessionmaker[Session]) -> None:
    job_id = _queued_job(sessions, [[0, 1], [2]])
    other_job = _queued_job(sessions, [[0]])
    with sessions() as session:
        first = start_attempt(session, job_id=job_id, shard_index=0, owner="worker-a")
        (started,) = attempts_of(session, job_id=job_id)
        assert (started.id, started.outcome, started.counters) == (first, AttemptOutcome.RUNNING, {})
        # Counters are cumulative per attempt: each write replaces the one before.
        record_attempt(session, attempt_id=first, counters={"busy_seconds": 0.5, "computed_tokens": 40})
        record_attempt(
            session,
            attempt_id=first,
            counters={"busy_seconds": 1.25, "computed_tokens": 100, "peak_kv_utilization": 0.3},
            outcome=AttemptOutcome.RETRY,
        )
        second = start_attempt(session, job_id=job_id, shard_index=0, owner="worker-b")
        record_attempt(
            session,
            attempt_id=second,
            counters={"busy_seconds": 0.75, "computed_tokens": 60, "peak_kv_utilization": 0.2},
            outcome=AttemptOutcome.DONE,
        )
        # A worker killed mid-shard leaves its attempt running with what it last wrote.
        killed = start_attempt(session, job_id=job_id, shard_index=1, owner="worker-c")
        record_attempt(
            session,
            attempt_id=killed,
            counters={"busy_seconds": 0.5, "computed_tokens": 25, "peak_kv_utilization": 0.6},
        )
        # commit=False joins the caller's transaction: rolled back, neither the row nor the cost lands.
        insert_results(session, [_row(job_id, 2)], commit=False)
        record_attempt(session, attempt_id=killed, counters={"computed_tokens": 10**6}, commit=False)
        session.rollback()
        assert stored_row_indices(session, job_id, [2]) == set()
        start_attempt(session, job_id=other_job, shard_index=0, owner="worker-a")

        attempts = attempts_of(session, job_id=job_id)
        assert [(a.shard_index, a.owner, a.outcome) for a in attempts] == [
            (0, "worker-a", "retry"),
            (0, "worker-b", "done"),
            (1, "worker-c", "running"),
        ]
        assert all(a.updated_at >= a.started_at for a in attempts)
        assert [a.id for a in attempts_of(session, job_id=job_id, shard_index=0)] == [first, second]
        assert attempt_totals(session, job_id=job_id) == {
            "busy_seconds": 2.5,
            "computed_tokens": 185,
            "peak_kv_utilization": 0.6,  # a peak is the largest, not a sum
        }
        assert attempted_shards(session, job_id=job_id) == {0, 1}
        assert attempt_totals(session, job_id=other_job) == {}
        assert attempt_totals(session, job_id="job_unknown") == {}

        # The attempts go with their job (ON DELETE CASCADE).
        job_store.delete_job(session, job_id)
        assert attempts_of(session, job_id=job_id) == []
        assert len(attempts_of(session, job_id=other_job)) == 1
