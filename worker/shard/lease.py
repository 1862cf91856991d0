"""Between engine steps: keep the shard's lease (heartbeat, which also stores the attempt's cost so far)
and notice the job being cancelled. Separate from the result writer, which only stores rows."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session, sessionmaker

from jobs.domain.settings import Settings
from storage import job_store
from storage.shard_store import renew_lease
from storage.status import JobStatus

if TYPE_CHECKING:  # the meter reads the engine's stats; this module stays free of the engine import
    from worker.attempt_meter import AttemptMeter


class LeaseWatcher:
    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        *,
        job_id: str,
        shard_index: int,
        owner: str,
        attempt: AttemptMeter | None = None,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.job_id = job_id
        self.shard_index = shard_index
        self.owner = owner
        self.attempt = attempt
        self.last_heartbeat = self.last_cancel_check = time.monotonic()
        self.cancelled = False
        self.lease_lost = False

    def should_stop(self) -> bool:
        """True ends the shard early: its lease went to another worker, or the job is cancelling."""
        now = time.monotonic()
        settings = self.settings
        if now - self.last_heartbeat >= settings.shard_lease_seconds / 4:
            self.last_heartbeat = now
            with self.sessions() as session:
                if not renew_lease(
                    session, self.job_id, self.shard_index, self.owner, settings.shard_lease_seconds
                ):
                    self.lease_lost = True
                    return True
                if self.attempt is not None:
                    # A long request stores no row for a while: the heartbeat keeps its cost current.
                    self.attempt.record(session)
        if now - self.last_cancel_check >= settings.cancel_poll_seconds:
            self.last_cancel_check = now
            with self.sessions() as session:
                if job_store.job_status(session, self.job_id) == JobStatus.CANCELLING:
                    self.cancelled = True
                    return True
        return False
