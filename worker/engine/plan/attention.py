"""Decode and prefill attention: the compiled CPU kernel or torch's path, whichever measured faster here.

The compiled kernels (kernels/csrc) exist per ISA tier and normally win by 2-3x; measuring keeps a
machine where they do not (an untuned tier, a head_dim they run slowly) on the faster path. Timed at
load on the model's head layout with a filled INT8 or float cache (a decode batch and a prefill step),
cached with the other measurements (measure.py). A measurement disturbed by other processes is neither
cached nor trusted: the compiled kernels are kept.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kernels import (
    cpu_decode_attention,
    cpu_prefill_attention,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv_cache,
)
from worker.engine.attention import KVCache
from worker.engine.config import ModelConfig
from worker.engine.plan.measure import CacheEntry
from worker.engine.plan.timing import best_seconds

DECODE_SEQS, DECODE_CONTEXT = 32, 256  # a decode batch's shape
# a prefill step's shape: chunks of new tokens behind a cached prefix, as prefix caching makes of every row of
# a job after the first (the chat template's block at least). Timed without the prefix, torch's SDPA won by
# 1.2x on the AMX VM; with it, SDPA runs one masked product per sequence over a dequantized copy of its
# cache and ran the 256-request bench's prefill attention 1.8x slower than the compiled kernel.
PREFILL_SEQS, PREFILL_LEN, PREFILL_CACHED = 4, 128, 32
BLOCK_SIZE = 16
TIMINGS = ("decode/compiled", "decode/torch", "prefill/compiled", "prefill/torch")


@dataclass(frozen=True)
class AttentionChoice:
    compiled_decode: bool
    compiled_prefill: bool
    seconds: dict[str, float]  # "decode/compiled", "decode/torch", "prefill/compiled", "prefill/torch"


@torch.inference_mode()
def measure_attention(model: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = model.num_heads, model.num_kv_heads, model.head_dim
    blocks_per_seq = DECODE_CONTEXT // BLOCK_SIZE
    one_layer = ModelConfig(**(asdict(model) | {"num_layers": 1}))
    cache = KVCache(one_layer, DECODE_SEQS * blocks_per_seq, BLOCK_SIZE, kv_dtype, torch.device("cpu"))
    key_cache, value_cache, key_scales, value_scales = cache.layer(0)
    slots = torch.arange(DECODE_SEQS * DECODE_CONTEXT)
    fill = torch.randn(len(slots), kv_heads, dim, generator=generator).to(dtype)
    write_kv_cache(fill, fill, key_cache, value_cache, slots, key_scales, value_scales)
    tables = torch.arange(DECODE_SEQS * blocks_per_seq, dtype=torch.int32).view(DECODE_SEQS, blocks_per_seq)
    query = torch.randn(DECODE_SEQS, heads, dim, generator=generator).to(dtype)
    lens = torch.full((DECODE_SEQS,), DECODE_CONTEXT, dtype=torch.int32)
    scale = dim**-0.5
    seconds = {}
    for compiled in (True, False):
        seconds[f"decode/{'compiled' if compiled else 'torch'}"] = best_seconds(lambda c=compiled: paged_decode_attention(
            query, key_cache, value_cache, tables, lens, scale, key_scales, value_scales, compiled=c))  # fmt: skip
    tokens = PREFILL_SEQS * PREFILL_LEN
    q = torch.randn(tokens, heads, dim, generator=generator).to(dtype)
    kv = torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype)
    starts = torch.arange(0, tokens + 1, PREFILL_LEN, dtype=torch.int32)
    seq_lens = torch.full((PREFILL_SEQS,), PREFILL_CACHED + PREFILL_LEN, dtype=torch.int32)
    for compiled in (True, False):
        seconds[f"prefill/{'compiled' if compiled else 'torch'}"] = best_seconds(lambda c=compiled: paged_prefill_attention(
            q, key_cache, value_cache, tables[:PREFILL_SEQS], starts, seq_lens, scale, key_scales, value_scales,
            key=kv, value=kv, compiled=c))  # fmt: skip
    return seconds


def choose_attention(model: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype, entry: CacheEntry) -> AttentionChoice:
    """Measured (or cached) on CPU when a compiled kernel exists; torch's path otherwise."""
    query = torch.empty(1, 1, model.head_dim, dtype=dtype)
    if not cpu_decode_attention.available() and not cpu_prefill_attention.supports(query, query):
        return AttentionChoice(compiled_decode=False, compiled_prefill=False, seconds={})
    measured = entry.measure(lambda: measure_attention(model, dtype, kv_dtype), lambda s: set(TIMINGS) <= s.keys())
    seconds = measured.seconds
    if measured.contended:
        # a busy neighbour makes either timing arbitrary (torch's path once measured faster and then ran
        # decode attention 40x slower): the kernels' usual win stands until a quiet start measures
        return AttentionChoice(compiled_decode=True, compiled_prefill=True, seconds=seconds)
    return AttentionChoice(
        compiled_decode=seconds["decode/compiled"] <= seconds["decode/torch"],
        compiled_prefill=seconds["prefill/compiled"] <= seconds["prefill/torch"],
        seconds=seconds,
    )
