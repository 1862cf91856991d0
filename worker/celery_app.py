"""The Celery app a `freight worker` process runs: one queue (its model's), events on, prefetch 1,
late acks, and the model loaded once when the process starts (and recorded in the model registry)."""

from __future__ import annotations

import logging
import os
import socket

from celery import Celery, signals

from jobs.domain.broker import celery_config, queue_for_model
from jobs.domain.settings import Settings, blob_store
from storage.db import make_engine, make_session_factory
from worker.llm_pool import LLMPool
from worker.model_registry import ModelRegistry, UnservableModel
from worker.prometheus import WorkerMetrics
from worker.shard.context import WorkerContext
from worker.tasks import register_tasks

log = logging.getLogger(__name__)
POOLS = ("threads", "solo")


def make_worker_app(settings: Settings, model: str) -> tuple[Celery, LLMPool]:
    app = Celery("freight", set_as_current=True)
    app.conf.update(celery_config(settings))
    ctx = WorkerContext(
        settings=settings,
        sessions=make_session_factory(make_engine(settings.resolved_database_url)),
        blobs=blob_store(settings),
    )
    pool = LLMPool(settings, ModelRegistry(ctx.sessions))
    # SIGTERM: running shards hand back their unfinished rows instead of holding shutdown up.
    signals.worker_shutting_down.connect(lambda **_kwargs: ctx.stopping.set(), weak=False)
    metrics = WorkerMetrics(pool)
    register_tasks(app, ctx, pool, metrics)
    if settings.worker_metrics_port is not None:
        metrics.serve(settings.worker_metrics_port, settings.worker_metrics_host)
    app.conf.task_default_queue = queue_for_model(settings, model)
    return app, pool


def run_worker(
    settings: Settings,
    model: str,
    *,
    pool: str = "threads",
    concurrency: int = 1,
    loglevel: str = "INFO",
    hostname: str | None = None,
    preload: bool = True,
) -> None:
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}: the model is loaded once per process")
    app, llm_pool = make_worker_app(settings, model)
    if preload:
        # Load before consuming, so the first shard does not pay for it and a bad model fails fast.
        try:
            llm_pool.load(llm_pool.default_key(model))
        except UnservableModel as exc:
            # Recorded in the model registry: the API refuses new jobs for it. Staying up (rather than
            # exiting into a restart loop) fails the shards already queued, each with this error.
            log.error("%s; consuming its queue to fail the shards queued for it", exc)
    queue = queue_for_model(settings, model)
    name = hostname or f"freight-{os.getpid()}@{socket.gethostname()}"
    log.info("consuming %s as %s", queue, name)
    app.worker_main(
        [
            "worker",
            f"--queues={queue}",
            f"--pool={pool}",
            f"--concurrency={concurrency}",
            f"--loglevel={loglevel}",
            f"--hostname={name}",
            "--prefetch-multiplier=1",
            "--task-events",
            "--without-gossip",
            "--without-mingle",
        ]
    )
