"""One attempt's work as the executor hands it to a kind of shard, and what a kind is."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from jobs.domain.prompts import PromptSource
from jobs.domain.schemas import ResolvedParams
from worker.attempt_meter import AttemptMeter
from worker.engine import LLM
from worker.engine.outputs import RequestOutput
from worker.result_writer import ResultWriter
from worker.shard.requests import EngineRequest, stream_requests


@dataclass
class ShardRun:
    """One attempt's work, as the executor hands it to a kind."""

    sessions: sessionmaker[Session]
    job_id: str
    tenant: str  # whose result cache the rows read and feed (worker/shard/result_cache.py)
    shard_index: int
    chunk_rows: int
    meter: AttemptMeter
    llm: LLM
    params: ResolvedParams
    source: PromptSource
    records: dict[int, dict[str, Any]]  # {row_index: input row} of the rows not stored yet
    writer: ResultWriter
    should_stop: Callable[[], bool]
    poll_seconds: float
    result_cache_ttl_seconds: float  # cache entries older than this are not reused (result_cache.py)

    def stream(
        self,
        requests: list[EngineRequest],
        on_output: Callable[[EngineRequest, RequestOutput], None],
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        """The one stream loop (worker.shard.requests.stream_requests), stopped by this run's check
        unless the kind passes its own."""
        check = self.should_stop if should_stop is None else should_stop
        stream_requests(self.llm, requests, on_output, check, self.poll_seconds)


class ShardKind(Protocol):
    name: str

    def run(self, run: ShardRun) -> int:
        """Write the rows' results through run.writer; returns the rows sent to the engine."""
        ...
