"""Run one shard: claim it, skip rows already stored, hand the rest to the shard's kind (plain,
summarize: worker.shard.kinds), which runs them on the engine (shortest first) and writes rows as they
finish; record the shard's engine stats, and say whether the job is ready to finalize. Each run is an
attempt (a shard_attempts row) that keeps the engine counters it spent however it ends, so the job's
cost counts failed and interrupted runs too. The Celery task and the embedded `freight run` both call
`run_shard`."""

from __future__ import annotations

from datetime import timedelta

from jobs.domain.prompts import resolve_source
from jobs.domain.schemas import OVERRIDE_COLUMNS, ResolvedParams
from jobs.domain.structured_spec import STRUCTURED_COLUMNS
from storage import job_store
from storage.input_set import input_schema
from storage.models import utcnow
from storage.result_store import stored_row_indices
from storage.shard_store import Claim, FairShare, claim_next_shard, claim_shard, get_shard
from storage.status import JobStatus, ShardStatus
from worker.attempt_meter import AttemptMeter
from worker.engine_stats import shard_stats
from worker.inputs import open_job_input, read_rows, shard_rows
from worker.llm_pool import LLMPool
from worker.result_writer import ProgressCallback, ResultWriter
from worker.shard.attempt import Attempt
from worker.shard.context import ShardHandedBack, ShardOutcome, WorkerContext
from worker.shard.kinds import kind_for
from worker.shard.lease import LeaseWatcher
from worker.shard.run import ShardRun


def run_next_shard(
    ctx: WorkerContext,
    pool: LLMPool,
    job_id: str,
    shard_index: int,
    on_progress: ProgressCallback | None = None,
) -> ShardOutcome:
    """A shard message is a ticket (docs/scheduling.md): run the best shard of its job's model that
    nobody runs (storage.shard_store.claim_next_shard), which may be another job's. When there is none,
    the message's own shard is claimed as `run_shard` does (held by a live lease: the task looks again
    later; finished: it only checks whether the job is ready to finalize)."""
    owner = ctx.owner()
    settings = ctx.settings
    with ctx.sessions() as session:
        job = job_store.get_job(session, job_id)
        claimed = None
        if job is not None:
            fair_share = None
            if settings.fair_share:
                since = utcnow() - timedelta(seconds=settings.fair_share_window_seconds)
                fair_share = FairShare(since=since, weights=dict(settings.tenant_weights))
            claimed = claim_next_shard(
                session,
                model=job.model,
                owner=owner,
                lease_seconds=settings.shard_lease_seconds,
                fair_share=fair_share,
            )
    if claimed is None:
        # Its own shard, unless that waits out a failed attempt's retry delay (then HELD: look again later).
        return run_shard(ctx, pool, job_id, shard_index, on_progress, wait_retry=True)
    return _run_claimed(ctx, pool, ShardOutcome(*claimed, Claim.CLAIMED.value), owner, on_progress)


def run_shard(
    ctx: WorkerContext,
    pool: LLMPool,
    job_id: str,
    shard_index: int,
    on_progress: ProgressCallback | None = None,
    *,
    wait_retry: bool = False,
) -> ShardOutcome:
    owner = ctx.owner()
    with ctx.sessions() as session:
        claim = claim_shard(
            session, job_id, shard_index, owner, ctx.settings.shard_lease_seconds, wait_retry=wait_retry
        )
    outcome = ShardOutcome(job_id, shard_index, claim.value)
    return _run_claimed(ctx, pool, outcome, owner, on_progress)


