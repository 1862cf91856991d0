"""The worker's loaded model: built once per process and kept for every shard that asks for the same
engine configuration (a different quantization or KV dtype replaces it). Before building an engine the
pool inspects the model (worker/model_registry.py) and records it in the model registry: a model the
engine cannot load raises UnservableModel without a load, and the engine's context is the one the API
checks jobs against (served_models.model_context); where the KV pool cuts it, the pool records the cut one."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

from jobs.domain.engine_settings import engine_options_of
from jobs.domain.schemas import ResolvedParams
from jobs.domain.served_models import model_context, unservable
from jobs.domain.settings import Settings
from worker.engine import LLM
from worker.model_registry import ModelFacts, ModelRegistry, UnservableModel, inspect_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineKey:
    model: str
    dtype: str
    quantization: str | None
    kv_cache_dtype: str


class LLMPool:
    def __init__(self, settings: Settings, registry: ModelRegistry | None = None) -> None:
        self.settings = settings
        self.registry = registry  # None: what the pool makes of a model is not recorded
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

    def inspect(self, model: str) -> ModelFacts:
        """The model's facts from its config, recorded in the registry when the pool has one."""
        facts = inspect_model(model, self.settings.models_dir)
        if self.registry is not None:
            self.registry.record(facts)
        return facts

    def load(self, key: EngineKey) -> LLM:
        if self._llm is not None and self._key == key:
            return self._llm
        facts = self.inspect(key.model)
        if not facts.loadable:
            raise UnservableModel(unservable(key.model, facts.error or ""))
        if self._llm is not None:
            self._llm.close()
        self._llm = None  # free the old engine before building the next one
        settings = self.settings
        started = time.monotonic()
        self._llm = LLM(
            model=key.model,
            # every engine setting as the worker's settings say (they are derived from the engine's
            # options), then what this key and this model decide
            **engine_options_of(settings)
            | dict(
                dtype=key.dtype,
                quantization=key.quantization,
                kv_cache_dtype=key.kv_cache_dtype,
                max_model_len=model_context(facts.context_len, settings.max_model_len),
                cache_dir=str(settings.models_dir),
            ),
            engine_thread=True,  # loaded on the main thread, run on the pool's: keep torch on one thread
        )
        self._key = key
        log.info("loaded %s in %.1fs", key, time.monotonic() - started)
        if self._llm.engine.context_cut and self.registry is not None:
            # The KV pool, not the model, bounds the context (the engine cut it and said so): the API
            # checks jobs against what this worker serves.
            self.registry.record(replace(facts, context_len=self._llm.max_model_len))
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
