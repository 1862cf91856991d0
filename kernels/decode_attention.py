"""Paged attention for decode: one new query token per sequence against its cached keys and values.

Query head h reads kv head h // (num_heads // num_kv_heads) (grouped-query attention). Softmax and
accumulation run in float32; int8 caches are dequantized inside attention (scales folded into the scores
and into the probabilities). Slots past a sequence's context, and block-table entries past it, are never
used as data: they may hold anything, NaN included.
"""

from __future__ import annotations

import math

import torch

from kernels import cpu_decode_attention
from kernels._checks import (
    PagedCacheLayout,
    check_attention_heads,
    check_float_tensor,
    check_index_tensor,
    check_paged_cache,
    check_same_device,
)
from kernels._dispatch import select_backend
from kernels._triton import jit, next_power_of_2, require_triton_device, tl, upcast_dot

# Elements (rows x head_dim) of K gathered per chunk of sequences on CPU: chunks whose gathered K and V
# stay in cache beat one batch-wide gather (measured on the 2-core CPU; see scripts/kernel_bench.py --cpu).
CPU_CHUNK_ELEMENTS = 1 << 20


@jit
def _paged_decode_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    q_ptr,  # [num_seqs, num_heads, head_dim], last dim contiguous
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float (QUANTIZED only)
    v_scale_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    context_lens_ptr,  # [num_seqs] int32
    scale_log2,  # softmax scale * log2(e): the kernel uses exp2
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_bt,
    num_kv_heads,
    head_dim,
    block_size,
    group_size,
    QUANTIZED: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (sequence, kv head): the group's query heads share each K/V tile it loads.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * group_size + g
    q_mask = (g < group_size)[:, None] & (d < head_dim)[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], -1e30, dtype=tl.float32)  # finite: exp2 of (-inf) - (-inf) would be NaN
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(0, context_len, BLOCK_N):
        pos = start + n
        valid = pos < context_len
        block_ids = tl.load(block_tables_ptr + seq * stride_bt + pos // block_size, mask=valid, other=0)
        slots = block_ids.to(tl.int64) * block_size + pos % block_size  # [BLOCK_N]
        kv_offsets = (slots[:, None] * num_kv_heads + kv_head) * head_dim + d[None, :]
        kv_mask = valid[:, None] & (d < head_dim)[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)  # int8 is exact in bf16
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N] float32
        if QUANTIZED:
            k_scale = tl.load(k_scale_ptr + slots * num_kv_heads + kv_head, mask=valid, other=0.0).to(
                tl.float32
            )
            scores = scores * k_scale[None, :]
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        if QUANTIZED:
            v_scale = tl.load(v_scale_ptr + slots * num_kv_heads + kv_head, mask=valid, other=0.0).to(
                tl.float32
            )
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    out_offsets = seq * stride_os + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check_decode_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_scale_cache: torch.Tensor | None,
    v_scale_cache: torch.Tensor | None,
) -> tuple[PagedCacheLayout, int]:
    layout = check_paged_cache(key_cache, value_cache, k_scale_cache, v_scale_cache)
    check_float_tensor("query", query, 3)
    group = check_attention_heads(query, layout)
    num_seqs = query.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}"
        )
    check_index_tensor("block_tables", block_tables, torch.int32, tuple(block_tables.shape))
    check_index_tensor("context_lens", context_lens, torch.int32, (num_seqs,))
    check_same_device(query=query, key_cache=key_cache, block_tables=block_tables, context_lens=context_lens)
    return layout, group


def paged_decode_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    layout, group = _check_decode_args(
        query, key_cache, value_cache, block_tables, context_lens, k_scale_cache, v_scale_cache
    )
    require_triton_device(query, key_cache)
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    _paged_decode_kernel[(query.shape[0], layout.num_kv_heads)](
        out, query, key_cache, value_cache,
        k_scale_cache if layout.quantized else key_cache, v_scale_cache if layout.quantized else value_cache,
        block_tables, context_lens, scale * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        layout.num_kv_heads, layout.head_dim, layout.block_size, group,
        QUANTIZED=layout.quantized,
        UPCAST_DOT=upcast_dot(query.dtype),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or upcast_dot(query.dtype) else "tf32",
        BLOCK_G=max(16, next_power_of_2(group)),  # tl.dot needs at least 16 rows
        BLOCK_D=max(16, next_power_of_2(layout.head_dim)),
        BLOCK_N=block_n,
    )  # fmt: skip
    return out


