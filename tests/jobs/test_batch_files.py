"""A GET never writes: an OpenAI batch's output and error files are written when its job becomes final, by
the worker's finalize or, when that worker died first, by the API's recovery sweep; reading the batch
(retrieve, list) issues no write to the database and leaves the blob store as it was.

Real Postgres and a real blob folder; the job's rows are stored as a worker stores them (no engine), then
worker.finalize.finalize_job runs, as the finalize task does."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, update

from jobs.domain.broker import CeleryDispatcher
from jobs.domain.openai_service import BatchService
from jobs.domain.recovery import Recovery
from jobs.domain.service import JobService
from storage import job_store, openai_store
from storage.blobs import BlobStore
from storage.db import make_engine, make_session_factory
from storage.models import Job
from storage.result_store import insert_results
from storage.shard_store import claim_shard, finish_shard, shards_of
from storage.status import ShardStatus
from tests.service.fixtures import PARKED_MODEL, ServiceEnv, make_service_env
from worker import finalize
from worker.shard.context import WorkerContext

TENANT = "batch-files"
ANSWERS = {"a0": "stop", "a1": "error", "a2": "length"}  # custom_id -> how its row ended


@pytest.fixture(scope="module")
def env(
    tmp_path_factory: pytest.TempPathFactory, pg_url: str, redis_url: str, queue_prefix: str
) -> ServiceEnv:
    return make_service_env(
        tmp_path_factory.mktemp("batch-files"), pg_url, redis_url, queue_prefix, PARKED_MODEL
    )


@pytest.fixture(scope="module")
def jobs(env: ServiceEnv) -> Iterator[JobService]:
    engine = make_engine(env.settings.resolved_database_url)
    # No dispatcher: the shards are "run" below by storing their rows, as a worker would.
    yield JobService(
        env.settings, make_session_factory(engine), BlobStore(env.settings.resolved_data_dir), None
    )
    engine.dispose()


def line(custom_id: str) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": PARKED_MODEL, "messages": [{"role": "user", "content": f"hi {custom_id}"}]},
    }


def submit_batch(batches: BatchService) -> tuple[str, str]:
    """(batch id, job id) of a batch of ANSWERS' lines and one refused line (an unknown endpoint)."""
    lines = [line("a0"), {**line("bad"), "url": "/v1/embeddings"}, line("a1"), line("a2")]
    data = b"".join(json.dumps(item).encode() + b"\n" for item in lines)
    uploaded = batches.upload(TENANT, io.BytesIO(data), "in.jsonl", "batch")
    batch = batches.create(
        TENANT,
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={},
    )
    with batches.sessions() as session:
        return batch.id, openai_store.get_batch(session, batch.id, TENANT).job_id


def run_shards(jobs: JobService, job_id: str) -> None:
    """Every shard claimed, its rows stored and the shard finished, then the job moved to finalizing."""
    custom_ids = list(ANSWERS)  # the good lines, in line order, are the job's rows
    with jobs.sessions() as session:
        for shard in shards_of(session, job_id):
            claim_shard(session, job_id, shard.shard_index, "w", lease_seconds=60)
            rows = [
                {
                    "job_id": job_id, "shard_index": shard.shard_index, "row_index": index,
                    "custom_id": custom_ids[index], "output_text": f"answer {index}", "prompt_tokens": 3,
                    "output_tokens": 2, "finish_reason": ANSWERS[custom_ids[index]],
                    "error": "boom" if ANSWERS[custom_ids[index]] == "error" else None,
                }
                for index in shard.row_indices
            ]  # fmt: skip
            insert_results(session, rows)
            finish_shard(session, job_id, shard.shard_index, "w", ShardStatus.DONE, None)
        assert job_store.mark_finalizing(session, job_id)


