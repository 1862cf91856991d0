"""When a shard or a finalize runs again: the one retry policy of the Celery tasks and the embedded
`freight run`. run_shard counts a shard's attempts in the database and marks it failed after
`max_attempts`; the callers only decide when to run it again."""

from __future__ import annotations

from dataclasses import dataclass

from jobs.domain.settings import Settings


class ShardRetry(Exception):
    """The shard failed and was handed back; the caller should run it again."""


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int  # runs of one shard before its remaining rows become error rows
    shard_delay_s: float = 2.0  # a failed shard (ShardRetry) runs again after this
    # The database was unreachable: the shard's (or finalize's) state is unknown; try again later.
    infrastructure_delay_s: float = 10.0
    held_delay_s: float = 1.0  # another worker holds the shard's lease: look again after this

    @classmethod
    def from_settings(cls, settings: Settings) -> RetryPolicy:
        # A held shard is looked at twice per lease, so a lapsed lease is taken over soon after.
        return cls(
            max_attempts=settings.shard_max_attempts,
            held_delay_s=max(1.0, settings.shard_lease_seconds / 2),
        )

    def attempts(self) -> range:
        """The runs a caller without a broker (the embedded runner) makes, back to back."""
        return range(self.max_attempts)
