"""The worker's engine pool builds engines from the settings."""

from __future__ import annotations

from dataclasses import fields

import pytest

from jobs.domain.engine_options import EngineOptions, setting_names
from jobs.domain.engine_settings import engine_options_of
from jobs.domain.settings import Settings
from kernels import cpu_int8_linear
from worker.llm_pool import EngineKey, LLMPool


@pytest.mark.skipif(not cpu_int8_linear.onednn_available(), reason="needs oneDNN's INT8 GEMM")
@pytest.mark.parametrize("backend", ["onednn", "int_mm"])
def test_a_pinned_int8_backend_reaches_the_engine(tiny_llama_dir, backend: str) -> None:
    """FREIGHT_INT8_BACKEND pins the GEMM the calibration would otherwise pick (two can measure alike), and
    every engine setting reaches the engine's config as the settings say (the key's fields as the key says)."""
    settings = Settings(int8_backend=backend, kv_cache_memory_gb=0.05, num_speculative_tokens=2, scheduling="fifo")
    pool = LLMPool(settings)
    llm = pool.load(EngineKey(str(tiny_llama_dir), "float32", "int8", "int8"))
    try:
        assert llm.engine.plan.scheme.int8_backend == backend
        from_key = dict(dtype="float32", quantization="int8", kv_cache_dtype="int8")
        assert {name: getattr(llm.config, name) for name in setting_names()} == engine_options_of(settings) | from_key
        assert (llm.config.num_speculative_tokens, llm.config.scheduling) == (2, "fifo")
    finally:
        llm.close()


@pytest.mark.unit
def test_the_engine_settings_are_the_engine_options() -> None:
    """Names, types, defaults and descriptions of the FREIGHT_ engine settings come from EngineOptions."""
    options = {spec.name: spec for spec in fields(EngineOptions)}
    for name in setting_names():
        field = Settings.model_fields[name]
        assert (field.default, field.description) == (options[name].default, options[name].metadata["doc"])
    assert Settings().model_dump(include=set(setting_names())) == {
        name: options[name].default for name in setting_names()
    }
    assert "max_model_len" not in setting_names()  # the settings' own: a cap on every model's context
