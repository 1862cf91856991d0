"""Faults on real processes: `freight api`, two `freight worker`s, Postgres and Redis. Each job must end
with exactly one result per input row and metrics that agree with the rows.

The service here has its own queues and short timeouts: a 5 s shard lease (renewed every 1.25 s), a
1 s broker visibility timeout (so a shard outlives it even on a fast machine, where the longest runs
2.8 s: at 2 s a redelivery raced the shard's end there), and 2 attempts per shard. The
shards are made to run for seconds (per-row max_tokens up to 1900 with a 2048-token context), so a
fault can land in the middle of one."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import update

from jobs.cli.client import FreightClient
from jobs.domain.broker import CeleryDispatcher
from storage import job_store
from storage.models import Job
from tests.service.fault_helpers import (
    ServiceDB,
    assert_one_result_per_row,
    sigkill,
    signal_group,
    staggered_table,
    wait_for,
)
from tests.service.fixtures import (
    PARKED_MODEL,
    PG_ADMIN_URL,
    Process,
    ServiceEnv,
    create_api_key,
    make_service_env,
    start_api,
    start_worker,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fault_env(
    tmp_path_factory: pytest.TempPathFactory,
    pg_url: str,
    redis_url: str,
    queue_prefix: str,
    tiny_llama_dir: Path,
) -> ServiceEnv:
    return make_service_env(
        tmp_path_factory.mktemp("faults"),
        pg_url,
        redis_url,
        f"{queue_prefix}-faults",
        str(tiny_llama_dir),
        FREIGHT_MAX_MODEL_LEN="2048",
        FREIGHT_SHARD_LEASE_SECONDS="5",
        FREIGHT_BROKER_VISIBILITY_TIMEOUT="1",
        FREIGHT_SHARD_MAX_ATTEMPTS="2",
        FREIGHT_RESULT_CHUNK_ROWS="1",
        FREIGHT_CANCEL_POLL_SECONDS="0.5",
        FREIGHT_RECOVERY_INTERVAL_SECONDS="2",
    )


class Workers:
    """Two `freight worker` processes on the fault service; a test may kill one, the next restarts it."""

    def __init__(self, service: ServiceEnv, log_dir: Path) -> None:
        self.service = service
        self.log_dir = log_dir
        self.started = 0
        self.processes: list[Process] = []

    def ensure(self, count: int = 2) -> list[Process]:
        self.processes = [process for process in self.processes if process.alive()]
        while len(self.processes) < count:
            self.started += 1
            self.processes.append(start_worker(self.service, self.log_dir, f"fault{self.started}"))
        return self.processes

    def pids(self) -> set[int]:
        return {process.popen.pid for process in self.processes if process.alive()}

    def by_pid(self, pid: int) -> Process:
        return next(process for process in self.processes if process.popen.pid == pid)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


@pytest.fixture(scope="module")
def workers(fault_env: ServiceEnv, log_dir: Path) -> Iterator[Workers]:
    pool = Workers(fault_env, log_dir)
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def fault_api(fault_env: ServiceEnv, log_dir: Path) -> Iterator[tuple[Process, str]]:
    process, url = start_api(fault_env, log_dir)
    yield process, url
    process.stop()


@pytest.fixture(scope="module")
def fault_key(fault_env: ServiceEnv) -> str:
    return create_api_key(fault_env, "faults")


@pytest.fixture
def fault_client(fault_api: tuple[Process, str], fault_key: str) -> Iterator[FreightClient]:
    with FreightClient(fault_api[1], fault_key) as client:
        yield client


@pytest.fixture(scope="module")
def db(fault_env: ServiceEnv) -> Iterator[ServiceDB]:
    view = ServiceDB(fault_env)
    yield view
    view.close()


def test_a_shard_that_outlives_the_visibility_timeout_runs_once(
    fault_client: FreightClient, workers: Workers, db: ServiceDB
) -> None:
    """Redis hands the unacknowledged shard to the idle second worker after 1 s; the lease turns it
    away (it looks again later and finds the shard done), so the shard runs once."""
    first, second = workers.ensure(2)
    table = staggered_table(4, (1900, 1900, 1900, 1900))  # one shard of 2.8 s (fast VM) to 5 s
    job = fault_client.submit(table, max_tokens=8, reuse_results=False)  # run, not reused from the cache
    done = fault_client.wait(job["id"], poll_seconds=0.2, timeout=120)
    assert done["status"] == "completed", done
    assert_one_result_per_row(fault_client, job["id"], table)
    (shard,) = db.shards(job["id"])
    assert (shard.status, shard.attempts, shard.rows_run) == ("done", 1, 4)
    held = f"shard 0 of {job['id']} is held by another worker"
    assert held in first.output() + second.output(), "the redelivered task never reached a worker"


def test_sigkill_mid_shard_resumes_from_the_rows_already_stored(
    fault_client: FreightClient, workers: Workers, db: ServiceDB
) -> None:
    workers.ensure(2)
    table = staggered_table(12)  # 3 shards of 4; each shard's rows finish seconds apart
    job = fault_client.submit(table, max_tokens=8, reuse_results=False)  # run, not reused from the cache
    victim_shard = wait_for(lambda: db.running_shard(job["id"]), 60, "a shard half done")
    victim = workers.by_pid(victim_shard.owner_pid)
    sigkill(victim)
    stored_before_kill = victim_shard.stored

    done = fault_client.wait(job["id"], poll_seconds=0.3, timeout=120)
    assert done["status"] == "completed", done
    assert_one_result_per_row(fault_client, job["id"], table)
    shards = {shard.index: shard for shard in db.shards(job["id"])}
    resumed = shards[victim_shard.index]
    assert resumed.status == "done" and resumed.attempts == 2
    assert resumed.owner_pid != victim.popen.pid
    # The rerun ran only the rows the killed worker had not stored.
    assert resumed.rows_run <= 4 - stored_before_kill
    assert all(s.status == "done" for s in shards.values())

    # The killed attempt's engine work is still counted: its row keeps what its last result insert
    # (or heartbeat) stored, and the job's metrics sum every attempt.
    attempts = db.attempts(job["id"])
    on_victim_shard = [a for a in attempts if a.shard_index == victim_shard.index]
    assert len(on_victim_shard) >= 2
    (killed,) = [a for a in on_victim_shard if int(a.owner.split(":")[1]) == victim.popen.pid]
    assert killed.outcome == "running"  # it never ended: SIGKILL leaves no last word
    assert killed.counters["computed_tokens"] > 0 and killed.counters["busy_seconds"] > 0
    assert on_victim_shard[-1].outcome == "done"
    metrics = fault_client.metrics(job["id"])
    assert metrics["computed_tokens"] == sum(a.counters["computed_tokens"] for a in attempts)
    assert metrics["device_seconds"] == pytest.approx(
        sum(a.counters["busy_seconds"] for a in attempts), abs=1e-3
    )


def test_sigterm_hands_the_shard_back_without_losing_rows(
    fault_client: FreightClient, workers: Workers, db: ServiceDB
) -> None:
    workers.ensure(2)
    table = staggered_table(8)
    job = fault_client.submit(table, max_tokens=8, reuse_results=False)  # run, not reused from the cache
    # Two rows still to go, so the stop lands before the shard could finish on its own.
    shard = wait_for(lambda: db.running_shard(job["id"], most_stored=2), 60, "a shard half done")
    stopping = workers.by_pid(shard.owner_pid)
    signal_group(stopping, signal.SIGTERM)
    stopping.popen.wait(20)  # it stops between engine steps instead of finishing a long shard
    assert "handed back" in stopping.output()

    done = fault_client.wait(job["id"], poll_seconds=0.3, timeout=120)
    assert done["status"] == "completed", done
    assert_one_result_per_row(fault_client, job["id"], table)
    again = {s.index: s for s in db.shards(job["id"])}[shard.index]
    # The hand-back did not use up an attempt, and the rows stored before it were not run again.
    assert again.status == "done" and again.attempts == 1 and again.owner_pid != stopping.popen.pid
    assert again.rows_run <= 4 - shard.stored
    # Not counted towards the attempt limit, yet the handed-back run's engine work is in the cost.
    attempts = db.attempts(job["id"])
    handed_back, finished = [a for a in attempts if a.shard_index == shard.index]
    assert (handed_back.outcome, finished.outcome) == ("handed_back", "done")
    assert handed_back.counters["computed_tokens"] > 0
    metrics = fault_client.metrics(job["id"])
    assert metrics["computed_tokens"] == sum(a.counters["computed_tokens"] for a in attempts)


def test_terminated_database_connections_mid_job(
    fault_client: FreightClient, workers: Workers, db: ServiceDB, fault_env: ServiceEnv
) -> None:
    """pg_terminate_backend on the worker's connection in the middle of a result insert (held there
    by a table lock, so the kill lands mid-write for sure), then on every connection of the service
    (API and worker) for a few seconds."""
    (worker,) = workers.ensure(1)
    table = staggered_table(8, (200, 500, 800, 1100))
    job = fault_client.submit(table, max_tokens=8, reuse_results=False)  # run, not reused from the cache
    wait_for(lambda: db.stored_rows(job["id"]) > 0, 60, "the first rows")
    database = fault_env.settings.resolved_database_url.rsplit("/", 1)[1]
    test_db_url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{database}"
    with psycopg.connect(test_db_url) as locker, psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        locker.execute("LOCK TABLE results IN EXCLUSIVE MODE")  # inserts wait; reads go on

        def blocked_insert() -> list[int]:
            return [
                pid
                for (pid,) in admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock' "
                    "AND query ILIKE 'INSERT INTO results%%'",
                    (database,),
                )
            ]

        writers = wait_for(blocked_insert, 30, "a result insert waiting on the lock")
        admin.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (writers,))
        locker.rollback()
        locker.close()
        killed = 0
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            killed += admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (database,),
            ).fetchone()[0]
            time.sleep(0.25)
    assert killed > 0
    done = fault_client.wait(job["id"], poll_seconds=0.3, timeout=120)
    assert done["status"] == "completed", done
    assert_one_result_per_row(fault_client, job["id"], table)
    # The interrupted shard was retried from its stored rows, without using up an attempt.
    assert [(s.status, s.attempts) for s in db.shards(job["id"])] == [("done", 1), ("done", 1)]
    assert "terminating connection due to administrator command" in worker.output()


def test_a_shard_that_keeps_failing_ends_as_error_rows(
    fault_client: FreightClient, workers: Workers, db: ServiceDB, fault_env: ServiceEnv
) -> None:
    """A poisoned shard (parameters the engine refuses, planted in the database: no valid request can
    make one) fails on every attempt; after 2 its rows are error rows and the job still completes."""
    workers.ensure(1)
    table = staggered_table(6, (4,))
    job = fault_client.submit(table, model=PARKED_MODEL, max_tokens=4)  # nobody runs it yet
    model = fault_env.settings.default_model
    with db.session() as session:
        params = {**job_store.get_job(session, job["id"]).params, "top_k": -1, "model": model}
        session.execute(update(Job).where(Job.id == job["id"]).values(params=params, model=model))
        session.commit()
    CeleryDispatcher(fault_env.settings).dispatch(job["id"], model, [0, 1])

    done = fault_client.wait(job["id"], poll_seconds=0.3, timeout=120)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 6, "completed": 0, "failed": 6}
    rows = assert_one_result_per_row(fault_client, job["id"], table)
    assert all(
        row["error"].startswith("the shard failed 2 times") and "top_k" in row["error"] for row in rows
    )
    assert [(s.status, s.attempts) for s in db.shards(job["id"])] == [("failed", 2), ("failed", 2)]


def test_the_api_restarted_mid_job(
    fault_env: ServiceEnv, fault_key: str, workers: Workers, db: ServiceDB, log_dir: Path
) -> None:
    workers.ensure(1)
    first_api, first_url = start_api(fault_env, log_dir)
    table = staggered_table(8, (200, 500, 800, 1100))
    with FreightClient(first_url, fault_key) as client:
        job = client.submit(table, max_tokens=8)
    wait_for(lambda: db.stored_rows(job["id"]) > 0, 60, "the first rows")
    sigkill(first_api)
    second_api, second_url = start_api(fault_env, log_dir)
    try:
        with FreightClient(second_url, fault_key) as client:
            assert client.get_job(job["id"])["status"] in ("in_progress", "finalizing", "completed")
            done = client.wait(job["id"], poll_seconds=0.3, timeout=120)
            assert done["status"] == "completed", done
            assert_one_result_per_row(client, job["id"], table)
    finally:
        second_api.stop()
    assert [(s.status, s.attempts) for s in db.shards(job["id"])] == [("done", 1), ("done", 1)]
