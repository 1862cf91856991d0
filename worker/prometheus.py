"""Prometheus metrics of one worker process, served by prometheus-client's HTTP server on
FREIGHT_WORKER_METRICS_PORT: the engine's live state (running batch, waiting requests, KV-cache use,
recent tokens/s) and its counters (tokens, preemptions, busy time) read when scraped, plus rows and
shards this worker finished. The registry belongs to the worker, not the module."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.llm_pool import LLMPool
from worker.result_writer import ShardProgress

log = logging.getLogger(__name__)


class EngineCollector(Collector):
    """Reads the loaded engine's state at scrape time (the engine thread keeps running meanwhile;
    each value is one read of a list length or a counter)."""

    def __init__(self, pool: LLMPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        llm = self.pool.loaded
        loaded = GaugeMetricFamily(
            "freight_worker_model_loaded", "1 once the model is loaded", labels=["model"]
        )
        if llm is None:
            yield loaded
            return
        loaded.add_metric([str(self.pool.loaded_model)], 1)
        yield loaded
        engine, stats = llm.engine, llm.stats
        busy = engine.has_unfinished()
        last = stats.timeline[-1] if stats.timeline else None
        yield _gauge(
            "freight_worker_tokens_per_second",
            "Tokens computed per busy second at the engine's latest sample (0 when idle)",
            float(last["tokens_per_s"]) if busy and last else 0.0,
        )
        yield _gauge(
            "freight_worker_running_batch_size",
            "Sequences in the running batch",
            len(engine.scheduler.running),
        )
        yield _gauge(
            "freight_worker_waiting_requests", "Requests waiting or preempted", engine.scheduler.num_waiting
        )
        used, total = engine.kv_blocks.num_used, engine.kv_blocks.num_blocks  # every KV group, memory-weighted
        yield _gauge("freight_worker_kv_cache_blocks_used", "KV-cache blocks in use", used)
        yield _gauge("freight_worker_kv_cache_blocks", "KV-cache blocks in all", total)
        yield _gauge(
            "freight_worker_kv_cache_utilization",
            "Fraction of KV-cache blocks in use",
            used / total if total else 0.0,
        )
        yield _gauge(
            "freight_worker_peak_kv_cache_utilization",
            "Peak fraction of KV-cache blocks used",
            stats.peak_kv_utilization,
        )
        for name, help_text, value in (
            (
                "freight_worker_preemptions",
                "Sequences preempted (their KV blocks freed, recomputed later)",
                stats.preemptions,
            ),
            ("freight_worker_prompt_tokens", "Prompt tokens read", stats.prompt_tokens),
            ("freight_worker_generated_tokens", "Output tokens generated", stats.output_tokens),
            (
                "freight_worker_computed_tokens",
                "Tokens run through the model, recomputation included",
                stats.computed_tokens,
            ),
            ("freight_worker_engine_steps", "Engine steps", stats.steps),
            ("freight_worker_engine_busy_seconds", "Seconds the engine spent in steps", stats.busy_seconds),
        ):
            yield CounterMetricFamily(name, help_text, value=value)


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


class WorkerMetrics:
    def __init__(self, pool: LLMPool) -> None:
        self.registry = CollectorRegistry()
        self.rows_done = Counter(
            "freight_worker_rows_done", "Result rows this worker stored", registry=self.registry
        )
        self.shards = Counter(
            "freight_worker_shards",
            "Shard runs this worker ended, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.registry.register(EngineCollector(pool))
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int], tuple[int, int]] = {}  # shard -> (rows at first report, counted)

    def observe_progress(self, update: ShardProgress) -> None:
        """Count rows as progress reports arrive. A report says how many of the shard's rows are
        stored, earlier runs included, so the first report only sets the baseline; the shard's end
        (observe_shard_end) adds whatever the reports did not."""
        key = (update.job_id, update.shard_index)
        with self._lock:
            if key not in self._seen:
                self._seen[key] = (update.rows_done, 0)
                return
            baseline, counted = self._seen[key]
            new = update.rows_done - baseline - counted
            if new > 0:
                self.rows_done.inc(new)
                self._seen[key] = (baseline, counted + new)

    def observe_shard_end(self, job_id: str, shard_index: int, outcome: str, rows_written: int) -> None:
        with self._lock:
            _baseline, counted = self._seen.pop((job_id, shard_index), (0, 0))
            if rows_written > counted:
                self.rows_done.inc(rows_written - counted)
        self.shards.labels(outcome).inc()

    def serve(self, port: int, address: str) -> None:
        start_http_server(port, addr=address, registry=self.registry)
        log.info("worker metrics on http://%s:%d/metrics", address, port)
