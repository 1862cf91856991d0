"""Up to which batch size the INT8 projections run our small-batch product instead of the library GEMM.

A decode step of a few sequences (the tail of a shard, a job of a few long documents) is bound by
reading the weights once; the library GEMMs are not built for that (oneDNN's qlinear loses to float32 up to
16 rows on the 2-core AVX2 VM), our kernel is (kernels/cpu_int8_small_batch.py). Where the crossover lies
depends on the machine and the shapes, so it is measured at load on the model's layer shapes, with
enough layers cycled through (POOL_BYTES of weights) that they come from memory as in a real step, and
cached with the other measurements (measure.py). Both paths multiply the same codes exactly, so the
threshold changes speed, never outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import (
    cpu_int8_gemm_amx,
    cpu_int8_linear,
    cpu_int8_small_batch,
    int8_linear,
    quantize_weight_per_channel,
)
from worker.engine.config import DTYPES, ModelConfig
from worker.engine.plan.measure import CacheEntry
from worker.engine.plan.shapes import expert_products, layer_products
from worker.engine.plan.timing import best_seconds

# batch sizes compared: decode steps up to 128 rows, and the larger steps of drafts and prefill chunks, where
# the VNNI tier's panel product can still beat the library GEMM
ROWS = (1, 4, 16, 32, 64, 128, 256, 1024, 4096)
POOL_BYTES = 64 << 20  # int8 weights cycled through per timing: more than a server CPU's L3
COMPUTE_BOUND_ROWS = 256  # from here a product is bound by arithmetic: one layer's weights are timed, not a pool


@dataclass(frozen=True)
class SmallBatchChoice:
    rows: int  # products of at most this many rows take the small-batch kernel (0: never)
    seconds: dict[str, float]  # "<rows>/small", "<rows>/library": one pass over the pool's projections

    def fastest(self) -> dict[int, float]:
        """Seconds of one pass at each measured batch size, by the faster of the two paths."""
        best = {}
        for m in ROWS:
            times = [self.seconds[key] for key in (f"{m}/small", f"{m}/library") if key in self.seconds]
            if times:
                best[m] = min(times)
        return best


def _projection_shapes(model: ModelConfig) -> list[tuple[int, int]]:
    """[N, K] of the four products a decode row streams per layer: fused qkv, o, and gate/up and down (of
    an expert, in an MoE model: a decode row streams top-k of them per layer)."""
    dense = [p.shape for p in layer_products(model)]
    experts = [p.shape for p in expert_products(model)]
    return dense[:2] + experts[1:] if experts else dense


@torch.inference_mode()
def measure_small_batch(model: ModelConfig, dtype: str, int8_backend: str) -> dict[str, float]:
    """Seconds of one pass over the pool's products at each of ROWS, small-batch kernel vs library GEMM."""
    gen = torch.Generator().manual_seed(0)
    shapes = _projection_shapes(model)
    layer_bytes = sum(n * k for n, k in shapes)
    layers = max(1, min(model.num_layers, -(-POOL_BYTES // layer_bytes)))
    qmax = cpu_int8_linear.weight_qmax() if int8_backend == "onednn" else 127
    weights = []  # (the small-batch weights, scale [N] float32, the library product)
    for _ in range(layers):
        for n, k in shapes:
            codes, scale = quantize_weight_per_channel(torch.randn(n, k, generator=gen), qmax)
            prepared = cpu_int8_small_batch.prepare(codes)  # as the engine's layers take them
            weights.append((prepared, scale, _library_product(codes, scale, int8_backend)))
    seconds: dict[str, float] = {}
    for rows in ROWS:
        inputs = {k: torch.randn(rows, k, generator=gen).to(DTYPES[dtype]) for _, k in shapes}
        timed = weights[: len(shapes)] if rows >= COMPUTE_BOUND_ROWS else weights

        def small(inputs: dict[int, torch.Tensor] = inputs, timed: list = timed) -> None:
            for prepared, scale, _ in timed:
                cpu_int8_small_batch.int8_linear_small_batch(inputs[prepared.in_features], prepared, scale)

        def library(inputs: dict[int, torch.Tensor] = inputs, timed: list = timed) -> None:
            for prepared, _, product in timed:
                product(inputs[prepared.in_features])

        passes = len(weights) / len(timed)  # one layer timed stands for the pool's passes over its layers
        seconds[f"{rows}/small"] = best_seconds(small) * passes
        seconds[f"{rows}/library"] = best_seconds(library) * passes
    return seconds


def _library_product(codes: torch.Tensor, scale: torch.Tensor, int8_backend: str) -> Callable[[torch.Tensor], object]:
    if int8_backend == "onednn":
        packed = cpu_int8_linear.prepack_codes(codes, scale)
        return lambda x: cpu_int8_linear.int8_linear_onednn(x, packed)
    if int8_backend == "amx" and cpu_int8_gemm_amx.supports(codes):  # else int_mm, as make_linear falls back
        tiles = cpu_int8_gemm_amx.pack(codes)
        return lambda x: cpu_int8_gemm_amx.int8_linear_amx(x, tiles, scale)
    w_q_t = codes.t()
    return lambda x: int8_linear(x, w_q_t, scale)


def rows_from(seconds: dict[str, float]) -> int:
    """The largest measured batch size at which the small-batch kernel won, as it did at every smaller one."""
    rows = 0
    for m in ROWS:
        if seconds[f"{m}/small"] > seconds[f"{m}/library"]:
            break
        rows = m
    return rows


def covers_every_row_count(seconds: dict[str, float]) -> bool:
    return all(f"{m}/{path}" in seconds for m in ROWS for path in ("small", "library"))


def choose_small_batch(model: ModelConfig, dtype: str, int8_backend: str, entry: CacheEntry) -> SmallBatchChoice:
    """Measured (or cached) on CPU when the kernel is built; never otherwise."""
    if not cpu_int8_small_batch.available():
        return SmallBatchChoice(rows=0, seconds={})
    measured = entry.measure(lambda: measure_small_batch(model, dtype, int8_backend), covers_every_row_count)
    return SmallBatchChoice(rows=rows_from(measured.seconds), seconds=measured.seconds)
