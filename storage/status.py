"""Job and shard statuses, and which moves between them are allowed."""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    VALIDATING = "validating"
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


FINAL_JOB_STATUSES = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED})
# A cancel request is accepted only while work remains to be stopped.
CANCELLABLE_JOB_STATUSES = frozenset({JobStatus.VALIDATING, JobStatus.QUEUED, JobStatus.IN_PROGRESS})
# Shards may still be running (or all be finished, with the move to finalizing not made yet).
ACTIVE_JOB_STATUSES = frozenset({JobStatus.QUEUED, JobStatus.IN_PROGRESS, JobStatus.CANCELLING})

# The job's lifecycle, the one place it is written down: for each status, the statuses a job may
# enter it from. storage.job_store.move refuses any other move.
#   validating -> queued -> in_progress -> finalizing -> completed | cancelled | failed
#   validating | queued | in_progress -> cancelling -> finalizing (then cancelled)
#   queued -> failed (the broker could not be reached at submit)
#   finalizing -> failed: finalize failed, or a shard noted that the job cannot succeed (its model
#   cannot be served: job_store.note_error)
JOB_TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.VALIDATING}),  # the input was valid and the shards are cut
    JobStatus.IN_PROGRESS: frozenset({JobStatus.QUEUED}),  # the first shard started
    JobStatus.CANCELLING: CANCELLABLE_JOB_STATUSES,
    JobStatus.FINALIZING: ACTIVE_JOB_STATUSES,  # every shard is finished
    JobStatus.COMPLETED: frozenset({JobStatus.FINALIZING}),
    JobStatus.CANCELLED: frozenset({JobStatus.FINALIZING}),
    JobStatus.FAILED: frozenset({JobStatus.QUEUED, JobStatus.FINALIZING}),
}


def allowed_sources(to: JobStatus) -> frozenset[JobStatus]:
    """The statuses a job may move to `to` from (none for `validating`, which a job starts in)."""
    return JOB_TRANSITIONS.get(JobStatus(to), frozenset())


class ShardStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"  # held by `owner` until `lease_until`
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"  # gave up after shard_max_attempts; its rows are error rows


FINAL_SHARD_STATUSES = frozenset({ShardStatus.DONE, ShardStatus.CANCELLED, ShardStatus.FAILED})


class AttemptOutcome(StrEnum):
    """How one attempt at a shard ended (a shard_attempts row); RUNNING until it does. A worker that
    was killed leaves its attempt RUNNING."""

    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"  # the last attempt failed: the shard's remaining rows are error rows
    RETRY = "retry"  # failed, and the shard was handed back for another attempt
    HANDED_BACK = "handed_back"  # the worker is shutting down (SIGTERM)
    LEASE_LOST = "lease_lost"  # the lease lapsed and another worker took the shard over


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ERROR = "error"
    CANCELLED = "cancelled"


# A row the model answered: it stopped, or reached max_tokens. The one definition of "completed".
COMPLETED_FINISH_REASONS = (FinishReason.STOP.value, FinishReason.LENGTH.value)
