"""make_plan: every per-op choice of the engine on this machine, in one step (the engine's "plan" step)."""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.platform import active_tier
from worker.engine.config import DTYPES, EngineConfig, ModelConfig
from worker.engine.plan.attention import choose_attention
from worker.engine.plan.execution_plan import ExecutionPlan
from worker.engine.plan.invariance import invariance_rows
from worker.engine.plan.measure import CacheEntry, calibration_key
from worker.engine.plan.schemes import Scheme, choose_scheme, decode_rows
from worker.engine.plan.small_batch import choose_small_batch


def make_plan(config: EngineConfig, model: ModelConfig, device: torch.device, cache_dir: Path | None) -> ExecutionPlan:
    """Resolve every "auto" of `config` for `model` on `device`: measured on CPU (or read from the
    measurements cached in `cache_dir`; None: nothing cached), fixed on CUDA.

    Order matters: the scheme first (its dtype is what attention and the small-batch product are timed
    in), then attention and the small-batch threshold (CPU), then the invariance blocks (exact mode)."""
    key = calibration_key(model, decode_rows(config.max_num_seqs), config.kv_cache_dtype)
    chosen = choose_scheme(config, model, device, CacheEntry(cache_dir, key))
    scheme = chosen.scheme
    dtype = DTYPES[scheme.dtype]
    attention = small_batch = None
    if device.type == "cpu":
        kv_dtype = config.kv_torch_dtype(dtype)
        entry = CacheEntry(cache_dir, _attention_entry(model, config, dtype, kv_dtype))
        attention = choose_attention(model, dtype, kv_dtype, entry)
        if scheme.quantization == "int8" and config.small_batch_rows == "auto":
            entry = CacheEntry(cache_dir, _small_batch_entry(model, config, scheme))
            small_batch = choose_small_batch(model, scheme.dtype, scheme.int8_backend or "int_mm", entry)
    if config.small_batch_rows != "auto":
        small_rows = config.small_batch_rows
    else:
        small_rows = small_batch.rows if small_batch else 0
    exact = dtype == torch.float32 and scheme.quantization is None and device.type == "cpu"
    invariant_rows, wide_rows = invariance_rows(model, dtype, exact, config.batch_invariant_rows)
    return ExecutionPlan(
        tier="cuda" if device.type == "cuda" else active_tier(), scheme=scheme, head_dim=model.head_dim,
        source=chosen.source, seconds_per_token=chosen.seconds_per_token, best=chosen.best, attention=attention,
        small_batch=small_batch, small_batch_rows=small_rows, invariant_rows=invariant_rows, wide_rows=wide_rows,
    )  # fmt: skip


# The attention and small-batch entries are keyed without the KV dtype (the attention entry names it itself;
# the small-batch product reads no KV cache): one measurement serves every kv_cache_dtype.


def _attention_entry(model: ModelConfig, config: EngineConfig, dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    names = str(dtype).removeprefix("torch."), str(kv_dtype).removeprefix("torch.")
    return f"{calibration_key(model, decode_rows(config.max_num_seqs))}-attention-{names[0]}-{names[1]}"


def _small_batch_entry(model: ModelConfig, config: EngineConfig, scheme: Scheme) -> str:
    return f"{calibration_key(model, decode_rows(config.max_num_seqs))}-small-batch-{scheme.name.replace('/', '-')}"
