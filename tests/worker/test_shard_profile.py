"""A shard that finishes adds its measured work to its model's throughput profile, through the worker's
own finish path (worker/shard/attempt.py: Attempt.finish) on Postgres. The engine is not run: the stats
are what the executor would pass (engine_stats.shard_stats), so the test costs no model load."""

from __future__ import annotations

import io
import secrets

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.domain.schemas import JobParams
from jobs.domain.service import JobService
from storage.profile_store import profiles_of
from storage.shard_store import Claim, claim_shard
from storage.status import ShardStatus
from tests.worker.contexts import worker_context
from worker.attempt_meter import AttemptMeter
from worker.shard.attempt import Attempt
from worker.shard.context import WorkerContext


def submitted(ctx: WorkerContext, model: str, rows: int, **params) -> str:
    sink = io.BytesIO()
    pq.write_table(pa.table({"prompt": [f"row {i}" for i in range(rows)]}), sink)
    service = JobService(ctx.settings, ctx.sessions, ctx.blobs, dispatcher=None, allow_any_model=True)
    return service.submit("profile-tests", io.BytesIO(sink.getvalue()), JobParams(model=model, **params)).id


def claimed(ctx: WorkerContext, job_id: str, owner: str) -> Attempt:
    with ctx.sessions() as session:
        assert claim_shard(session, job_id, 0, owner, 60) == Claim.CLAIMED
        attempt = Attempt(ctx, AttemptMeter(), job_id, 0, owner)
        attempt.meter.start(session, job_id=job_id, shard_index=0, owner=owner)
    return attempt


def stats(rows_run: int, prompt: int, output: int, seconds: float, tier: str = "avx2") -> dict:
    engine = {"prompt_tokens": prompt, "output_tokens": output, "busy_seconds": seconds, "tier": tier}
    return {"engine": engine, "timeline": [], "rows": rows_run, "rows_run": rows_run}


def test_a_done_shard_adds_to_its_profile_and_a_cancelled_one_does_not(
    pg_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = f"profile-model-{secrets.token_hex(4)}"
    with worker_context(pg_url, tmp_path_factory) as ctx:
        done = claimed(ctx, submitted(ctx, model, 3, max_tokens=16), "host:1:1")
        with ctx.sessions() as session:
            done.finish(session, ShardStatus.DONE, stats(3, 120, 30, 1.5))
        cancelled = claimed(ctx, submitted(ctx, model, 2, max_tokens=16), "host:1:1")
        with ctx.sessions() as session:
            cancelled.finish(session, ShardStatus.CANCELLED, stats(2, 50, 5, 0.5))
            [row] = profiles_of(session, model=model)
        assert (row.worker_class, row.shards, row.rows) == ("avx2", 1, 3)
        assert (row.prompt_tokens, row.output_tokens, row.busy_seconds) == (120, 30, 1.5)
        assert (row.capped_output_tokens, row.capped_max_tokens) == (30, 3 * 16)


def test_a_lost_lease_adds_nothing_and_the_setting_names_the_class(
    pg_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = f"profile-model-{secrets.token_hex(4)}"
    with worker_context(pg_url, tmp_path_factory, worker_class="h100") as ctx:
        job_id = submitted(ctx, model, 2, max_tokens=8)
        attempt = claimed(ctx, job_id, "host:1:1")
        # Another worker holds the shard now (its lease was taken over): this attempt's finish is lost.
        attempt.owner = "host:2:1"
        with ctx.sessions() as session:
            attempt.finish(session, ShardStatus.DONE, stats(2, 40, 16, 0.8, tier="cuda"))
            assert profiles_of(session, model=model) == []
        attempt.owner = "host:1:1"
        with ctx.sessions() as session:
            attempt.finish(session, ShardStatus.DONE, stats(2, 40, 16, 0.8, tier="cuda"))
            assert [(row.worker_class, row.shards) for row in profiles_of(session, model=model)] == [
                ("h100", 1)
            ]


def test_a_shard_run_on_the_engine_lands_in_its_profile(
    pg_url: str, tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir
) -> None:
    """The whole path once, on the tiny model: the executor runs the shard, its finish adds the engine's
    own counters (and tier) to the profile of the job's model."""
    from worker.llm_pool import LLMPool
    from worker.shard.executor import run_shard

    model = str(tiny_llama_dir)
    with worker_context(pg_url, tmp_path_factory) as ctx:
        with ctx.sessions() as session:
            before = {row.worker_class: row.shards for row in profiles_of(session, model=model)}
        job_id = submitted(ctx, model, 3, max_tokens=4)
        outcome = run_shard(ctx, LLMPool(ctx.settings), job_id, 0)
        assert outcome.status == ShardStatus.DONE
        with ctx.sessions() as session:
            rows = profiles_of(session, model=model)
    grown = [row for row in rows if row.shards == before.get(row.worker_class, 0) + 1]
    assert len(grown) == 1 and grown[0].worker_class not in ("", "unknown")
    assert grown[0].busy_seconds > 0 and grown[0].prompt_tokens > 0 and grown[0].output_tokens > 0
