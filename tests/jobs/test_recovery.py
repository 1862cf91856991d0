"""The API's recovery sweep on real Postgres and Redis: a shard or finalize task with no message in
the broker is re-sent once it is missing on two sweeps; one held under a live lease, or still queued,
is left alone; a job abandoned mid-validation is deleted with its files."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from jobs.domain.broker import TASK_FINALIZE_JOB, TASK_RUN_SHARD, CeleryDispatcher, queue_for_model
from jobs.domain.recovery import Recovery, message_work
from jobs.domain.settings import Settings
from storage import job_store, openai_store
from storage.blobs import BlobStore, input_name
from storage.db import make_engine, make_session_factory
from storage.models import Job, utcnow
from storage.result_record import ResultRecord
from storage.result_store import insert_results, stored_row_indices
from storage.shard_store import claim_shard, finish_shard
from storage.status import JobStatus, ShardStatus

MODEL = "recovery-model"


@pytest.fixture
def recovery(pg_url: str, redis_url: str, queue_prefix: str, tmp_path: Path) -> Iterator[Recovery]:
    settings = Settings(
        database_url=pg_url,
        broker_url=redis_url,
        data_dir=tmp_path / "data",
        queue_prefix=f"{queue_prefix}-recovery-{tmp_path.name}",
        recovery_interval_seconds=5,
    )
    engine = make_engine(pg_url)
    sweeper = Recovery(
        settings, make_session_factory(engine), BlobStore(settings.data_dir), CeleryDispatcher(settings)
    )
    yield sweeper
    sweeper.redis.delete(queue_for_model(settings, MODEL))
    sweeper.close()
    engine.dispose()


def old_job(recovery: Recovery, shards: int, status: JobStatus = JobStatus.QUEUED) -> str:
    """A job created ten minutes ago (older than a sweep), with `shards` shards of one row."""
    job_id = job_store.new_job_id()
    recovery.blobs.write_text(input_name(job_id), "not read here")
    fields = dict(
        job_id=job_id, tenant="recovery", model=MODEL, params={}, metadata={}, input_name=input_name(job_id)
    )
    with recovery.sessions() as session:
        if status == JobStatus.VALIDATING:
            job_store.create_job(session, **fields)
        else:  # as a submission stores it: validated, its shards cut, queued
            rows = [[index] for index in range(shards)]
            job_store.create_queued_job(session, **fields, created_at=utcnow(), num_rows=shards, shards=rows)
        session.execute(
            update(Job).where(Job.id == job_id).values(created_at=utcnow() - timedelta(minutes=10))
        )
        session.commit()
    return job_id


def queued_work(recovery: Recovery, job_id: str) -> list:
    queue = queue_for_model(recovery.settings, MODEL)
    return sorted(
        (
            work
            for raw in recovery.redis.lrange(queue, 0, -1)
            if (work := message_work(raw)) and work[1] == job_id
        ),
        key=str,
    )


def test_lost_shard_tasks_are_resent_after_two_sweeps(recovery: Recovery) -> None:
    job_id = old_job(recovery, shards=3)
    with recovery.sessions() as session:
        claim_shard(session, job_id, 0, "live-worker", lease_seconds=300)  # running: leave it
        claim_shard(session, job_id, 1, "dead-worker", lease_seconds=-1)  # lease lapsed: lost
    first = recovery.sweep()
    assert first.shards_resent == [] and queued_work(recovery, job_id) == []  # missing once: suspects
    second = recovery.sweep()
    assert sorted(second.shards_resent) == [(job_id, 1), (job_id, 2)]
    assert queued_work(recovery, job_id) == [(TASK_RUN_SHARD, job_id, 1), (TASK_RUN_SHARD, job_id, 2)]
    third = recovery.sweep()  # the messages are there now: nothing more is sent
    assert third.shards_resent == [] and len(queued_work(recovery, job_id)) == 2


def test_a_queued_message_is_not_duplicated(recovery: Recovery) -> None:
    job_id = old_job(recovery, shards=2)
    recovery.dispatcher.dispatch(job_id, MODEL, [0, 1])
    for _ in range(3):
        assert recovery.sweep().shards_resent == []
    assert len(queued_work(recovery, job_id)) == 2


def test_a_finished_job_whose_finalize_was_lost_is_finalized(recovery: Recovery) -> None:
    job_id = old_job(recovery, shards=1)
    with recovery.sessions() as session:
        claim_shard(session, job_id, 0, "w", lease_seconds=60)
        finish_shard(session, job_id, 0, "w", ShardStatus.DONE, None)
    recovery.sweep()
    with recovery.sessions() as session:
        assert job_store.job_status(session, job_id) == JobStatus.FINALIZING
    assert recovery.sweep().finalize_resent == [job_id]
    assert queued_work(recovery, job_id) == [(TASK_FINALIZE_JOB, job_id, None)]


def test_a_job_abandoned_mid_validation_is_deleted(recovery: Recovery) -> None:
    job_id = old_job(recovery, shards=0, status=JobStatus.VALIDATING)
    assert recovery.sweep().abandoned_deleted == []  # ten minutes is not abandoned yet
    with recovery.sessions() as session:
        session.execute(update(Job).where(Job.id == job_id).values(created_at=utcnow() - timedelta(hours=2)))
        session.commit()
    assert recovery.sweep().abandoned_deleted == [job_id]
    with recovery.sessions() as session:
        assert job_store.get_job(session, job_id) is None
    assert not recovery.blobs.path(f"jobs/{job_id}").exists()


def test_messages_that_are_not_ours_are_ignored() -> None:
    assert message_work(b"not json") is None
    assert message_work(b'{"headers": {"task": "other.task"}, "body": "W1tdLCB7fSwge31d"}') is None


def test_a_batch_past_its_window_expires_on_a_sweep_with_nobody_reading_it(recovery: Recovery) -> None:
    job_id = old_job(recovery, shards=1)
    on_time_job = old_job(recovery, shards=1)
    now = utcnow()
    late, on_time = openai_store.new_batch_id(), openai_store.new_batch_id()
    with recovery.sessions() as session:
        for batch_id, job, expires in ((late, job_id, now - timedelta(seconds=1)),
                                       (on_time, on_time_job, now + timedelta(hours=1))):  # fmt: skip
            openai_store.add_batch(
                session, batch_id=batch_id, tenant="recovery", job_id=job,
                endpoint="/v1/chat/completions", input_file_id="file_x", completion_window="24h",
                metadata={}, created_at=now - timedelta(hours=24), expires_at=expires, line_errors=[], errors=None,
            )  # fmt: skip
    assert recovery.sweep().batches_expired == [late]
    with recovery.sessions() as session:
        assert job_store.job_status(session, job_id) == JobStatus.CANCELLING  # finished rows are kept
        assert job_store.job_status(session, on_time_job) == JobStatus.QUEUED
    assert recovery.sweep().batches_expired == []  # once


def test_a_job_past_its_deadline_expires_on_a_sweep_keeping_its_finished_rows(recovery: Recovery) -> None:
    job_id = old_job(recovery, shards=2)
    with recovery.sessions() as session:  # one shard done, then the deadline passes
        assert claim_shard(session, job_id, 0, "w:1:1", 60) == "claimed"
        insert_results(session, [ResultRecord.failed(0, "r0", "a stored row").stored(job_id=job_id, shard_index=0)])
        assert finish_shard(session, job_id, 0, "w:1:1", ShardStatus.DONE, None)
        session.execute(update(Job).where(Job.id == job_id).values(deadline=utcnow() - timedelta(seconds=1)))
        session.commit()
    assert recovery.sweep().jobs_expired == [job_id]
    with recovery.sessions() as session:
        job = job_store.get_job(session, job_id)
        assert (job.status, job.cancel_requested) == (JobStatus.CANCELLING, True) and job.expired_at is not None
        assert stored_row_indices(session, job_id, [0, 1]) == {0}
    assert recovery.sweep().jobs_expired == []  # once


def test_the_sweep_deletes_expired_result_cache_entries(recovery: Recovery) -> None:
    from sqlalchemy import select

    from storage.models import ResultCacheEntry
    from storage.result_cache_store import CachedOutput, remember_outputs

    tenant = f"recovery-{job_store.new_job_id()}"
    expired = utcnow() - timedelta(seconds=recovery.settings.result_cache_ttl_seconds + 60)
    with recovery.sessions() as session:
        outputs = [CachedOutput(key, "text", 1, 1, "stop", 0.1) for key in ("old", "new")]
        remember_outputs(session, tenant=tenant, job_id="j", outputs=outputs)
        session.execute(
            update(ResultCacheEntry)
            .where(ResultCacheEntry.tenant == tenant, ResultCacheEntry.key == "old")
            .values(created_at=expired)
        )
        session.commit()
    assert recovery.sweep().cache_entries_expired >= 1
    with recovery.sessions() as session:
        kept = set(session.scalars(select(ResultCacheEntry.key).where(ResultCacheEntry.tenant == tenant)))
    assert kept == {"new"}


def test_a_shard_whose_ticket_ran_another_is_left_to_that_ones_ticket(recovery: Recovery) -> None:
    """Shard 0's message ran shard 1 (a ticket claims the best free shard: docs/scheduling.md), so shard 0
    has no message of its own, but shard 1's still waits in the queue and will run it: nothing is re-sent.
    Once that ticket is gone too, shard 0 is re-sent after two sweeps as any lost shard."""
    job_id = old_job(recovery, shards=3)
    recovery.dispatcher.dispatch(job_id, MODEL, [1, 2])  # shard 0's message was taken ...
    with recovery.sessions() as session:
        claim_shard(session, job_id, 1, "live-worker", lease_seconds=300)  # ... and runs shard 1
    for _ in range(3):
        assert recovery.sweep().shards_resent == []
    assert queued_work(recovery, job_id) == [(TASK_RUN_SHARD, job_id, 1), (TASK_RUN_SHARD, job_id, 2)]
    # Shard 1's ticket ran shard 2 (finished), shard 2's was lost: shard 0 lacks a ticket for good.
    recovery.redis.delete(queue_for_model(recovery.settings, MODEL))
    with recovery.sessions() as session:
        claim_shard(session, job_id, 2, "live-worker", lease_seconds=300)
        finish_shard(session, job_id, 2, "live-worker", ShardStatus.DONE, None)
    assert recovery.sweep().shards_resent == []  # missing once: a suspect
    assert recovery.sweep().shards_resent == [(job_id, 0)]


def test_a_resent_shard_message_carries_its_jobs_schedule(recovery: Recovery) -> None:
    """Flower's task page shows a task's arguments: a shard message names its job (first argument) and
    carries the job's tenant, priority class and deadline as keyword arguments (broker.TaskLabels), when
    the sweep re-sends it as when the submission sent it."""
    import base64
    import json

    job_id = old_job(recovery, shards=1)
    due = utcnow() + timedelta(hours=3)
    with recovery.sessions() as session:
        session.execute(update(Job).where(Job.id == job_id).values(priority="high", deadline=due))
        session.commit()
    recovery.sweep()
    assert recovery.sweep().shards_resent == [(job_id, 0)]
    (raw,) = recovery.redis.lrange(queue_for_model(recovery.settings, MODEL), 0, -1)
    args, kwargs, _embed = json.loads(base64.b64decode(json.loads(raw)["body"]))
    assert args == [job_id, 0]
    assert kwargs == {"tenant": "recovery", "priority": "high", "deadline": due.isoformat(timespec="seconds")}
    assert message_work(raw) == (TASK_RUN_SHARD, job_id, 0)
