"""The small-batch INT8 path: measured threshold, its cache, and that switching paths changes no output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import cpu_int8_gemm_amx, cpu_int8_linear, cpu_int8_small_batch
from worker.engine.config import ModelConfig
from worker.engine.plan import timing
from worker.engine.plan.measure import CacheEntry
from worker.engine.plan.small_batch import ROWS, choose_small_batch, measure_small_batch, rows_from
from worker.engine.quantization import make_linear

pytestmark = pytest.mark.skipif(not cpu_int8_small_batch.available(), reason="no C++ toolchain to build the kernel")

SMALL = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=256,
                    tie_word_embeddings=True)  # fmt: skip
BACKENDS = [
    "int_mm",
    *(["onednn"] if cpu_int8_linear.onednn_available() else []),
    *(["amx"] if cpu_int8_gemm_amx.available() else []),
]


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache every measurement here, even when other test processes keep the machine busy (the
    contention rule itself is tested in test_timing.py)."""
    monkeypatch.setattr(timing, "CONTENDED_SHARE", float("inf"))


def seconds(small_wins_up_to: int) -> dict[str, float]:
    timings = {}
    for m in ROWS:
        timings[f"{m}/small"] = 1.0 if m <= small_wins_up_to else 3.0
        timings[f"{m}/library"] = 2.0
    return timings


def test_threshold_is_the_last_win_of_an_unbroken_run() -> None:
    assert rows_from(seconds(0)) == 0
    assert rows_from(seconds(32)) == 32
    assert rows_from(seconds(10_000)) == ROWS[-1]
    broken = seconds(64) | {"4/small": 5.0}  # a loss at 4 rows ends the run there
    assert rows_from(broken) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_measured_once_then_read_from_the_cache(tmp_path: Path, backend: str) -> None:
    cache = CacheEntry(tmp_path, "small")
    first = choose_small_batch(SMALL, "float32", backend, cache)
    assert set(first.seconds) == {f"{m}/{path}" for m in ROWS for path in ("small", "library")}
    assert all(0 < t < 1 for t in first.seconds.values())
    assert first.rows == rows_from(first.seconds)
    assert cache.path.is_file()
    again = choose_small_batch(SMALL, "float32", backend, cache)
    assert again == first


def test_a_cached_measurement_decides(tmp_path: Path) -> None:
    cache = CacheEntry(tmp_path, "small")
    cache.write(seconds(16))
    assert choose_small_batch(SMALL, "float32", "int_mm", cache).rows == 16


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_either_path_gives_the_same_output(backend: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=gen)
    library = make_linear(weight, None, dtype, "int8", int8_backend=backend, small_batch_rows=0)
    small = make_linear(weight, None, dtype, "int8", int8_backend=backend, small_batch_rows=8)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        residual = torch.randn(rows, 96, generator=gen).to(dtype)
        assert small.small.takes(x) and not library.small.takes(x)
        assert torch.equal(small(x, residual=residual), library(x, residual=residual))
        assert torch.equal(small.gated_mul(x), library.gated_mul(x))
        assert torch.equal(small.gated_mul(x, "gelu_tanh"), library.gated_mul(x, "gelu_tanh"))
    assert not small.small.takes(torch.zeros(9, 64))
    # a gate/up weight only used through gated_mul (the AMX backend packs it in gated blocks)
    gated_library = make_linear(weight, None, dtype, "int8", int8_backend=backend, small_batch_rows=0, gated=True)
    gated_small = make_linear(weight, None, dtype, "int8", int8_backend=backend, small_batch_rows=8, gated=True)
    for rows in (1, 8, 40):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        assert torch.equal(gated_small.gated_mul(x), gated_library.gated_mul(x))


def test_measurement_covers_every_row_count() -> None:
    timings = measure_small_batch(SMALL, "float32", "int_mm")
    assert len(timings) == 2 * len(ROWS)
