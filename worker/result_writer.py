"""Buffers a shard's finished rows (ResultRecord) and writes them to the database in chunks, each chunk
with the attempt's engine cost in the same transaction, and reports progress. The lease and the cancel
check are worker.shard.lease.LeaseWatcher's."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from jobs.domain.settings import Settings
from storage.result_record import ResultRecord
from storage.result_store import insert_results

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


class ChunkWriter:
    """Buffers items and stores them `chunk_rows` at a time. Each chunk commits together with what the
    attempt's engine has spent so far: a worker killed after the commit leaves both, one killed before
    leaves neither (its next attempt pays for the rows)."""

    def __init__(
        self, sessions: sessionmaker[Session], chunk_rows: int, attempt: AttemptMeter | None = None
    ) -> None:
        self.sessions = sessions
        self.chunk_rows = chunk_rows
        self.attempt = attempt
        self.pending: list[Any] = []

    def _insert(self, session: Session, items: list[Any]) -> None:
        raise NotImplementedError

    def _stored(self, items: list[Any]) -> None:
        """Called after each chunk committed."""

    def _append(self, item: Any) -> None:
        self.pending.append(item)
        if len(self.pending) >= self.chunk_rows:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        with self.sessions() as session:
            self._insert(session, self.pending)
            if self.attempt is not None:
                self.attempt.record(session, commit=False)
            session.commit()
        stored, self.pending = self.pending, []
        self._stored(stored)


class ResultWriter(ChunkWriter):
    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        *,
        job_id: str,
        shard_index: int,
        rows_total: int,
        rows_done: int,
        on_progress: ProgressCallback | None,
        engine_tokens: Callable[[], int] | None = None,
        attempt: AttemptMeter | None = None,
    ) -> None:
        super().__init__(sessions, settings.result_chunk_rows, attempt)
        self.settings = settings
        self.job_id = job_id
        self.shard_index = shard_index
        self.rows_total = rows_total
        self.rows_done = rows_done
        self.on_progress = on_progress
        self.engine_tokens = engine_tokens  # tokens the engine has run since the shard started
        self.tokens_done = 0
        self.started = time.monotonic()
        self.last_flush = self.last_report = self.started

    def add(self, record: ResultRecord) -> None:
        self._append(record)

    def _insert(self, session: Session, items: list[ResultRecord]) -> None:
        rows = [record.stored(job_id=self.job_id, shard_index=self.shard_index) for record in items]
        insert_results(session, rows, commit=False)

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        super().flush()

    def _stored(self, items: list[ResultRecord]) -> None:
        self.rows_done += len(items)
        self.tokens_done += sum(record.tokens for record in items)
        self.report()

    def report(self) -> None:
        self.last_report = time.monotonic()
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

    def tick(self) -> None:
        """Polled between engine steps: store rows waiting longer than result_flush_seconds, else report
        progress once a second."""
        now = time.monotonic()
        if self.pending and now - self.last_flush >= self.settings.result_flush_seconds:
            self.flush()
        elif now - self.last_report >= PROGRESS_INTERVAL_S:
            self.report()
