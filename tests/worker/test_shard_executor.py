"""The shard executor (worker/shard/) on both databases it runs on: SQLite (`freight run`) and
Postgres (the service), and with the service's job files in an S3 bucket (SeaweedFS): submit, shard
and finalize then read and write every job file through the object store. Both kinds of shard write the one result record, take the row's override
columns through the one sampling mapping, and turn a row without a prompt into an error record."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.domain.results import RESULTS_SCHEMA
from jobs.domain.sample_docs import sample_docs_table
from jobs.domain.schemas import JobParams
from jobs.domain.service import JobService
from storage.arrow_path import parquet_file
from storage.blobs import results_name
from storage.db import upgrade
from storage.status import JobStatus, ShardStatus
from tests.s3_server import S3Server
from tests.worker.contexts import worker_context
from worker.finalize import finalize_job
from worker.llm_pool import LLMPool
from worker.shard.context import WorkerContext
from worker.shard.executor import run_shard

TENANT = "executor-tests"


@pytest.fixture(scope="module", params=["sqlite", "postgres", "postgres-s3"])
def ctx(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerContext]:
    storage: dict[str, str] = {}
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'freight.db'}"
        upgrade(url)
    else:
        url = request.getfixturevalue("pg_url")
    if request.param == "postgres-s3":
        server: S3Server = request.getfixturevalue("s3_server")
        storage = {"storage_url": server.url("executor-tests"), "s3_endpoint_url": server.endpoint_url}
    with worker_context(url, tmp_path_factory, **storage) as context:
        assert context.blobs.is_local == (request.param != "postgres-s3")
        yield context


@pytest.fixture(scope="module")
def pools() -> dict[str, LLMPool]:
    return {}


@pytest.fixture
def pool(ctx: WorkerContext, pools: dict[str, LLMPool]) -> LLMPool:
    """One engine for both databases (loading it is the slow part)."""
    if "pool" not in pools:
        pools["pool"] = LLMPool(ctx.settings)
    return pools["pool"]


def run_job(ctx: WorkerContext, pool: LLMPool, source: Path, params: JobParams) -> list[dict]:
    service = JobService(ctx.settings, ctx.sessions, ctx.blobs, dispatcher=None, allow_any_model=True)
    with open(source, "rb") as upload:
        job_id = service.submit(TENANT, upload, params).id
    outcome = run_shard(ctx, pool, job_id, 0)
    assert outcome.status == ShardStatus.DONE and outcome.ready_to_finalize
    assert finalize_job(ctx, job_id) == JobStatus.COMPLETED
    table = parquet_file(ctx.blobs.arrow(results_name(job_id))).read()
    assert table.schema.names[: len(RESULTS_SCHEMA)] == RESULTS_SCHEMA.names
    return table.to_pylist()


def test_a_plain_shard_honours_row_overrides_and_writes_error_records(
    ctx: WorkerContext, pool: LLMPool, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "input.parquet"
    table = pa.table(
        {
            "custom_id": ["a", "b", "c"],
            "prompt": ["Once upon a time", None, "The quick brown fox"],
            "max_tokens": pa.array([2, None, 5], pa.int64()),
        }
    )
    pq.write_table(table, source)
    rows = run_job(ctx, pool, source, JobParams(model=str(tiny_llama_dir), max_tokens=8, temperature=0.0))
    assert [row["custom_id"] for row in rows] == ["a", "b", "c"]
    assert rows[1]["finish_reason"] == "error" and rows[1]["error"] and rows[1]["output_tokens"] == 0
    assert 1 <= rows[0]["output_tokens"] <= 2 and 1 <= rows[2]["output_tokens"] <= 5
    assert all(row["prompt_tokens"] > 0 for row in (rows[0], rows[2]))


def test_a_summarize_shard_takes_the_row_max_tokens_for_its_summary(
    ctx: WorkerContext, pool: LLMPool, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    docs = {row["custom_id"]: row["text"] for row in sample_docs_table().to_pylist()}
    source = tmp_path / "docs.parquet"
    table = pa.table(
        {
            "custom_id": ["short", "empty"],
            "text": [docs["bees"], "  "],
            "max_tokens": pa.array([3, None], pa.int64()),
        }
    )
    pq.write_table(table, source)
    params = JobParams(model=str(tiny_llama_dir), task="summarize", max_tokens=8)
    rows = run_job(ctx, pool, source, params)
    assert [row["custom_id"] for row in rows] == ["short", "empty"]
    assert rows[0]["finish_reason"] in ("stop", "length") and 1 <= rows[0]["output_tokens"] <= 3
    assert rows[1]["finish_reason"] == "error" and rows[1]["error"] == "the document is empty"
    assert rows[0]["windows"] == 1 and rows[1]["windows"] == 0
