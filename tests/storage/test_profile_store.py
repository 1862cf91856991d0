"""The throughput profile store on both databases: each finished shard adds to its (model, worker class)
row in one upsert; a quote reads the rows, the model's backlog and the worker processes busy on it."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from storage import job_store
from storage.attempt_store import start_attempt
from storage.db import make_engine, make_session_factory, upgrade
from storage.models import utcnow
from storage.profile_store import ShardWork, backlog_rows, profiles_of, record_shard, worker_processes
from storage.result_record import ResultRecord
from storage.result_store import insert_results
from storage.status import JobStatus


@pytest.fixture(params=["sqlite", "postgres"])
def sessions(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'freight.db'}"
        upgrade(url)
    else:
        url = request.getfixturevalue("pg_url")
    engine = make_engine(url)
    yield make_session_factory(engine)
    engine.dispose()


def unique_model() -> str:
    return f"model-{secrets.token_hex(4)}"  # the Postgres database is the session's: one name per test


def test_each_shard_adds_to_its_model_and_worker_class(sessions: sessionmaker[Session]) -> None:
    model = unique_model()
    with sessions() as session:
        assert profiles_of(session, model=model) == []
        record_shard(session, model=model, worker_class="avx512", work=ShardWork(8, 100, 40, 2.0, 8 * 64))
        record_shard(session, model=model, worker_class="avx512", work=ShardWork(4, 300, 10, 1.5, 0))
        record_shard(session, model=model, worker_class="cuda", work=ShardWork(2, 10, 5, 0.25, 2 * 16))
    with sessions() as session:
        rows = {row.worker_class: row for row in profiles_of(session, model=model)}
        assert [row.worker_class for row in profiles_of(session, model=model)] == ["avx512", "cuda"]
        cpu = rows["avx512"]
        assert (cpu.shards, cpu.rows, cpu.prompt_tokens, cpu.output_tokens) == (2, 12, 400, 50)
        assert cpu.busy_seconds == pytest.approx(3.5)
        assert cpu.sum_pp == pytest.approx(100**2 + 300**2)
        assert cpu.sum_po == pytest.approx(100 * 40 + 300 * 10)
        assert cpu.sum_oo == pytest.approx(40**2 + 10**2)
        assert cpu.sum_ps == pytest.approx(100 * 2.0 + 300 * 1.5)
        assert cpu.sum_os == pytest.approx(40 * 2.0 + 10 * 1.5)
        # Only the shard with a max_tokens cap counts towards how much of the cap rows use.
        assert (cpu.capped_output_tokens, cpu.capped_max_tokens) == (40, 512)
        assert (rows["cuda"].shards, rows["cuda"].capped_max_tokens) == (1, 32)
        assert profiles_of(session, model=model + "-other") == []


def _job(session: Session, model: str, rows: int, status: JobStatus) -> str:
    job_id = job_store.new_job_id()
    job_store.create_queued_job(
        session,
        job_id=job_id,
        tenant="profiles",
        model=model,
        params={},
        metadata={},
        input_name=f"jobs/{job_id}/input.parquet",
        created_at=utcnow(),
        num_rows=rows,
        shards=[list(range(rows))],
    )
    if status != JobStatus.QUEUED:
        job_store.move(session, job_id, to=status)
    return job_id


def test_backlog_counts_unfinished_rows_of_queued_and_running_jobs(sessions: sessionmaker[Session]) -> None:
    model = unique_model()
    with sessions() as session:
        assert backlog_rows(session, model=model) == 0
        _job(session, model, 10, JobStatus.QUEUED)
        running = _job(session, model, 6, JobStatus.IN_PROGRESS)
        _job(session, model + "-other", 50, JobStatus.QUEUED)  # another model's queue
        insert_results(
            session,
            [ResultRecord.failed(i, str(i), "x").stored(job_id=running, shard_index=0) for i in range(4)],
        )
        assert backlog_rows(session, model=model) == 10 + 6 - 4


def test_worker_processes_are_the_recent_attempt_owners_of_the_model(sessions: sessionmaker[Session]) -> None:
    model = unique_model()
    with sessions() as session:
        job_id = _job(session, model, 4, JobStatus.QUEUED)
        since = utcnow() - timedelta(seconds=60)
        assert worker_processes(session, model=model, since=since) == 0
        # Two threads of one process share its engine: one worker; another host is a second one.
        for owner in ("host-a:10:1", "host-a:10:2", "host-b:10:1"):
            start_attempt(session, job_id=job_id, shard_index=0, owner=owner)
        assert worker_processes(session, model=model, since=since) == 2
        assert worker_processes(session, model=model + "-other", since=since) == 0
        assert worker_processes(session, model=model, since=utcnow() + timedelta(seconds=1)) == 0
