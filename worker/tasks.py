"""Celery tasks: run one shard (then, if it was the last, hand the job to finalize) and finalize a
job. Task names and arguments (job id, shard index) identify the work in Flower."""

from __future__ import annotations

import json
import logging

from celery import Celery, Task

from jobs.broker import TASK_FINALIZE_JOB, TASK_RUN_SHARD
from worker.finalize import finalize_job
from worker.llm_pool import LLMPool
from worker.result_writer import ShardProgress
from worker.shard_runner import ShardRetry, WorkerContext, run_shard

log = logging.getLogger(__name__)
RETRY_DELAY_S = 2


def register_tasks(app: Celery, ctx: WorkerContext, pool: LLMPool) -> None:
    @app.task(name=TASK_RUN_SHARD, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None)
    def run_shard_task(self: Task, job_id: str, shard_index: int) -> dict:
        def progress(update: ShardProgress) -> None:
            # A custom task event: Flower shows the task in state PROGRESS with this as its result.
            fields = update.as_dict()
            self.send_event("task-progress", result=json.dumps(fields), **fields)

        try:
            outcome = run_shard(ctx, pool, job_id, shard_index, on_progress=progress)
        except ShardRetry as exc:
            # run_shard counts attempts in the database and stops retrying after shard_max_attempts.
            raise self.retry(exc=exc, countdown=RETRY_DELAY_S) from exc
        if outcome.ready_to_finalize:
            # Sent before this task is acknowledged: if the worker dies first, the redelivered
            # shard finds the job finalizing and sends it again (finalize is idempotent).
            app.send_task(TASK_FINALIZE_JOB, args=[job_id])  # the default queue is this model's queue
        return outcome.as_dict()

    @app.task(name=TASK_FINALIZE_JOB, acks_late=True, reject_on_worker_lost=True)
    def finalize_job_task(job_id: str) -> dict:
        return {"job_id": job_id, "status": finalize_job(ctx, job_id)}
