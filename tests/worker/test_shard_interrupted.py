"""A shard whose database connection is killed in the middle of a result insert (real Postgres,
pg_terminate_backend on the blocked insert): the attempt fails without being counted, the engine
drops the requests it left behind, and the retry stores each remaining row with its own output."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.domain.schemas import JobParams
from jobs.domain.service import JobService
from jobs.domain.settings import Settings
from storage.blobs import BlobStore, results_name
from storage.db import make_engine, make_session_factory
from storage.shard_store import get_shard
from tests.service.fault_helpers import wait_for
from tests.service.fixtures import PG_ADMIN_URL
from worker.finalize import finalize_job
from worker.llm_pool import LLMPool
from worker.retry import ShardRetry
from worker.shard.context import WorkerContext
from worker.shard.executor import run_shard

MAX_TOKENS = [5, 150, 300, 450, 600, 750]


@pytest.fixture(scope="module")
def ctx(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerContext]:  # noqa: F811
    settings = Settings(
        database_url=pg_url,
        home=tmp_path_factory.mktemp("home"),
        data_dir=tmp_path_factory.mktemp("data"),
        shard_size=8,
        max_model_len=1024,
        max_num_seqs=16,
        kv_cache_memory_gb=0.1,
        num_threads=1,
        result_chunk_rows=1,
        shard_max_attempts=1,  # a counted attempt would turn the rows into errors
    )
    engine = make_engine(pg_url)
    yield WorkerContext(
        settings=settings, sessions=make_session_factory(engine), blobs=BlobStore(settings.data_dir)
    )
    engine.dispose()


def submit(ctx: WorkerContext, tmp_path: Path, model: Path) -> str:
    rows = len(MAX_TOKENS)
    source = tmp_path / "input.parquet"
    table = pa.table(
        {
            "custom_id": [f"c{i}" for i in range(rows)],
            # Each row's prompt has its own length, so a row stored with another row's output shows.
            "prompt": [("word " * (3 * i + 1)).strip() for i in range(rows)],
            "max_tokens": pa.array(MAX_TOKENS, pa.int64()),
        }
    )
    pq.write_table(table, source)
    service = JobService(ctx.settings, ctx.sessions, ctx.blobs, dispatcher=None, allow_any_model=True)
    with open(source, "rb") as upload:
        return service.submit("interrupted", upload, JobParams(model=str(model), max_tokens=8, reuse_results=False)).id  # each job runs: no result cache


def test_a_write_cut_mid_stream_is_retried_with_the_right_rows(
    ctx: WorkerContext, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    pool = LLMPool(ctx.settings)
    reference_job = submit(ctx, tmp_path, tiny_llama_dir)
    assert run_shard(ctx, pool, reference_job, 0).status == "done"
    assert finalize_job(ctx, reference_job) == "completed"
    reference = {
        r["custom_id"]: r for r in pq.read_table(ctx.blobs.path(results_name(reference_job))).to_pylist()
    }

    job_id = submit(ctx, tmp_path, tiny_llama_dir)
    database = ctx.settings.resolved_database_url.rsplit("/", 1)[1]
    failures: list[BaseException] = []

    def first_attempt() -> None:
        try:
            run_shard(ctx, pool, job_id, 0)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            failures.append(exc)

    with (
        psycopg.connect(PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{database}") as locker,
        psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin,
    ):
        # Let the first row in, then hold the next insert on a table lock and kill its connection.
        runner = threading.Thread(target=first_attempt)
        runner.start()
        with ctx.sessions() as session:
            wait_for(lambda: session.scalar(_stored_rows_sql(job_id)) >= 1, 60, "the first row")
        locker.execute("LOCK TABLE results IN EXCLUSIVE MODE")
        blocked = wait_for(lambda: _blocked_inserts(admin, database), 60, "an insert waiting on the lock")
        admin.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (blocked,))
        locker.rollback()
        runner.join(60)
    assert len(failures) == 1 and isinstance(failures[0], ShardRetry), failures
    assert "terminating connection due to administrator command" in str(failures[0])
    with ctx.sessions() as session:
        shard = get_shard(session, job_id, 0)
        assert (shard.status, shard.attempts) == ("pending", 0)  # handed back, not counted

    outcome = run_shard(ctx, pool, job_id, 0)
    assert outcome.status == "done" and 0 < outcome.rows_written < len(MAX_TOKENS)
    assert finalize_job(ctx, job_id) == "completed"
    rows = pq.read_table(ctx.blobs.path(results_name(job_id))).to_pylist()
    assert [r["custom_id"] for r in rows] == [f"c{i}" for i in range(len(MAX_TOKENS))]
    for row in rows:
        assert row["finish_reason"] in ("stop", "length"), row
        assert row["prompt_tokens"] == reference[row["custom_id"]]["prompt_tokens"], row["custom_id"]
        assert row["output_tokens"] <= MAX_TOKENS[int(row["custom_id"][1:])]


def _stored_rows_sql(job_id: str):
    from sqlalchemy import func, select

    from storage.models import ResultRow

    return select(func.count()).select_from(ResultRow).where(ResultRow.job_id == job_id)


def _blocked_inserts(admin: psycopg.Connection, database: str) -> list[int]:
    return [
        pid
        for (pid,) in admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock' "
            "AND query ILIKE 'INSERT INTO results%%'",
            (database,),
        )
    ]
