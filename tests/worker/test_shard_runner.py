"""The shard runner in-process, on real Postgres with the real engine (tiny model): resuming from
stored rows, taking over a lapsed lease, backing off a held one, cancellation, repeated failure, and
the cost of every attempt counted in the job's metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import update

from jobs.domain.schemas import JobParams
from jobs.domain.service import JobService
from storage import job_store
from storage.attempt_store import attempts_of
from storage.blobs import results_name
from storage.models import Job
from storage.result_store import insert_results
from storage.shard_store import Claim, claim_shard, get_shard
from storage.status import JobStatus, ShardStatus
from tests.worker.contexts import worker_context
from worker.engine.parameters import parameter_counts
from worker.engine_stats import COUNTERS
from worker.finalize import finalize_job
from worker.llm_pool import LLMPool
from worker.result_writer import ShardProgress
from worker.retry import ShardRetry
from worker.shard.context import WorkerContext
from worker.shard.executor import run_shard

TENANT = "runner-tests"


@pytest.fixture(scope="module")
def ctx(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerContext]:  # noqa: F811
    with worker_context(pg_url, tmp_path_factory, cancel_poll_seconds=0.2, shard_max_attempts=2) as context:
        yield context


@pytest.fixture(scope="module")
def pool(ctx: WorkerContext) -> LLMPool:
    return LLMPool(ctx.settings)


def submit(
    ctx: WorkerContext,
    tmp_path: Path,
    rows: int,
    model: Path,
    row_max_tokens: list[int] | None = None,
    **params,
) -> str:
    source = tmp_path / "input.parquet"
    columns = {
        "custom_id": [f"c{i}" for i in range(rows)],
        "prompt": [f"row {i} " * (i + 1) for i in range(rows)],
    }
    if row_max_tokens is not None:
        columns["max_tokens"] = pa.array(row_max_tokens, pa.int64())
    pq.write_table(pa.table(columns), source)
    service = JobService(ctx.settings, ctx.sessions, ctx.blobs, dispatcher=None, allow_any_model=True)
    with open(source, "rb") as upload:
        return service.submit(TENANT, upload, JobParams(model=str(model), **params)).id


def results(ctx: WorkerContext, job_id: str) -> list[dict]:
    return pq.read_table(ctx.blobs.path(results_name(job_id))).to_pylist()


def test_a_rerun_shard_keeps_stored_rows_and_takes_over_a_lapsed_lease(
    ctx: WorkerContext, pool: LLMPool, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    job_id = submit(ctx, tmp_path, 6, tiny_llama_dir, max_tokens=4)
    with ctx.sessions() as session:
        # A worker claimed the shard, stored two rows, and died: its lease runs out.
        assert claim_shard(session, job_id, 0, "dead-worker", lease_seconds=0.05) == Claim.CLAIMED
        earlier = {
            "output_text": "stored earlier",
            "prompt_tokens": 1,
            "output_tokens": 1,
            "finish_reason": "stop",
        }
        insert_results(
            session,
            [
                {
                    "job_id": job_id,
                    "shard_index": 0,
                    "row_index": i,
                    "custom_id": f"c{i}",
                    "error": None,
                    **earlier,
                }
                for i in (1, 4)
            ],
        )
    time.sleep(0.1)
    outcome = run_shard(ctx, pool, job_id, 0)
    assert (outcome.claim, outcome.status, outcome.rows_written) == ("claimed", ShardStatus.DONE, 4)
    assert outcome.ready_to_finalize
    assert finalize_job(ctx, job_id) == JobStatus.COMPLETED
    rows = results(ctx, job_id)
    assert [r["custom_id"] for r in rows] == [f"c{i}" for i in range(6)]
    assert [r["output_text"] == "stored earlier" for r in rows] == [False, True, False, False, True, False]
    with ctx.sessions() as session:
        shard = get_shard(session, job_id, 0)
        assert shard.attempts == 2 and shard.stats["rows_run"] == 4
        assert shard.stats["engine"]["steps"] > 0 and shard.stats["engine"]["busy_seconds"] > 0
    # Running the finished shard again does nothing, and finalize again changes nothing.
    assert run_shard(ctx, pool, job_id, 0).claim == "finished"
    assert finalize_job(ctx, job_id) == JobStatus.COMPLETED
    with ctx.sessions() as session:
        assert [e.status for e in job_store.events(session, job_id)].count(JobStatus.COMPLETED) == 1


def test_a_shard_held_by_a_live_worker_is_left_alone(
    ctx: WorkerContext, pool: LLMPool, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    job_id = submit(ctx, tmp_path, 3, tiny_llama_dir, max_tokens=2)
    with ctx.sessions() as session:
        claim_shard(session, job_id, 0, "busy-worker", lease_seconds=300)
    outcome = run_shard(ctx, pool, job_id, 0)
    assert (outcome.claim, outcome.status, outcome.rows_written, outcome.ready_to_finalize) == (
        "held",
        None,
        0,
        False,
    )


def test_cancel_stops_a_running_shard_between_engine_steps(
    ctx: WorkerContext, pool: LLMPool, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    job_id = submit(ctx, tmp_path, 8, tiny_llama_dir, max_tokens=400)
    progress: list[int] = []
    outcome_box: list = []
    runner = threading.Thread(
        target=lambda: outcome_box.append(
            run_shard(ctx, pool, job_id, 0, on_progress=lambda p: progress.append(p.rows_done))
        )
    )
    runner.start()
    deadline = time.monotonic() + 60
    with ctx.sessions() as session:
        while job_store.job_status(session, job_id) != JobStatus.IN_PROGRESS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job_store.request_cancel(session, job_id)
    cancelled_at = time.monotonic()
    runner.join(60)
    assert time.monotonic() - cancelled_at < 5
    outcome = outcome_box[0]
    assert outcome.status == ShardStatus.CANCELLED and outcome.ready_to_finalize
    assert finalize_job(ctx, job_id) == JobStatus.CANCELLED
    rows = results(ctx, job_id)
    assert len(rows) == 8 and [r["custom_id"] for r in rows] == [f"c{i}" for i in range(8)]
    cancelled = [r for r in rows if r["finish_reason"] == "cancelled"]
    assert cancelled and all(r["output_text"] == "" for r in cancelled)
    with ctx.sessions() as session:
        statuses = [e.status for e in job_store.events(session, job_id)]
        job = job_store.get_job(session, job_id)
    assert statuses[-3:] == [JobStatus.CANCELLING, JobStatus.FINALIZING, JobStatus.CANCELLED]
    assert job.metrics["rows_cancelled"] == len(cancelled)
    with ctx.sessions() as session:
        assert [a.outcome for a in attempts_of(session, job_id=job_id)] == ["cancelled"]


def test_a_shard_that_keeps_failing_ends_as_error_rows(
    ctx: WorkerContext, pool: LLMPool, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    job_id = submit(ctx, tmp_path, 3, tiny_llama_dir, max_tokens=2)
    with ctx.sessions() as session:
        # Parameters no engine accepts: every attempt at this shard raises.
        job = job_store.get_job(session, job_id)
        session.execute(update(Job).where(Job.id == job_id).values(params={**job.params, "top_k": -1}))
        session.commit()
    with pytest.raises(ShardRetry):
        run_shard(ctx, pool, job_id, 0)
    outcome = run_shard(ctx, pool, job_id, 0)  # the second attempt is the last (shard_max_attempts=2)
    assert outcome.status == ShardStatus.FAILED and outcome.ready_to_finalize
    assert finalize_job(ctx, job_id) == JobStatus.COMPLETED
    rows = results(ctx, job_id)
    assert [r["custom_id"] for r in rows] == ["c0", "c1", "c2"]
    assert all(r["finish_reason"] == "error" and "top_k" in r["error"] for r in rows)
    with ctx.sessions() as session:
        assert [a.outcome for a in attempts_of(session, job_id=job_id)] == ["retry", "failed"]


class ProgressSinkDown(Exception):
    """The progress sink failed: raised from the shard's progress callback, so the attempt fails."""


