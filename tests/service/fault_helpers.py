"""Helpers for the fault tests: inputs whose shards run for seconds (so a fault lands mid-shard), a
view of the service's database, and the checks every fault test ends with."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from jobs.cli.client import FreightClient
from storage.attempt_store import attempts_of
from storage.db import make_engine, make_session_factory
from storage.models import ResultRow, Shard, ShardAttempt
from storage.shard_store import shards_of
from tests.service.fixtures import Process, ServiceEnv

# Output lengths within each shard of 4: the first row is stored at once, the last after seconds.
STAGGERED_MAX_TOKENS = (40, 400, 800, 1200)


def staggered_table(rows: int, lengths: tuple[int, ...] = STAGGERED_MAX_TOKENS) -> pa.Table:
    """Prompts of equal length (so shard k holds rows 4k..4k+3) with per-row max_tokens."""
    return pa.table(
        {
            "custom_id": [f"row-{i:04d}" for i in range(rows)],
            "prompt": [f"Row {i:04d}: tell a long story." for i in range(rows)],
            "max_tokens": pa.array([lengths[i % len(lengths)] for i in range(rows)], pa.int64()),
        }
    )


@dataclass
class ShardView:
    index: int
    status: str
    owner_pid: int | None
    attempts: int
    rows: int
    stored: int
    rows_run: int | None  # rows the engine ran in the run that finished the shard


class ServiceDB:
    """Read-only looks at the service's tables, as the tests need them."""

    def __init__(self, service: ServiceEnv) -> None:
        self.engine = make_engine(service.settings.resolved_database_url)
        self.sessions = make_session_factory(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self.sessions() as session:
            yield session

    def shards(self, job_id: str) -> list[ShardView]:
        with self.session() as session:
            stored = dict(
                session.execute(
                    select(ResultRow.shard_index, func.count())
                    .where(ResultRow.job_id == job_id)
                    .group_by(ResultRow.shard_index)
                ).all()
            )
            return [
                ShardView(
                    index=shard.shard_index,
                    status=shard.status,
                    owner_pid=int(shard.owner.split(":")[1]) if shard.owner else None,
                    attempts=shard.attempts,
                    rows=len(shard.row_indices),
                    stored=stored.get(shard.shard_index, 0),
                    rows_run=(shard.stats or {}).get("rows_run"),
                )
                for shard in shards_of(session, job_id)
            ]

    def attempts(self, job_id: str) -> list[ShardAttempt]:
        """Every attempt at the job's shards, oldest first (read-only copies)."""
        with self.session() as session:
            return attempts_of(session, job_id=job_id)

    def running_shard(self, job_id: str, most_stored: int = 3) -> ShardView | None:
        """A running shard that has stored some rows, but at most `most_stored` of its 4."""
        for shard in self.shards(job_id):
            if shard.status == "running" and 0 < shard.stored <= min(most_stored, shard.rows - 1):
                return shard
        return None

    def stored_rows(self, job_id: str) -> int:
        with self.session() as session:
            return session.scalar(
                select(func.count()).select_from(ResultRow).where(ResultRow.job_id == job_id)
            )

    def shard_count(self, job_id: str) -> int:
        with self.session() as session:
            return session.scalar(select(func.count()).select_from(Shard).where(Shard.job_id == job_id))


def wait_for(condition: Callable[[], object], timeout: float, what: str, poll: float = 0.05) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def signal_group(process: Process, sig: int) -> None:
    """Signal the process and anything it started (it runs in its own session)."""
    os.killpg(process.popen.pid, sig)


def sigkill(process: Process) -> None:
    signal_group(process, signal.SIGKILL)
    process.popen.wait(10)
    process.log.close()


def assert_one_result_per_row(client: FreightClient, job_id: str, table: pa.Table) -> list[dict]:
    """The finished job has exactly one result per input row, in order, with its custom_id, and its
    metrics agree with the rows."""
    rows = client.results_table(job_id).to_pylist()
    assert [row["row_index"] for row in rows] == list(range(table.num_rows))
    if "custom_id" in table.column_names:
        assert [row["custom_id"] for row in rows] == table.column("custom_id").to_pylist()
    metrics = client.metrics(job_id)
    assert metrics["rows"] == table.num_rows
    assert metrics["prompt_tokens"] == sum(row["prompt_tokens"] for row in rows)
    assert metrics["output_tokens"] == sum(row["output_tokens"] for row in rows)
    failed = [row for row in rows if row["finish_reason"] == "error"]
    assert metrics["rows_failed"] == len(failed)
    assert metrics["rows_completed"] == len(rows) - len(failed) - metrics["rows_cancelled"]
    return rows
