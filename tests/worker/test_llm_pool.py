"""The worker's engine pool builds engines from the settings."""

from __future__ import annotations

import pytest

from jobs.domain.settings import Settings
from kernels import cpu_int8_linear
from worker.llm_pool import EngineKey, LLMPool


@pytest.mark.skipif(not cpu_int8_linear.onednn_available(), reason="needs oneDNN's INT8 GEMM")
@pytest.mark.parametrize("backend", ["onednn", "int_mm"])
def test_a_pinned_int8_backend_reaches_the_engine(tiny_llama_dir, backend: str) -> None:
    """FREIGHT_INT8_BACKEND pins the GEMM the calibration would otherwise pick (two can measure alike)."""
    pool = LLMPool(Settings(int8_backend=backend, kv_cache_memory_gb=0.05))
    llm = pool.load(EngineKey(str(tiny_llama_dir), "float32", "int8", "int8"))
    try:
        assert llm.engine.plan.scheme.int8_backend == backend
    finally:
        llm.close()
