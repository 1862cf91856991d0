"""The worker's loaded model: built once per process and kept for every shard that asks for the same
engine configuration (a different quantization or KV dtype replaces it)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from jobs.domain.schemas import ResolvedParams
from jobs.domain.settings import Settings
from worker.engine import LLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineKey:
    model: str
    dtype: str
    quantization: str | None
    kv_cache_dtype: str


class LLMPool:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.lock = threading.Lock()  # one shard at a time uses the engine (threads pool)
        self._key: EngineKey | None = None
        self._llm: LLM | None = None

    def get(self, params: ResolvedParams) -> LLM:
        llm = self.load(EngineKey(params.model, params.dtype, params.quantization, params.kv_cache_dtype))
        if llm.engine.has_unfinished():
            # A shard that failed mid-stream (say its database connection dropped) left its requests
            # in the engine; they must not come out of the next shard's stream as its rows.
            log.warning("dropping %d requests a failed shard left in the engine", len(llm.engine.abort_all()))
        return llm

    def load(self, key: EngineKey) -> LLM:
        if self._llm is not None and self._key == key:
            return self._llm
        if self._llm is not None:
            self._llm.close()
        self._llm = None  # free the old engine before building the next one
        settings = self.settings
        started = time.monotonic()
        self._llm = LLM(
            model=key.model,
            dtype=key.dtype,
            quantization=key.quantization,
            kv_cache_dtype=key.kv_cache_dtype,
            int8_backend=settings.int8_backend,
            max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            kv_cache_memory_gb=settings.kv_cache_memory_gb,
            num_threads=settings.num_threads,
            enable_prefix_caching=settings.enable_prefix_caching,
            enable_speculation=settings.enable_speculation,
            cache_dir=str(settings.models_dir),
            engine_thread=True,  # loaded on the main thread, run on the pool's: keep torch on one thread
        )
        self._key = key
        log.info("loaded %s in %.1fs", key, time.monotonic() - started)
        return self._llm

    @property
    def loaded(self) -> LLM | None:
        """The engine now in memory, if any (read by the metrics endpoint)."""
        return self._llm

    @property
    def loaded_model(self) -> str | None:
        return self._key.model if self._key is not None else None

    def default_key(self, model: str) -> EngineKey:
        settings = self.settings
        return EngineKey(model, settings.dtype, settings.quantization, settings.kv_cache_dtype)
