"""Celery wiring shared by the API (which only sends tasks) and the worker (which runs them):
task names, queue names (one per model) and the configuration both sides must agree on."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import PurePath
from typing import Any

from jobs.domain.settings import Settings

TASK_RUN_SHARD = "freight.run_shard"
TASK_FINALIZE_JOB = "freight.finalize_job"
_PLAIN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

# (task name, job id, shard index or None for finalize): one piece of work a message carries.
WorkKey = tuple[str, str, int | None]


@dataclass(frozen=True)
class TaskLabels:
    """The schedule of a shard message's job, sent as the task's keyword arguments so Flower's task page
    shows whose job it is and how it is scheduled (the job id is its first argument). The worker does not
    read them: a ticket runs the best free shard (docs/scheduling.md), and the task's result names the
    shard it ran."""

    tenant: str
    priority: str
    deadline: str | None  # ISO 8601, UTC

    @classmethod
    def of(cls, tenant: str, priority: str, deadline: datetime | None) -> TaskLabels:
        return cls(tenant, priority, None if deadline is None else deadline.isoformat(timespec="seconds"))

    def kwargs(self) -> dict[str, str | None]:
        return asdict(self)


def message_work(raw: bytes) -> WorkKey | None:
    """The work a kombu Redis message stands for, or None if it is not one of ours."""
    try:
        payload = json.loads(raw)
        if isinstance(payload, list):  # unacked entries are [message, exchange, routing_key]
            payload = payload[0]
        task = payload["headers"]["task"]
        args = json.loads(base64.b64decode(payload["body"]))[0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if task == TASK_RUN_SHARD and len(args) == 2:
        return task, str(args[0]), int(args[1])
    if task == TASK_FINALIZE_JOB and len(args) == 1:
        return task, str(args[0]), None
    return None


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

    def dispatch(
        self, job_id: str, model: str, shard_indices: list[int], labels: TaskLabels | None = None
    ) -> None:
        queue = queue_for_model(self.settings, model)
        kwargs = {} if labels is None else labels.kwargs()
        with self.app.producer_or_acquire() as producer:
            for index in shard_indices:
                self.app.send_task(
                    TASK_RUN_SHARD, args=[job_id, index], kwargs=kwargs, queue=queue, producer=producer
                )

    def withdraw(self, job_id: str, model: str) -> int:
        """Take the job's shard messages that no worker has taken yet back out of the model's queue (a
        submission that failed after some were sent leaves none behind). Returns how many were removed.
        A message a worker already took finds no shard and ends (claim_shard: MISSING)."""
        queue = queue_for_model(self.settings, model)
        removed = 0
        with self.app.connection_for_write() as connection:
            client = connection.default_channel.client  # kombu's Redis transport: one list per queue
            for raw in client.lrange(queue, 0, -1):
                work = message_work(raw)
                if work is not None and work[0] == TASK_RUN_SHARD and work[1] == job_id:
                    removed += client.lrem(queue, 0, raw)
        return removed

    def dispatch_finalize(self, job_id: str, model: str | None = None) -> None:
        """Send finalize_job to `model`'s queue, or without a model to the app's default queue."""
        options = {} if model is None else {"queue": queue_for_model(self.settings, model)}
        self.app.send_task(TASK_FINALIZE_JOB, args=[job_id], **options)

    def ping(self, timeout: float = 2.0) -> None:
        """Raise if the broker cannot be reached."""
        with self.app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=timeout)