def test_the_cost_of_a_failed_attempt_stays_in_the_job_metrics(
    ctx: WorkerContext, pool: LLMPool, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    # The two shortest rows finish first; the failure comes with their insert, mid-stream.
    job_id = submit(ctx, tmp_path, 8, tiny_llama_dir, row_max_tokens=[2, 3] + [40] * 6, max_tokens=8)

    def fail_once_rows_are_stored(update: ShardProgress) -> None:
        # Called right after a result insert: the engine has run at least those rows by now.
        if update.rows_done >= 2:
            raise ProgressSinkDown(f"after {update.rows_done} rows")

    with pytest.raises(ShardRetry, match="ProgressSinkDown"):
        run_shard(ctx, pool, job_id, 0, on_progress=fail_once_rows_are_stored)
    # The failed attempt's requests left the engine with it (its stream was closed, not left to the
    # garbage collector, which would abort them later in the middle of whichever shard runs then).
    assert not pool.loaded.engine.has_unfinished()
    outcome = run_shard(ctx, pool, job_id, 0)
    assert outcome.status == ShardStatus.DONE and 0 < outcome.rows_written < 8
    assert finalize_job(ctx, job_id) == JobStatus.COMPLETED

    with ctx.sessions() as session:
        failed, finished = attempts_of(session, job_id=job_id, shard_index=0)
        shard = get_shard(session, job_id, 0)
        metrics = job_store.get_job(session, job_id).metrics
    assert (failed.outcome, finished.outcome) == ("retry", "done")
    assert failed.owner == finished.owner == ctx.owner()
    assert failed.counters["computed_tokens"] > 0 and failed.counters["busy_seconds"] > 0
    # The finishing attempt's counters are the shard's own stats: those alone miss the failed one.
    engine = shard.stats["engine"]
    assert {name: finished.counters[name] for name in COUNTERS} == {name: engine[name] for name in COUNTERS}
    spent = {name: failed.counters[name] + finished.counters[name] for name in COUNTERS}
    assert metrics["computed_tokens"] == spent["computed_tokens"] > engine["computed_tokens"]
    assert metrics["padding_tokens"] == spent["padding_tokens"]
    assert metrics["preemptions"] == spent["preemptions"]
    assert metrics["device_seconds"] == pytest.approx(spent["busy_seconds"], abs=1e-4)
    assert metrics["device_seconds"] > engine["busy_seconds"]
    assert metrics["mean_batch_size"] == round(spent["batch_size_sum"] / spent["steps"], 2)
    # the FLOPs follow every attempt's tokens, at the model's active parameters (a dense model: all of them)
    counts = parameter_counts(pool.loaded.engine.model_config)
    assert metrics["model_parameters"] == engine["parameters"] == counts.total == metrics["active_parameters"]
    run_tokens = spent["computed_tokens"] + spent["draft_tokens"] - spent["accepted_draft_tokens"]
    assert metrics["model_flops"] == 2 * counts.active * run_tokens > 0
