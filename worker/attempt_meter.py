"""What one attempt at a shard has cost: the engine counters it spent since it picked the engine, kept
in its shard_attempts row. The row is written at each result flush (with the rows, in one
transaction), at each lease heartbeat and when the attempt ends, with the outcome; a worker killed
outright leaves it as its last flush or heartbeat wrote it."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy.orm import Session

from storage.attempt_store import record_attempt, start_attempt
from storage.status import AttemptOutcome
from worker.engine import LLM
from worker.engine_stats import StatsSnapshot, snapshot, spent_since


class AttemptMeter:
    def __init__(self) -> None:
        self.attempt_id: int | None = None
        self._spent: Callable[[], dict[str, float]] = dict  # nothing is spent before the engine is picked
        self._frozen: dict[str, float] | None = None
        # Engine time the attempt's cached rows did not spend (what running them first cost), stored
        # with the counters so it lands in the same transaction as the rows (worker/shard/result_cache.py).
        self.saved_device_seconds = 0.0

    def start(self, session: Session, *, job_id: str, shard_index: int, owner: str) -> None:
        self.attempt_id = start_attempt(session, job_id=job_id, shard_index=shard_index, owner=owner)

    def watch(self, llm: LLM) -> StatsSnapshot:
        """Count this engine's work from now on; returns the snapshot the counts start from."""
        before = snapshot(llm.stats)
        self._spent = lambda: spent_since(before, llm.stats)
        return before

    def freeze(self) -> None:
        """The attempt let go of the engine (its lock): from now on the engine's counters move for
        another shard, so keep the attempt's numbers as they are."""
        self._frozen = self.counters()

    def counters(self) -> dict[str, float]:
        counters = dict(self._frozen) if self._frozen is not None else self._spent()
        if self.saved_device_seconds:
            counters["saved_device_seconds"] = round(self.saved_device_seconds, 4)
        return counters

    def record(self, session: Session, outcome: AttemptOutcome | None = None, *, commit: bool = True) -> None:
        """Store the counters so far (and the outcome, once the attempt ended). An attempt whose row
        was never written (the database failed right after the claim) spent nothing on the engine."""
        if self.attempt_id is None:
            return
        record_attempt(
            session, attempt_id=self.attempt_id, counters=self.counters(), outcome=outcome, commit=commit
        )
