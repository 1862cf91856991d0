"""Put back work the broker lost. Postgres is the record of what must run; Redis only carries the
messages. If Redis loses them (restarted without persistence, flushed, failed over) a shard would
wait forever, so the API sweeps now and then: a shard that is pending (or whose lease lapsed) in
an active job, and that has no message in its model's queue nor among the broker's unacknowledged
messages on two sweeps in a row, gets its task sent again; likewise a job stuck in `finalizing`.
A duplicate message is harmless: the shard's lease and its stored rows make a second run a no-op.
Only jobs whose input file is in this API's data folder are swept (a deployment's own jobs).
Jobs stuck in `validating` (an API that died mid-upload) are deleted with their files, and so are
staged uploads (storage/blobs.py staging_name) older than an hour. OpenAI batches past their window and
jobs past their deadline are expired (cancelled, finished rows kept), and a final batch whose output and
error files were not written (its worker died after the job's last move) gets them
(jobs/domain/batch_files.py). Result cache entries past FREIGHT_RESULT_CACHE_TTL_SECONDS are deleted.
A shard message is a ticket for any shard of its model (docs/scheduling.md): a shard whose own message
ran another is not re-sent while that other shard's ticket still waits in the queue (it will run one of
the shards that lack their own)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from jobs.domain.batch_files import BatchFiles
from jobs.domain.broker import (
    TASK_FINALIZE_JOB,
    TASK_RUN_SHARD,
    CeleryDispatcher,
    TaskLabels,
    WorkKey,
    message_work,
    queue_for_model,
)
from jobs.domain.openai_service import expire_if_due
from jobs.domain.service import JobService
from jobs.domain.settings import Settings
from storage import job_store, openai_store, result_cache_store
from storage.blobs import BlobStore
from storage.models import Job, OpenAIBatch, utcnow
from storage.shard_store import idle_shards, not_idle_shards
from storage.status import JobStatus

log = logging.getLogger(__name__)
UNACKED_KEY = "unacked"  # kombu's Redis hash of delivered, unacknowledged messages
ABANDONED_VALIDATION = timedelta(hours=1)
__all__ = ["Recovery", "SweepReport", "WorkKey", "message_work", "start_recovery"]


@dataclass
class SweepReport:
    shards_resent: list[tuple[str, int]] = field(default_factory=list)
    finalize_resent: list[str] = field(default_factory=list)
    abandoned_deleted: list[str] = field(default_factory=list)
    batches_expired: list[str] = field(default_factory=list)  # OpenAI batches past their window
    jobs_expired: list[str] = field(default_factory=list)  # jobs past their deadline (docs/scheduling.md)
    batch_files_written: list[str] = field(default_factory=list)  # final batches whose files were missing
    cache_entries_expired: int = 0  # result cache entries older than FREIGHT_RESULT_CACHE_TTL_SECONDS


class Recovery:
    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        blobs: BlobStore,
        dispatcher: CeleryDispatcher,
    ) -> None:
        import redis

        self.settings = settings
        self.sessions = sessions
        self.blobs = blobs
        self.dispatcher = dispatcher
        self.batch_files = BatchFiles(JobService(settings, sessions, blobs, dispatcher=None))
        self.redis = redis.Redis.from_url(settings.broker_url, socket_timeout=10, socket_connect_timeout=5)
        self.suspects: set[WorkKey] = set()  # missing on the last sweep; re-sent if still missing

    def close(self) -> None:
        self.redis.close()

    def run(self, stop: threading.Event) -> None:
        """Sweep every recovery_interval_seconds until `stop` is set (a daemon thread of the API)."""
        while not stop.wait(self.settings.recovery_interval_seconds):
            try:
                self.sweep()
            except Exception:  # a broker or database outage: try again next time
                log.warning("recovery sweep failed", exc_info=True)

    def sweep(self) -> SweepReport:
        report = SweepReport()
        now = utcnow()
        expected: dict[WorkKey, str] = {}  # work that needs a message -> its model
        labels: dict[str, TaskLabels] = {}  # job id -> its schedule, for a re-sent message (Flower shows it)
        with self.sessions() as session:
            for job_id in self._abandoned_validations(session, now):
                job_store.delete_job(session, job_id)
                self.blobs.delete_job(job_id)
                report.abandoned_deleted.append(job_id)
            # An upload staged by an API that died while validating it: no row points to it.
            for name in self.blobs.stale("staging", ABANDONED_VALIDATION.total_seconds()):
                self.blobs.delete(name)
            report.batches_expired = self._expire_batches(session, now)
            report.jobs_expired = job_store.expire_overdue(session, now=now)
            report.batch_files_written = self._write_batch_files(session, now)
            cache_cutoff = now - timedelta(seconds=self.settings.result_cache_ttl_seconds)
            report.cache_entries_expired = result_cache_store.delete_expired(session, before=cache_cutoff)
            for job in self._active_jobs(session, now):
                if not self.blobs.exists(job.input_name):
                    continue  # another deployment's job (its files are elsewhere), or being deleted
                # Every shard may be done with the move to finalizing lost with its worker.
                if job.status == JobStatus.FINALIZING or job_store.mark_finalizing(session, job.id):
                    expected[(TASK_FINALIZE_JOB, job.id, None)] = job.model
                    continue
                labels[job.id] = TaskLabels.of(job.tenant, job.priority, job.deadline)
                for index in idle_shards(session, job_id=job.id, now=now):
                    expected[(TASK_RUN_SHARD, job.id, index)] = job.model
        if not expected:
            self.suspects = set()
            return report
        present, queued = self._work_in_broker({model for model in expected.values()})
        missing = set(expected) - present
        missing -= self._run_by_spare_tickets(missing, expected, queued, now)
        for work in sorted(missing & self.suspects, key=str):
            task, job_id, index = work
            if task == TASK_RUN_SHARD:
                self.dispatcher.dispatch(job_id, expected[work], [index], labels.get(job_id))
                report.shards_resent.append((job_id, index))
            else:
                self.dispatcher.dispatch_finalize(job_id, expected[work])
                report.finalize_resent.append(job_id)
            log.warning(
                "re-sent %s for %s (its message was lost)", task, job_id if index is None else (job_id, index)
            )
        self.suspects = missing - self.suspects
        return report

    def _active_jobs(self, session: Session, now) -> list[Job]:
        # A job younger than one sweep may still be getting its messages from the API that made it.
        settled = now - timedelta(seconds=self.settings.recovery_interval_seconds)
        return job_store.active_jobs(session, created_before=settled)

    def _expire_batches(self, session: Session, now) -> list[str]:
        expired = []
        for row in openai_store.batches_past_window(session, now=now):
            job = job_store.get_job(session, row.job_id)
            if job is not None and expire_if_due(session, row, job.status, now):
                expired.append(row.id)
        return expired

    def _write_batch_files(self, session: Session, now) -> list[str]:
        # A job that became final less than a sweep ago may have its worker writing the files right now.
        settled = now - timedelta(seconds=self.settings.recovery_interval_seconds)
        written = []
        for row in openai_store.batches_awaiting_files(session, settled_before=settled):
            job = job_store.get_job(session, row.job_id) if row.job_id is not None else None
            if not self._ours(session, row, job):
                continue
            try:
                if self.batch_files.write(session, row, job):
                    written.append(row.id)
            except Exception:  # one batch's trouble must not stop the sweep (nor the others' files)
                session.rollback()
                log.warning("could not write the files of batch %s", row.id, exc_info=True)
        return written

    def _ours(self, session: Session, row: OpenAIBatch, job: Job | None) -> bool:
        """Whether this deployment's store holds the batch's input: its files are written here."""
        if job is not None:
            return self.blobs.exists(job.input_name)
        source = openai_store.get_file(session, row.input_file_id, row.tenant)
        return source is not None and self.blobs.exists(source.blob_name)

    def _abandoned_validations(self, session: Session, now) -> list[str]:
        jobs = job_store.validating_jobs(session, created_before=now - ABANDONED_VALIDATION)
        return [job_id for job_id, name in jobs if self.blobs.exists(name)]  # this deployment's only

    def _work_in_broker(self, models: Iterable[str]) -> tuple[set[WorkKey], dict[str, list[WorkKey]]]:
        """(the work of every message in the models' queues and among the unacknowledged ones, {model:
        the shard tickets waiting in its queue})."""
        found: set[WorkKey] = set()
        queued: dict[str, list[WorkKey]] = {}
        for model, raw in self._broker_messages(models):
            work = message_work(raw)
            if work is None:
                continue
            found.add(work)
            if model is not None and work[0] == TASK_RUN_SHARD:
                queued.setdefault(model, []).append(work)
        return found, queued

    def _broker_messages(self, models: Iterable[str]) -> Iterator[tuple[str | None, bytes]]:
        """(the model whose queue holds it, or None for an unacknowledged one; the raw message)."""
        for model in models:
            queue = queue_for_model(self.settings, model)
            for start in range(0, self.redis.llen(queue), 1000):
                for raw in self.redis.lrange(queue, start, start + 999):
                    yield model, raw
        for _tag, raw in self.redis.hscan_iter(UNACKED_KEY, count=1000):
            yield None, raw

    def _run_by_spare_tickets(
        self,
        missing: set[WorkKey],
        expected: dict[WorkKey, str],
        queued: dict[str, list[WorkKey]],
        now,
    ) -> set[WorkKey]:
        """The shards without a message of their own that tickets already queued will run: a ticket claims
        the best free shard of its model (docs/scheduling.md), so a queued ticket whose own shard needs
        none (running under a live lease, or finished: its message ran another shard) runs one of them.
        Each such ticket covers one; only the shards beyond them are re-sent."""
        covered: set[WorkKey] = set()
        with self.sessions() as session:
            for model, tickets in queued.items():
                lacking = sorted(
                    (work for work in missing if work[0] == TASK_RUN_SHARD and expected[work] == model), key=str
                )
                if not lacking:
                    continue
                busy = not_idle_shards(session, [(job_id, index) for _task, job_id, index in tickets], now=now)
                spare = sum(1 for _task, job_id, index in tickets if (job_id, index) in busy)
                covered.update(lacking[:spare])
        return covered


def start_recovery(
    settings: Settings, sessions: sessionmaker[Session], blobs: BlobStore, dispatcher: CeleryDispatcher
) -> tuple[threading.Thread, threading.Event, Recovery]:
    recovery = Recovery(settings, sessions, blobs, dispatcher)
    stop = threading.Event()
    thread = threading.Thread(target=recovery.run, args=(stop,), name="freight-recovery", daemon=True)
    thread.start()
    return thread, stop, recovery
