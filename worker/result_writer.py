"""Buffers a shard's finished rows and writes them to the database in chunks; between engine steps it
also renews the shard's lease, notices cancellation, and reports progress."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from jobs.domain.settings import Settings
from storage import job_store
from storage.result_store import insert_results
from storage.shard_store import renew_lease
from storage.status import JobStatus

if TYPE_CHECKING:  # the meter reads the engine's stats; this module stays free of the engine import
    from worker.attempt_meter import AttemptMeter


@dataclass
class ShardProgress:
    job_id: str
    shard_index: int
    rows_done: int
    rows_total: int
    tokens_done: int  # tokens run by the engine for this shard so far (prompt + output)
    tokens_per_s: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "shard": self.shard_index,
            "rows_done": self.rows_done,
            "rows_total": self.rows_total,
            "tokens_per_s": round(self.tokens_per_s, 1),
        }


ProgressCallback = Callable[[ShardProgress], None]
PROGRESS_INTERVAL_S = 1.0


class ResultWriter:
    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        *,
        job_id: str,
        shard_index: int,
        owner: str,
        rows_total: int,
        rows_done: int,
        on_progress: ProgressCallback | None,
        engine_tokens: Callable[[], int] | None = None,
        attempt: AttemptMeter | None = None,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.job_id = job_id
        self.shard_index = shard_index
        self.owner = owner
        self.rows_total = rows_total
        self.rows_done = rows_done
        self.on_progress = on_progress
        self.engine_tokens = engine_tokens  # tokens the engine has run since the shard started
        self.attempt = attempt  # this attempt's engine cost, stored at each flush and heartbeat
        self.pending: list[dict[str, Any]] = []
        self.tokens_done = 0
        self.started = time.monotonic()
        self.last_flush = self.last_heartbeat = self.last_cancel_check = self.last_report = self.started
        self.cancelled = False
        self.lease_lost = False

    def add(self, row: dict[str, Any]) -> None:
        self.pending.append({"job_id": self.job_id, "shard_index": self.shard_index, **row})
        if len(self.pending) >= self.settings.result_chunk_rows:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        if not self.pending:
            return
        with self.sessions() as session:
            # The rows and what the engine has spent so far commit together: a worker killed after
            # this leaves both, one killed before leaves neither (its next attempt pays for the rows).
            insert_results(session, self.pending, commit=False)
            if self.attempt is not None:
                self.attempt.record(session, commit=False)
            session.commit()
        self.rows_done += len(self.pending)
        self.tokens_done += sum(row["prompt_tokens"] + row["output_tokens"] for row in self.pending)
        self.pending.clear()
        self.report()

    def report(self) -> None:
        if self.on_progress is None:
            return
        elapsed = max(time.monotonic() - self.started, 1e-9)
        # The engine's own count moves with every step; the stored rows' count only when rows finish
        # (a long summary's windows would show no progress at all).
        tokens = self.engine_tokens() if self.engine_tokens is not None else self.tokens_done
        self.on_progress(
            ShardProgress(
                self.job_id,
                self.shard_index,
                self.rows_done,
                self.rows_total,
                tokens,
                tokens / elapsed,
            )
        )

    def should_stop(self) -> bool:
        """Polled by the engine between steps: True ends the shard early (cancelled or lease lost)."""
        now = time.monotonic()
        settings = self.settings
        if self.pending and now - self.last_flush >= settings.result_flush_seconds:
            self.flush()
        elif now - self.last_report >= PROGRESS_INTERVAL_S:
            self.report()
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
