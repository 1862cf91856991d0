"""A summarize shard in-process, on real Postgres with the real engine (tiny model, 512-token context):
a long document's windows are stored as parts as they finish, and a shard redelivered after its worker
died runs only the parts and rows it lacks, then writes exactly one summary row per document."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import select

from jobs.domain.sample_docs import sample_docs_table
from jobs.domain.schemas import JobParams
from jobs.domain.service import JobService
from storage.blobs import results_name
from storage.models import SummaryPart
from storage.result_store import insert_results
from storage.shard_store import Claim, claim_shard, get_shard
from storage.status import JobStatus, ShardStatus
from storage.summary_store import insert_parts
from tests.worker.contexts import worker_context
from worker.finalize import finalize_job
from worker.llm_pool import LLMPool
from worker.shard.context import WorkerContext
from worker.shard.executor import run_shard

TENANT = "summarize-tests"
LONG_TIME_AGO = datetime(2020, 1, 1, tzinfo=UTC)


@pytest.fixture(scope="module")
def ctx(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerContext]:  # noqa: F811
    with worker_context(pg_url, tmp_path_factory) as context:
        yield context


@pytest.fixture(scope="module")
def pool(ctx: WorkerContext) -> LLMPool:
    return LLMPool(ctx.settings)


def submit(ctx: WorkerContext, tmp_path: Path, model: Path) -> str:
    docs = {row["custom_id"]: row["text"] for row in sample_docs_table().to_pylist()}
    source = tmp_path / "docs.parquet"
    pq.write_table(
        pa.table({"custom_id": ["short", "long"], "text": [docs["bees"], docs["harbour-almanac"]]}), source
    )
    service = JobService(ctx.settings, ctx.sessions, ctx.blobs, dispatcher=None, allow_any_model=True)
    with open(source, "rb") as upload:
        params = JobParams(model=str(model), task="summarize", max_tokens=8)
        return service.submit(TENANT, upload, params).id


def parts(ctx: WorkerContext, job_id: str) -> dict[tuple[int, int], SummaryPart]:
    with ctx.sessions() as session:
        stored = session.scalars(
            select(SummaryPart).where(SummaryPart.job_id == job_id, SummaryPart.row_index == 1)
        )
        return {(part.level, part.part_index): part for part in stored}


def results(ctx: WorkerContext, job_id: str) -> list[dict]:
    return pq.read_table(ctx.blobs.path(results_name(job_id))).to_pylist()


def test_a_redelivered_summarize_shard_runs_only_the_parts_it_lacks(
    ctx: WorkerContext, pool: LLMPool, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    # A first job runs straight through: the reference.
    reference_id = submit(ctx, tmp_path, tiny_llama_dir)
    outcome = run_shard(ctx, pool, reference_id, 0)
    assert (outcome.status, outcome.rows_written, outcome.ready_to_finalize) == (ShardStatus.DONE, 2, True)
    assert finalize_job(ctx, reference_id) == JobStatus.COMPLETED
    reference = results(ctx, reference_id)
    reference_parts = parts(ctx, reference_id)
    windows = [key for key in reference_parts if key[0] == 0]
    assert [row["windows"] for row in reference] == [1, len(windows)] and len(windows) >= 5
    assert reference[1]["output_tokens"] == sum(p.output_tokens for p in reference_parts.values()) + 8

    # The same job again; a worker ran half of it and died: the short document's row and the first
    # two windows are stored, its lease runs out.
    job_id = submit(ctx, tmp_path, tiny_llama_dir)
    with ctx.sessions() as session:
        assert claim_shard(session, job_id, 0, "dead-worker", lease_seconds=0.05) == Claim.CLAIMED
        insert_results(session, [{"job_id": job_id, "shard_index": 0, **_without_extras(reference[0])}])
        insert_parts(
            session,
            [
                {
                    "job_id": job_id,
                    "row_index": 1,
                    "level": 0,
                    "part_index": index,
                    "text": reference_parts[(0, index)].text,
                    "prompt_tokens": 1,  # marks these parts: a recomputed part would count its real tokens
                    "output_tokens": 1,
                    "shard_index": 0,
                    "finished_at": LONG_TIME_AGO,
                }
                for index in (0, 1)
            ],
        )
    time.sleep(0.1)
    outcome = run_shard(ctx, pool, job_id, 0)
    assert (outcome.claim, outcome.status, outcome.rows_written) == ("claimed", ShardStatus.DONE, 1)
    assert finalize_job(ctx, job_id) == JobStatus.COMPLETED

    resumed_parts = parts(ctx, job_id)
    assert set(resumed_parts) == set(reference_parts)
    for index in (0, 1):
        kept = resumed_parts[(0, index)]
        assert (kept.prompt_tokens, kept.output_tokens, kept.finished_at) == (1, 1, LONG_TIME_AGO)
    for key in set(reference_parts) - {(0, 0), (0, 1)}:
        assert resumed_parts[key].finished_at > LONG_TIME_AGO
    with ctx.sessions() as session:
        shard = get_shard(session, job_id, 0)
        assert shard.attempts == 2 and shard.stats["rows_run"] == 1  # only the long document ran
    rows = results(ctx, job_id)
    assert [row["custom_id"] for row in rows] == ["short", "long"]
    assert rows[0] == reference[0]
    # Same windows (greedy), so the same summary; the row counts the stored parts' (marked) tokens.
    assert rows[1]["summary"] == reference[1]["summary"] and rows[1]["windows"] == len(windows)
    skipped = sum(reference_parts[(0, i)].output_tokens for i in (0, 1))
    assert rows[1]["output_tokens"] == reference[1]["output_tokens"] - skipped + 2


def _without_extras(row: dict) -> dict:
    """A result row as stored (the summarize output adds summary and windows)."""
    return {key: value for key, value in row.items() if key not in ("summary", "windows")}