def _run_claimed(
    ctx: WorkerContext,
    pool: LLMPool,
    outcome: ShardOutcome,
    owner: str,
    on_progress: ProgressCallback | None,
) -> ShardOutcome:
    """Run the shard in `outcome` when it was claimed; finish the outcome either way."""
    job_id, shard_index, claim = outcome.job_id, outcome.shard_index, Claim(outcome.claim)
    if claim == Claim.FINISHED:
        outcome.ready_to_finalize = ready_to_finalize(ctx, job_id)
    if claim != Claim.CLAIMED:
        return outcome
    attempt = Attempt(ctx, AttemptMeter(), job_id, shard_index, owner)
    try:
        with ctx.sessions() as session:
            attempt.meter.start(session, job_id=job_id, shard_index=shard_index, owner=owner)
        with pool.lock:
            try:
                outcome.status, outcome.rows_written = _execute(attempt, pool, on_progress)
            finally:
                # Past the lock the engine's counters move for another shard: a failure recorded
                # below must not count that shard's work.
                attempt.meter.freeze()
    except ShardHandedBack as handed_back:
        outcome.handed_back, outcome.rows_written = True, handed_back.rows_written
        return outcome
    except Exception as exc:
        outcome.status = attempt.failed(exc)
    if outcome.status is not None:
        outcome.ready_to_finalize = ready_to_finalize(ctx, job_id)
    return outcome


def ready_to_finalize(ctx: WorkerContext, job_id: str) -> bool:
    """True when every shard is finished and the job is (now) finalizing (job_store.mark_finalizing)."""
    with ctx.sessions() as session:
        return job_store.mark_finalizing(session, job_id)


def _execute(attempt: Attempt, pool: LLMPool, on_progress: ProgressCallback | None) -> tuple[str | None, int]:
    ctx, meter, job_id, shard_index = attempt.ctx, attempt.meter, attempt.job_id, attempt.shard_index
    with ctx.sessions() as session:
        job = job_store.get_job(session, job_id)
        shard = get_shard(session, job_id, shard_index)
        if job.cancel_requested:
            attempt.finish(session, ShardStatus.CANCELLED, None)
            return ShardStatus.CANCELLED, 0
        job_store.move(session, job_id, to=JobStatus.IN_PROGRESS)
        rows = shard_rows(shard)
        stored = stored_row_indices(session, job_id, rows)
    params = ResolvedParams(**job.params)
    todo = [index for index in rows if index not in stored]
    writer = ResultWriter(
        ctx.settings,
        ctx.sessions,
        job_id=job_id,
        shard_index=shard_index,
        rows_total=len(rows),
        rows_done=len(stored),
        on_progress=on_progress,
        attempt=meter,
    )
    lease = LeaseWatcher(
        ctx.settings, ctx.sessions, job_id=job_id, shard_index=shard_index, owner=attempt.owner, attempt=meter
    )
    job_input = open_job_input(ctx.blobs, ctx.settings, job.input_name)
    schema = input_schema(job_input)
    source = resolve_source(schema, params.template, params.prompt_column, params.chat)
    extra = [name for name in (*OVERRIDE_COLUMNS, *STRUCTURED_COLUMNS, "custom_id") if name in schema.names]
    records = read_rows(job_input, todo, list(dict.fromkeys([*source.columns, *extra])))
    llm = pool.get(params)
    before = meter.watch(llm)
    writer.engine_tokens = lambda: int(llm.stats.computed_tokens - before.counters["computed_tokens"])

    def should_stop() -> bool:
        """Polled by the engine between steps: True ends the shard early."""
        if ctx.stopping.is_set():
            return True
        writer.tick()
        return lease.should_stop()

    run = ShardRun(
        sessions=ctx.sessions,
        job_id=job_id,
        tenant=job.tenant,
        shard_index=shard_index,
        chunk_rows=ctx.settings.result_chunk_rows,
        meter=meter,
        llm=llm,
        params=params,
        source=source,
        records=records,
        writer=writer,
        should_stop=should_stop,
        poll_seconds=min(0.5, ctx.settings.cancel_poll_seconds),
        result_cache_ttl_seconds=ctx.settings.result_cache_ttl_seconds,
    )
    rows_run = kind_for(params).run(run)
    writer.flush()
    rows_written = writer.rows_done - len(stored)
    if ctx.stopping.is_set() and not (lease.cancelled or lease.lease_lost) and rows_run > 0:
        attempt.hand_back(rows_written)
    if lease.lease_lost:
        attempt.lease_lost()
        return None, rows_written
    status = ShardStatus.CANCELLED if lease.cancelled else ShardStatus.DONE
    stats = shard_stats(before, llm.stats, ctx.settings.timeline_max_points)
    stats.update(rows=len(rows), rows_run=rows_run)
    with ctx.sessions() as session:
        attempt.finish(session, status, stats)
    return status, rows_written
