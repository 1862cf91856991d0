"""Paged decode attention as a compiled CPU kernel (C++ with OpenMP, built on first use).

The torch path (kernels/decode_attention.py) has to gather every sequence's blocks into a float copy
before its batched matmuls; at batch 256 that copy, not arithmetic, is most of a decode step. This
kernel reads each cached key and value row in place, converting INT8 in registers: one task per
sequence walks its blocks in order, reading each block (all kv heads of a slot side by side) as one
contiguous stretch while the next ones are prefetched, since blocks sit anywhere in the pool. Rows that
continue one sequence (speculation's decode row and draft tokens: the same block table, each row one
position further) form a run that reads the cache once; each row's arithmetic is what it would be alone,
so a run changes no result. With a sliding window a row attends only its last `window` slots and the walk
starts at the window's first block (older blocks may have been freed and reused); soft-capping maps each
score to soft_cap * tanh(score / soft_cap). On the AVX-512 tier, INT8 keys are scored against the query
rounded to INT8 per head, by VNNI (scores_int8_queries). It is compiled with torch.utils.cpp_extension the
first time it is needed (a C++ compiler and ninja are required); when that fails, or FREIGHT_CPU_KERNELS=0,
the torch path is used instead.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from kernels._cpu_build import build_extension


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here (logged once)."""
    return build_extension("freight_decode_attention_cpu", "decode_attention_cpu.cpp", fast_math=True)


def available() -> bool:
    return load_extension() is not None


def scores_int8_queries(cache_dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether this build scores INT8 keys against INT8 queries (kernels.reference.int8_query_reference):
    the AVX-512 build, which has VNNI, at head_dim 64, 128 or 256 and a compiled group size (the build says).
    Elsewhere the query stays float32."""
    extension = load_extension()
    return cache_dtype == torch.int8 and extension is not None and extension.scores_int8_queries(head_dim, group)


def paged_decode_attention_cpu(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] float or int8
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    k_scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size, kv_heads] float16 or float32
    v_scale_cache: torch.Tensor | None = None,
    *,
    window: int = 0,  # > 0: row i attends slots t with context_lens[i] - window <= t < context_lens[i]
    soft_cap: float = 0.0,  # > 0: each score s (scale applied) becomes soft_cap * tanh(s / soft_cap)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim] in query dtype
    """Arguments are checked by the caller (kernels.decode_attention.paged_decode_attention); window and
    soft_cap here (the kernel raises ValueError for negative ones). With a window, block-table entries of
    blocks wholly before it are never read: they may name any block, holding anything."""
    extension = load_extension()
    if extension is None:
        raise RuntimeError("the CPU decode-attention extension is not available")
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    q = (query.float() * scale).contiguous()
    extension.paged_decode_attention_cpu(
        q, key_cache.contiguous(), value_cache.contiguous(),
        None if k_scale_cache is None else k_scale_cache.contiguous(),
        None if v_scale_cache is None else v_scale_cache.contiguous(),
        block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous(), out,
        int(window), float(soft_cap),
    )  # fmt: skip
    return out.to(query.dtype)
