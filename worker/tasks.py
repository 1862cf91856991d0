"""Celery tasks: run one shard (then, if it was the last, hand the job to finalize) and finalize a
job. Task names and arguments (job id, shard index) identify the work in Flower."""

from __future__ import annotations

import json
import logging

from celery import Celery, Task
from celery.exceptions import Reject

from jobs.domain.broker import TASK_FINALIZE_JOB, TASK_RUN_SHARD, CeleryDispatcher
from storage.shard_store import Claim
from worker.finalize import finalize_job
from worker.llm_pool import LLMPool
from worker.prometheus import WorkerMetrics
from worker.result_writer import ShardProgress
from worker.retry import RetryPolicy, ShardRetry
from worker.shard.context import WorkerContext
from worker.shard.executor import run_next_shard

log = logging.getLogger(__name__)


def register_tasks(
    app: Celery, ctx: WorkerContext, pool: LLMPool, metrics: WorkerMetrics | None = None
) -> None:
    policy = RetryPolicy.from_settings(ctx.settings)
    dispatcher = CeleryDispatcher(ctx.settings, app=app)

    @app.task(name=TASK_RUN_SHARD, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None)
    def run_shard_task(
        self: Task,
        job_id: str,
        shard_index: int,
        tenant: str | None = None,
        priority: str | None = None,
        deadline: str | None = None,
    ) -> dict:
        # tenant, priority, deadline: the message's job's schedule, for Flower's task page only
        # (jobs.domain.broker.TaskLabels); the shard run is the best free one, named in the result.
        last_progress: dict = {}  # the final numbers also go into the task's result (Flower keeps that)

        def progress(update: ShardProgress) -> None:
            # A custom task event: Flower shows the task in state PROGRESS with this as its result.
            fields = update.as_dict()
            last_progress.update(fields)
            if metrics is not None:
                metrics.observe_progress(update)
            try:
                # Best effort and never blocking: a broker outage must not stall or fail the shard.
                self.send_event("task-progress", retry=False, result=json.dumps(fields), **fields)
            except Exception as exc:
                log.debug("progress event not sent: %s", exc)

        try:
            # The message is a ticket: the shard run may be another job's (docs/scheduling.md).
            outcome = run_next_shard(ctx, pool, job_id, shard_index, on_progress=progress)
        except ShardRetry as exc:
            # run_shard counts attempts in the database and stops retrying after shard_max_attempts.
            raise self.retry(exc=exc, countdown=policy.shard_delay_s) from exc
        except Exception as exc:
            # Not the shard's fault (say the database went away while recording a failure): keep the
            # task alive so the shard is not left without a message.
            log.exception("shard %d of %s could not be run; trying again", shard_index, job_id)
            raise self.retry(exc=exc, countdown=policy.infrastructure_delay_s) from exc
        if metrics is not None:
            ended = "handed_back" if outcome.handed_back else outcome.status or outcome.claim
            metrics.observe_shard_end(outcome.job_id, outcome.shard_index, str(ended), outcome.rows_written)
        if outcome.handed_back:
            # SIGTERM: back to the queue for another worker (Redis puts it at the head).
            raise Reject("worker shutting down", requeue=True)
        if outcome.claim == Claim.HELD:
            # Another worker holds a live lease (this is a redelivered or duplicated message). Look
            # again later: if that worker dies its lease lapses and this message takes the shard over;
            # if it finishes, the next look finds the shard finished.
            delay = policy.held_delay_s
            log.info(
                "shard %d of %s is held by another worker (or waits out its retry delay); looking again in %.0fs",
                shard_index,
                job_id,
                delay,
            )
            raise self.retry(countdown=delay)
        if outcome.ready_to_finalize:
            # Sent before this task is acknowledged: if the worker dies first, the redelivered
            # shard finds the job finalizing and sends it again (finalize is idempotent).
            dispatcher.dispatch_finalize(outcome.job_id)  # the default queue is this model's queue
            # Then finalize here at once: that message waits behind every shard ticket of the model
            # (docs/scheduling.md), so a job whose shards went first would otherwise wait for the others'
            # shards to be done. The message stays the safety net (finalize is idempotent).
            try:
                finalize_job(ctx, outcome.job_id)
            except Exception:
                log.warning(
                    "finalizing %s here failed; its finalize task tries again", outcome.job_id, exc_info=True
                )
        return {**last_progress, **outcome.as_dict()}

    @app.task(name=TASK_FINALIZE_JOB, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None)
    def finalize_job_task(self: Task, job_id: str) -> dict:
        try:
            return {"job_id": job_id, "status": finalize_job(ctx, job_id)}
        except Exception as exc:  # the database went away: the job stays finalizing until this runs
            log.exception("finalizing %s could not run; trying again", job_id)
            raise self.retry(exc=exc, countdown=policy.infrastructure_delay_s) from exc
