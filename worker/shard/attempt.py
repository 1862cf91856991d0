"""One attempt at a claimed shard, and how it ends: finished (done, cancelled, failed), handed back
(the worker is shutting down) or failed and retried (the retry policy: worker/retry.py). Holds what
every ending needs (context, meter, job, shard, owner) so it is passed around once."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from storage import job_store
from storage.blobs import store_unreachable
from storage.input_set import input_schema
from storage.result_record import ResultRecord
from storage.result_store import insert_results, stored_row_indices
from storage.shard_store import finish_shard, get_shard, release_shard
from storage.status import AttemptOutcome, ShardStatus
from worker.attempt_meter import AttemptMeter
from worker.inputs import open_job_input, read_rows, shard_rows
from worker.model_registry import UnservableModel
from worker.retry import RetryPolicy, ShardRetry
from worker.shard.context import ShardHandedBack, WorkerContext
from worker.shard.profile import record_finished_shard
from worker.shard.requests import custom_id

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 500


@dataclass
class Attempt:
    ctx: WorkerContext
    meter: AttemptMeter
    job_id: str
    shard_index: int
    owner: str

    def finish(
        self, session: Session, status: ShardStatus, stats: dict[str, Any] | None, error: str | None = None
    ) -> None:
        """Finish the shard and end the attempt in one transaction, so a finished shard's cost is all
        stored by the time the job is finalized. When another worker took the shard over first, the
        attempt ends as lease_lost instead (that worker's attempt finishes the shard). A shard done here
        adds its measured work to the model's throughput profile (worker/shard/profile.py)."""
        self.meter.record(session, AttemptOutcome(status), commit=False)
        if not finish_shard(  # commits
            session, self.job_id, self.shard_index, self.owner, status, stats, error=error
        ):
            self.meter.record(session, AttemptOutcome.LEASE_LOST)
            return
        if status == ShardStatus.DONE and stats is not None:
            # After the shard is done, not with it: only the attempt that finished it counts once.
            record_finished_shard(session, self.ctx.settings, self.job_id, stats)

    def lease_lost(self) -> None:
        log.warning("lost the lease on %s shard %d; another worker has it", self.job_id, self.shard_index)
        with self.ctx.sessions() as session:
            self.meter.record(session, AttemptOutcome.LEASE_LOST)

    def hand_back(self, rows_written: int) -> None:
        """Release the shard unless every row finished anyway; the caller requeues its task."""
        job_id, shard_index = self.job_id, self.shard_index
        with self.ctx.sessions() as session:
            remaining = set(shard_rows(get_shard(session, job_id, shard_index)))
            if len(stored_row_indices(session, job_id, sorted(remaining))) == len(remaining):
                return  # the shard finished before the stop took effect: finish it normally
            released = release_shard(
                session,
                job_id,
                shard_index,
                self.owner,
                "handed back: worker shutting down",
                count_attempt=False,
            )
            self.meter.record(session, AttemptOutcome.HANDED_BACK if released else AttemptOutcome.LEASE_LOST)
        log.warning(
            "worker shutting down: handed back %s shard %d after %d rows", job_id, shard_index, rows_written
        )
        raise ShardHandedBack(rows_written)

    def failed(self, exc: Exception) -> str:
        """Hand the shard back for another try, or after shard_max_attempts make its remaining rows
        error rows so the job can still finish. A model the engine cannot load fails the shard at once
        and is noted on the job, which then ends failed. Returns the shard's final status, or raises
        ShardRetry."""
        job_id, shard_index, ctx = self.job_id, self.shard_index, self.ctx
        # The refusal already reads "model ... cannot be served: ..."; a database error quotes its SQL.
        unservable = isinstance(exc, UnservableModel)
        message = (str(exc) if unservable else f"{exc.__class__.__name__}: {exc}")[:MAX_ERROR_CHARS]
        if unservable:  # the loader's refusal is the whole story: no traceback
            log.error("shard %d of %s failed: %s", shard_index, job_id, message)
        else:
            log.exception("shard %d of %s failed", shard_index, job_id)
        # A dropped database connection (restart, pg_terminate_backend) or an unreachable object store
        # is not the shard's fault: the retry resumes from the stored rows without using up one of the
        # shard's attempts.
        disconnected = (isinstance(exc, DBAPIError) and exc.connection_invalidated) or store_unreachable(exc)
        with ctx.sessions() as session:
            shard = get_shard(session, job_id, shard_index)
            if unservable:
                # The same model files give the same refusal: another attempt cannot help.
                job_store.note_error(session, job_id=job_id, error=message, commit=False)
                self._fail_rows(session, shard_rows(shard), message)
                self.finish(session, ShardStatus.FAILED, None, error=message)
                return ShardStatus.FAILED
            if disconnected or shard.attempts < ctx.settings.shard_max_attempts:
                released = release_shard(
                    session,
                    job_id,
                    shard_index,
                    self.owner,
                    message,
                    count_attempt=not disconnected,
                    # Another job's ticket must not retake it before its own retried message would.
                    retry_after_seconds=RetryPolicy.from_settings(ctx.settings).shard_delay_s,
                )
                # What the failed attempt ran is part of the job's cost (the retry reruns its unstored rows).
                self.meter.record(session, AttemptOutcome.RETRY if released else AttemptOutcome.LEASE_LOST)
                raise ShardRetry(message) from exc
            self._fail_rows(session, shard_rows(shard), f"the shard failed {shard.attempts} times: {message}")
            self.finish(session, ShardStatus.FAILED, None, error=message)
        return ShardStatus.FAILED

    def _fail_rows(self, session: Session, rows: list[int], problem: str) -> None:
        """Error rows for the shard's rows not stored yet; commits."""
        stored = stored_row_indices(session, self.job_id, rows)
        missing = [index for index in rows if index not in stored]
        custom_ids = self._custom_ids_or_indices(missing)
        insert_results(
            session,
            [
                ResultRecord.failed(index, custom_ids[index], problem).stored(
                    job_id=self.job_id, shard_index=self.shard_index
                )
                for index in missing
            ],
        )

    def _custom_ids_or_indices(self, rows: list[int]) -> dict[int, str]:
        """The rows' custom_ids from the input, or their row indices when the input cannot be read."""
        try:
            with self.ctx.sessions() as session:
                name = job_store.get_job(session, self.job_id).input_name
            job_input = open_job_input(self.ctx.blobs, self.ctx.settings, name)
            if "custom_id" in input_schema(job_input).names:
                found = read_rows(job_input, rows, ["custom_id"])
                return {index: custom_id(index, record) for index, record in found.items()}
        except Exception:  # the input itself may be what failed; fall back to the row index
            log.exception("could not read custom_ids of %s", self.job_id)
        return {index: str(index) for index in rows}
