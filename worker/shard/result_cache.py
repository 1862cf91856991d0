"""A shard's use of its tenant's result cache (docs/result-cache.md): before the engine runs, the rows
whose key (worker/shard/cache_key.py) an earlier finished row of the tenant has are written from it,
marked cached, and only the rest run; once they ran, their outputs are stored under their keys. Which
rows take part is the job's `reuse_results` or the default rule (jobs/domain/result_cache.py); entries
older than FREIGHT_RESULT_CACHE_TTL_SECONDS are not reused (storage/result_cache_store.py deletes them)."""

from __future__ import annotations

from datetime import timedelta

from jobs.domain.result_cache import reuses_result
from storage.models import utcnow
from storage.result_cache_store import CachedOutput, cached_outputs, remember_outputs
from storage.result_record import ResultRecord
from storage.status import COMPLETED_FINISH_REASONS
from worker.engine.outputs import RequestOutput
from worker.shard.cache_key import result_key
from worker.shard.requests import EngineRequest
from worker.shard.run import ShardRun


class ShardResultCache:
    def __init__(self, run: ShardRun) -> None:
        self.run = run
        self.keys: dict[int, str] = {}  # row_index -> key, for the rows that take part
        self.finished: list[tuple[str, RequestOutput]] = []  # (key, output) of rows run here
        self.tokens_run = 0  # prompt + output tokens of every row run here: shares of the engine time

    def misses(self, requests: list[EngineRequest[str]]) -> list[EngineRequest[str]]:
        """Write the rows the cache holds (each row's `tag` is its custom_id) and return the others."""
        run = self.run
        numerics = run.llm.numerics
        for request in requests:
            sampling = request.sampling
            if reuses_result(run.params.reuse_results, temperature=sampling.temperature, seed=sampling.seed):
                self.keys[request.row_index] = result_key(numerics, request.prompt_ids, sampling)
        if not self.keys:
            return list(requests)
        fresh_since = utcnow() - timedelta(seconds=run.result_cache_ttl_seconds)
        with run.sessions() as session:
            found = cached_outputs(
                session, tenant=run.tenant, keys=list(self.keys.values()), fresh_since=fresh_since
            )
        todo: list[EngineRequest[str]] = []
        for request in requests:
            key = self.keys.get(request.row_index)
            hit = found.get(key) if key is not None else None
            if hit is None:
                todo.append(request)
                continue
            # Counted before the row is added: a chunk flushed by `add` stores both together.
            run.meter.saved_device_seconds += hit.device_seconds
            run.writer.add(
                ResultRecord(
                    request.row_index,
                    request.tag,
                    hit.output_text,
                    hit.prompt_tokens,
                    hit.output_tokens,
                    hit.finish_reason,
                    None,
                    cached=True,
                )
            )
        run.writer.flush()
        return todo

    def ran(self, request: EngineRequest[str], out: RequestOutput) -> None:
        """Note a row the engine ran; a completed one (stop or length, no error) is kept for the cache."""
        self.tokens_run += len(out.prompt_token_ids) + len(out.output_token_ids)
        key = self.keys.get(request.row_index)
        if key is not None and out.error is None and out.finish_reason in COMPLETED_FINISH_REASONS:
            self.finished.append((key, out))

    def remember(self) -> None:
        """Store the completed rows under their keys, each with its share (by tokens) of the engine time
        this attempt spent: what a later row that reuses it saves."""
        if not self.finished:
            return
        busy = float(self.run.meter.counters().get("busy_seconds", 0.0))
        per_token = busy / self.tokens_run if self.tokens_run else 0.0
        outputs = [
            CachedOutput(
                key,
                out.text,
                len(out.prompt_token_ids),
                len(out.output_token_ids),
                out.finish_reason,
                round(per_token * (len(out.prompt_token_ids) + len(out.output_token_ids)), 6),
            )
            for key, out in self.finished
        ]
        with self.run.sessions() as session:
            remember_outputs(session, tenant=self.run.tenant, job_id=self.run.job_id, outputs=outputs)