class Writes:
    """Every statement the database is sent that is not a SELECT, and every file of the blob folder."""

    def __init__(self, jobs: JobService) -> None:
        self.engine = jobs.sessions.kw["bind"]
        self.root = Path(jobs.settings.resolved_data_dir)
        self.statements: list[str] = []

    def _seen(self, conn, cursor, statement: str, *args: Any) -> None:
        if not statement.lstrip().upper().startswith("SELECT"):
            self.statements.append(statement)

    def files(self) -> dict[str, tuple[int, int]]:
        return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in self.root.rglob("*") if p.is_file()}

    def during(self, action) -> tuple[list[str], bool]:
        """(the write statements `action` sent, whether it changed any file)."""
        before = self.files()
        event.listen(self.engine, "before_cursor_execute", self._seen)
        try:
            action()
        finally:
            event.remove(self.engine, "before_cursor_execute", self._seen)
        return self.statements, self.files() != before


def read_file(batches: BatchService, file_id: str) -> list[dict[str, Any]]:
    with batches.sessions() as session:
        name = openai_store.get_file(session, file_id, TENANT).blob_name
    return [json.loads(text) for text in batches.blobs.read_text(name).splitlines()]


def test_the_files_exist_once_the_job_is_final_and_a_get_writes_nothing(jobs: JobService) -> None:
    batches = BatchService(jobs)
    batch_id, job_id = submit_batch(batches)
    assert batches.get(TENANT, batch_id).output_file_id is None  # running: no files yet
    run_shards(jobs, job_id)
    ctx = WorkerContext(settings=jobs.settings, sessions=jobs.sessions, blobs=jobs.blobs)
    assert finalize.finalize_job(ctx, job_id) == "completed"

    # The finalize wrote and recorded them: before anyone reads the batch.
    with jobs.sessions() as session:
        row = openai_store.get_batch(session, batch_id, TENANT)
        assert row.outputs_ready and row.output_file_id and row.error_file_id
        output_file_id, error_file_id = row.output_file_id, row.error_file_id
    assert [item["custom_id"] for item in read_file(batches, output_file_id)] == ["a0", "a2"]
    assert [item["custom_id"] for item in read_file(batches, error_file_id)] == ["bad", "a1"]

    writes = Writes(jobs)
    views: list[dict[str, Any]] = []
    statements, files_changed = writes.during(
        lambda: views.extend([batches.get(TENANT, batch_id), *batches.list(TENANT, None, 100).data])
    )
    assert statements == [] and not files_changed
    shown = [view for view in views if view.id == batch_id]
    assert len(shown) == 2 and all(view.status == "completed" for view in shown)
    assert all((v.output_file_id, v.error_file_id) == (output_file_id, error_file_id) for v in shown)


def test_a_batch_whose_worker_died_before_its_files_is_finalizing_until_the_sweep_writes_them(
    jobs: JobService, env: ServiceEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = BatchService(jobs)
    batch_id, job_id = submit_batch(batches)
    run_shards(jobs, job_id)
    monkeypatch.setattr(finalize, "write_batch_files", lambda ctx, job_id: None)  # died after the move
    ctx = WorkerContext(settings=jobs.settings, sessions=jobs.sessions, blobs=jobs.blobs)
    assert finalize.finalize_job(ctx, job_id) == "completed"
    monkeypatch.undo()

    views: list[dict[str, Any]] = []
    statements, files_changed = Writes(jobs).during(lambda: views.append(batches.get(TENANT, batch_id)))
    assert statements == [] and not files_changed  # the read does not write them either
    assert views[0].status == "finalizing" and views[0].output_file_id is None

    dispatcher = CeleryDispatcher(env.settings)
    recovery = Recovery(env.settings, jobs.sessions, jobs.blobs, dispatcher)
    try:
        # A job final for less than a sweep may have its worker writing the files still: left alone.
        assert batch_id not in recovery.sweep().batch_files_written
        with jobs.sessions() as session:
            finished = job_store.get_job(session, job_id).finished_at
            session.execute(
                update(Job).where(Job.id == job_id).values(finished_at=finished - timedelta(hours=1))
            )
            session.commit()
        assert batch_id in recovery.sweep().batch_files_written
        assert batch_id not in recovery.sweep().batch_files_written  # once
    finally:
        recovery.close()
        dispatcher.app.close()
    done = batches.get(TENANT, batch_id)
    assert done.status == "completed"
    assert [item["custom_id"] for item in read_file(batches, done.output_file_id)] == ["a0", "a2"]
