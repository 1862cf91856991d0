"""dtype/quantization "auto" (worker/engine/plan/schemes.py): measured choice, the cache under FREIGHT_HOME,
explicit choices honoured."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kernels import cpu_int8_gemm_amx
from worker.engine.config import EngineConfig, ModelConfig
from worker.engine.plan import timing
from worker.engine.plan.make import make_plan
from worker.engine.plan.measure import CacheEntry, calibration_key
from worker.engine.plan.schemes import (
    TIE_RATIO,
    SchemeChoice,
    candidate_schemes,
    choose_scheme,
    decode_rows,
    measure_schemes,
)

CPU = torch.device("cpu")
SMALL = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=256,
                    tie_word_embeddings=True)  # fmt: skip


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache every measurement here, even when other test processes keep the machine busy (the
    contention rule itself is tested in test_timing.py)."""
    monkeypatch.setattr(timing, "CONTENDED_SHARE", float("inf"))


def config(**options) -> EngineConfig:
    return EngineConfig(model="unused", **options)


def entry(folder: Path | None, config: EngineConfig) -> CacheEntry:
    """The scheme measurement's entry, named as make_plan names it."""
    return CacheEntry(folder, calibration_key(SMALL, decode_rows(config.max_num_seqs), config.kv_cache_dtype))


def plan_for(config: EngineConfig, model: ModelConfig, device: torch.device, folder: Path | None) -> SchemeChoice:
    return choose_scheme(config, model, device, entry(folder, config))


def write_cache(folder: Path, timings: dict[str, float]) -> None:
    entry(folder, config()).write(timings)


def every_scheme(seconds: float) -> dict[str, float]:
    return {s.name: seconds for s in candidate_schemes(CPU)}


def test_every_candidate_is_measured_on_the_model_shapes() -> None:
    candidates = candidate_schemes(CPU)
    assert {s.name for s in candidates} >= {"float32", "bfloat16", "float32+int8/int_mm"}
    if cpu_int8_gemm_amx.available():  # AMX machines measure the tile GEMM too
        assert "bfloat16+int8/amx" in {s.name for s in candidates}
    timings = measure_schemes(SMALL, candidates, decode_rows=8)
    assert set(timings) == {s.name for s in candidates}
    assert all(0 < t < 1 for t in timings.values())


def test_auto_measures_once_then_reads_the_cache(tmp_path: Path) -> None:
    first = plan_for(config(), SMALL, CPU, tmp_path)
    assert first.source == "measured"
    assert first.best == min(first.seconds_per_token, key=first.seconds_per_token.get)
    assert first.seconds_per_token[first.scheme.name] <= TIE_RATIO * first.seconds_per_token[first.best]
    again = plan_for(config(), SMALL, CPU, tmp_path)
    assert again.source == "cache" and again.scheme == first.scheme
    assert again.seconds_per_token == first.seconds_per_token


def test_auto_picks_the_fastest_measured_scheme(tmp_path: Path) -> None:
    timings = every_scheme(1.0) | {"bfloat16+int8/int_mm": 0.5}
    write_cache(tmp_path, timings)
    plan = plan_for(config(), SMALL, CPU, tmp_path)
    assert plan.scheme.name == "bfloat16+int8/int_mm" and plan.source == "cache"
    # auto on one axis only: the other stays as asked
    assert plan_for(config(dtype="float32"), SMALL, CPU, tmp_path).scheme.dtype == "float32"
    assert plan_for(config(quantization=None), SMALL, CPU, tmp_path).scheme.name in ("float32", "bfloat16")


def test_a_near_tie_goes_to_int8_weights_then_the_fastest(tmp_path: Path) -> None:
    # between INT8 schemes the fastest measured wins, however close
    write_cache(tmp_path, every_scheme(1.0) | {"bfloat16+int8/int_mm": 0.5, "float32+int8/int_mm": 0.505})
    assert plan_for(config(), SMALL, CPU, tmp_path).scheme.name == "bfloat16+int8/int_mm"
    write_cache(tmp_path, every_scheme(1.0) | {"bfloat16+int8/int_mm": 0.51, "float32+int8/int_mm": 0.5})
    assert plan_for(config(), SMALL, CPU, tmp_path).scheme.name == "float32+int8/int_mm"
    # unquantized float32 tied with an INT8 scheme: INT8 weights leave more memory to the KV cache
    write_cache(tmp_path, every_scheme(1.0) | {"float32": 0.5, "bfloat16+int8/int_mm": 0.52})
    assert plan_for(config(), SMALL, CPU, tmp_path).scheme.name == "bfloat16+int8/int_mm"


def test_an_explicit_slow_choice_is_honoured_with_a_warning(tmp_path: Path, caplog) -> None:
    write_cache(tmp_path, every_scheme(1.0) | {"float32": 0.25})
    with caplog.at_level(logging.WARNING, logger="worker.engine.plan.schemes"):
        plan = plan_for(config(dtype="bfloat16", quantization=None), SMALL, CPU, tmp_path)
    assert plan.scheme.name == "bfloat16"
    assert "4.0x slower than float32" in caplog.text


def test_an_explicit_choice_without_a_measurement_measures_nothing(tmp_path: Path) -> None:
    plan = plan_for(config(dtype="float32", quantization=None), SMALL, CPU, tmp_path)
    assert plan.source == "fixed" and plan.scheme.name == "float32"
    assert not list(tmp_path.iterdir())


def test_the_plan_names_the_path_of_every_op(tmp_path: Path) -> None:
    write_cache(tmp_path, every_scheme(1.0) | {"bfloat16+int8/int_mm": 0.5})
    plan = make_plan(config(small_batch_rows=0), SMALL, CPU, tmp_path)
    assert plan.scheme.name == "bfloat16+int8/int_mm" and plan.source == "cache"
    assert plan.paths()["projections"] == "W8A8 torch._int_mm (s8 x s8)"
    assert plan.small_batch is None and plan.small_batch_rows == 0  # pinned: nothing measured
    assert plan.invariant_rows == 0 and plan.wide_rows == ()  # INT8: no exact mode


def test_unknown_choices_are_refused() -> None:
    with pytest.raises(ValueError, match="dtype"):
        config(dtype="int4")
    with pytest.raises(ValueError, match="int8_backend"):
        config(int8_backend="cublas")


def test_cuda_auto_quantizes_wide_models_only() -> None:
    # no GPU needed: a CUDA plan is fixed, not measured
    wide = ModelConfig(**{**SMALL.__dict__, "hidden_size": 4096})
    cuda = torch.device("cuda")
    assert make_plan(config(), SMALL, cuda, None).scheme.name == "bfloat16"
    assert make_plan(config(), wide, cuda, None).scheme.name == "bfloat16+int8/triton"
    plan = make_plan(config(quantization="int8"), SMALL, cuda, None)
    assert plan.scheme.name == "bfloat16+int8/triton" and plan.tier == "cuda" and plan.source == "fixed"
    assert plan.attention is None and plan.small_batch is None