def compute_dtype(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """Matmul dtype of the CPU paths. int8 caches: float32 (int8 -> float32 converts as fast as int8 -> bf16
    here, and dequantized values and scores stay float32); float caches: the wider of query and cache (no
    conversion pass for bf16)."""
    return torch.float32 if cache_dtype == torch.int8 else torch.promote_types(query_dtype, cache_dtype)


def gather_head_major(
    cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, dtype: torch.dtype
) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, D] cache, num_seqs * n block ids -> [kv_heads, num_seqs, n * block_size, D].

    Whole blocks are gathered (one row copy per block), then one copy converts dtype and moves kv heads
    first, so that each (head, sequence) matrix is contiguous for the batched matmuls.
    """
    _, block_size, num_kv_heads, head_dim = cache.shape
    blocks = cache.view(cache.shape[0], -1).index_select(0, block_ids)
    tokens = blocks.view(num_seqs, -1, num_kv_heads, head_dim)
    out = torch.empty((num_kv_heads, num_seqs, tokens.shape[1], head_dim), dtype=dtype, device=cache.device)
    return out.copy_(tokens.permute(2, 0, 1, 3))


def gather_scales(scale_cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """scale_cache [num_blocks, block_size, kv_heads] -> [kv_heads, num_seqs, 1, n * block_size] (a view)."""
    scales = scale_cache.view(scale_cache.shape[0], -1).index_select(0, block_ids)
    return scales.view(num_seqs, -1, scale_cache.shape[2]).permute(2, 0, 1).unsqueeze(2)


def _decode_chunk(
    q: torch.Tensor,  # [kv_heads, n, group, D] in the compute dtype, softmax scale folded in
    block_ids: torch.Tensor,  # [n * blocks] safe block ids
    context_lens: torch.Tensor,  # [n]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale_cache: torch.Tensor | None,
    v_scale_cache: torch.Tensor | None,
) -> torch.Tensor:
    n = q.shape[1]
    k = gather_head_major(key_cache, block_ids, n, q.dtype)  # [kv_heads, n, L, D]
    v = gather_head_major(value_cache, block_ids, n, q.dtype)
    length = k.shape[2]
    past_context = torch.arange(length, device=q.device) >= context_lens[:, None]  # [n, L]
    scores = torch.matmul(q, k.transpose(-1, -2)).float()  # [kv_heads, n, group, L]
    if k_scale_cache is not None:
        scores.mul_(gather_scales(k_scale_cache, block_ids, n))
    probs = torch.softmax(scores.masked_fill_(past_context.view(1, n, 1, length), float("-inf")), dim=-1)
    # Slots past the context were never written and may hold NaN (torch.empty caches, arbitrary scales):
    # zero them where they meet the zero probabilities, since 0 * NaN = NaN.
    if v_scale_cache is not None:
        probs.mul_(gather_scales(v_scale_cache, block_ids, n)).masked_fill_(
            past_context.view(1, n, 1, length), 0.0
        )
    else:
        v.masked_fill_(past_context.view(1, n, length, 1), 0.0)
    return torch.matmul(probs.to(q.dtype), v)  # [kv_heads, n, group, D]


def paged_decode_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    chunk_elements: int = CPU_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Sequences sorted by context length, in chunks of similar length: each chunk gathers its blocks once
    (up to its longest context) and runs two batched matmuls per kv head group."""
    layout, group = _check_decode_args(
        query, key_cache, value_cache, block_tables, context_lens, k_scale_cache, v_scale_cache
    )
    num_seqs = query.shape[0]
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    bs, kv_heads, head_dim = layout.block_size, layout.num_kv_heads, layout.head_dim
    dtype = compute_dtype(query.dtype, key_cache.dtype)
    order = torch.argsort(context_lens, descending=True)
    lens = context_lens.index_select(0, order)
    lens_list = lens.tolist()
    if lens_list[-1] < 1 or lens_list[0] > block_tables.shape[1] * bs:
        raise ValueError(
            f"context_lens must lie in [1, {block_tables.shape[1] * bs}] (block_tables width x block_size), "
            f"got {lens_list[-1]}..{lens_list[0]}"
        )
    max_blocks = -(-lens_list[0] // bs)
    # Table entries past a sequence's context are arbitrary: read the sequence's first block there instead.
    table = block_tables.index_select(0, order)[:, :max_blocks]
    past_end = torch.arange(max_blocks, device=table.device) >= (lens[:, None] + bs - 1) // bs
    table = torch.where(past_end, table[:, :1], table)
    q = (query.index_select(0, order).to(dtype) * scale).view(num_seqs, kv_heads, group, head_dim)
    q = q.transpose(0, 1)  # [kv_heads, num_seqs, group, D]
    sorted_out = torch.empty((num_seqs, kv_heads, group, head_dim), dtype=query.dtype, device=query.device)
    start = 0
    while start < num_seqs:
        num_blocks = -(-lens_list[start] // bs)  # the chunk's longest context comes first
        n = max(1, min(num_seqs - start, chunk_elements // (num_blocks * bs * kv_heads * head_dim)))
        chunk = slice(start, start + n)
        block_ids = table[chunk, :num_blocks].reshape(-1)
        chunk_out = _decode_chunk(
            q[:, chunk], block_ids, lens[chunk], key_cache, value_cache, k_scale_cache, v_scale_cache
        )
        sorted_out[chunk] = chunk_out.transpose(0, 1)
        start += n
    return out.index_copy_(0, order, sorted_out.view(num_seqs, -1, head_dim))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    compiled: bool = True,
) -> torch.Tensor:
    """query [num_seqs, num_heads, head_dim] -> out [num_seqs, num_heads, head_dim] in query dtype.

    block_tables [num_seqs, max_blocks] int32; context_lens [num_seqs] int32 >= 1, the current token's K/V
    already in the cache. Caches as in write_kv_cache. compiled=False keeps the CPU path on torch ops.
    """
    _check_decode_args(
        query, key_cache, value_cache, block_tables, context_lens, k_scale_cache, v_scale_cache
    )
    backend = select_backend(query, compiled_supports=cpu_decode_attention.available, compiled=compiled)
    if backend == "triton":
        attend = paged_decode_attention_triton
    elif backend == "compiled":
        attend = cpu_decode_attention.paged_decode_attention_cpu
    else:
        attend = paged_decode_attention_torch
    return attend(
        query, key_cache, value_cache, block_tables, context_lens, scale, k_scale_cache, v_scale_cache
    )
