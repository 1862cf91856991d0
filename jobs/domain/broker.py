"""Celery wiring shared by the API (which only sends tasks) and the worker (which runs them):
task names, queue names (one per model) and the configuration both sides must agree on."""

from __future__ import annotations

import hashlib
import re
from pathlib import PurePath
from typing import Any

from jobs.domain.settings import Settings

TASK_RUN_SHARD = "freight.run_shard"
TASK_FINALIZE_JOB = "freight.finalize_job"
_PLAIN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def queue_for_model(settings: Settings, model: str) -> str:
    """`<prefix>.<alias>`; a folder path becomes its last name plus a short hash of the whole path."""
    if _PLAIN.match(model):
        return f"{settings.queue_prefix}.{model}"
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", PurePath(model).name)[:40] or "model"
    digest = hashlib.sha1(model.encode()).hexdigest()[:10]
    return f"{settings.queue_prefix}.{stem}-{digest}"


def celery_config(settings: Settings) -> dict[str, Any]:
    if not settings.broker_url:
        raise RuntimeError("FREIGHT_BROKER_URL is not set: the service needs a broker (redis://...)")
    return {
        "broker_url": settings.broker_url,
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_backend": None,  # results live in Postgres; shard outcomes reach Flower through events
        "task_ignore_result": True,
        # A shard is acknowledged only after it ran; if the worker dies the broker hands it out again.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "broker_transport_options": broker_transport_options(settings),
        "broker_connection_retry_on_startup": True,
        "task_default_queue": f"{settings.queue_prefix}.default",
        "worker_hijack_root_logger": False,
    }


def broker_transport_options(settings: Settings) -> dict[str, Any]:
    """Redis redelivers a task nobody acknowledged within the visibility timeout (a worker killed
    mid-shard). Consumers look for such tasks every tenth of that, at most every 10 s, so a lost
    shard waits about one visibility timeout, not the 100 s kombu's default sweep adds."""
    timeout = settings.broker_visibility_timeout
    return {
        "visibility_timeout": timeout,
        "unacked_restore_interval": max(1, min(10, timeout // 10)),
        "unacked_restore_throttle": 1,
    }


class CeleryDispatcher:
    """Sends the tasks: one run_shard per shard, and finalize_job, to the model's queue. The API
    makes its own Celery app; a worker passes the app it runs (its default queue is its model's)."""

    def __init__(self, settings: Settings, app: Any = None) -> None:
        self.settings = settings
        if app is None:
            from celery import Celery

            app = Celery("freight-api", set_as_current=False)
            app.conf.update(celery_config(settings))
        self.app = app

    def dispatch(self, job_id: str, model: str, shard_indices: list[int]) -> None:
        queue = queue_for_model(self.settings, model)
        with self.app.producer_or_acquire() as producer:
            for index in shard_indices:
                self.app.send_task(TASK_RUN_SHARD, args=[job_id, index], queue=queue, producer=producer)

    def dispatch_finalize(self, job_id: str, model: str | None = None) -> None:
        """Send finalize_job to `model`'s queue, or without a model to the app's default queue."""
        options = {} if model is None else {"queue": queue_for_model(self.settings, model)}
        self.app.send_task(TASK_FINALIZE_JOB, args=[job_id], **options)

    def ping(self, timeout: float = 2.0) -> None:
        """Raise if the broker cannot be reached."""
        with self.app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=timeout)
