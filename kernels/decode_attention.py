"""Paged attention for decode: one new query token per sequence against its cached keys and values.

Query head h reads kv head h // (num_heads // num_kv_heads) (grouped-query attention). Softmax and
accumulation run in float32; int8 caches are dequantized inside attention (scales folded into the scores
and into the probabilities). Slots past a sequence's context, and block-table entries past it, are never
used as data: they may hold anything, NaN included.

window W > 0: the query at position p = context_len - 1 attends to keys p - W < k <= p only. Block-table
entries of blocks wholly before that (every position < p - W + 1) may hold any in-range block id whose
content is arbitrary (the engine reuses those blocks): no path reads them. soft_cap c > 0: each scaled score
s becomes c * tanh(s / c) before masking and softmax (kernels/reference.py).
"""

from __future__ import annotations

import math

import torch

from kernels import cpu_decode_attention
from kernels._checks import (
    PagedCacheLayout,
    check_attention_heads,
    check_attention_options,
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
def soft_cap_tanh(scores, cap):
    """cap * tanh(scores / cap), elementwise in float32. tanh(y) = 1 - 2 / (e^(2y) + 1): exact at both
    ends (e^(2y) overflows to inf for large y, giving 1), and triton.language has no tanh of its own."""
    return cap * (1.0 - 2.0 / (tl.exp(scores * (2.0 / cap)) + 1.0))


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
    soft_cap_log2,  # soft cap * log2(e) (SOFT_CAP only): capping scores in log2 units
    window,  # sliding window (SLIDING only)
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
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
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
    # First visible key. With a window, tiles before it are skipped and positions before it are masked out
    # of every load: their blocks may have been reused (arbitrary ids, NaN content).
    first = context_len * 0
    if SLIDING:
        first = tl.maximum(context_len - window, 0)
    for start in range((first // BLOCK_N) * BLOCK_N, context_len, BLOCK_N):
        pos = start + n
        valid = pos < context_len
        if SLIDING:
            valid = valid & (pos >= first)
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
        scores = scores * scale_log2
        if SOFT_CAP:
            scores = soft_cap_tanh(scores, soft_cap_log2)
        scores = tl.where(valid[None, :], scores, float("-inf"))
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
    window: int = 0,
    soft_cap: float = 0.0,
) -> tuple[PagedCacheLayout, int]:
    check_attention_options(window, soft_cap)
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
    window: int = 0,
    soft_cap: float = 0.0,
    block_n: int = 64,
) -> torch.Tensor:
    layout, group = _check_decode_args(
        query, key_cache, value_cache, block_tables, context_lens, k_scale_cache, v_scale_cache, window,
        soft_cap,
    )  # fmt: skip
    window, soft_cap = check_attention_options(window, soft_cap)
    require_triton_device(query, key_cache)
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    _paged_decode_kernel[(query.shape[0], layout.num_kv_heads)](
        out, query, key_cache, value_cache,
        k_scale_cache if layout.quantized else key_cache, v_scale_cache if layout.quantized else value_cache,
        block_tables, context_lens, scale * math.log2(math.e), soft_cap * math.log2(math.e), window,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        layout.num_kv_heads, layout.head_dim, layout.block_size, group,
        QUANTIZED=layout.quantized,
        SLIDING=window > 0,
        SOFT_CAP=soft_cap > 0,
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
    ends: torch.Tensor,  # [n] gathered slots 0..ends-1 of each sequence are keys up to its query
    begins: torch.Tensor | None,  # [n] with a window: its first visible key among the gathered slots
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale_cache: torch.Tensor | None,
    v_scale_cache: torch.Tensor | None,
    soft_cap: float,
) -> torch.Tensor:
    n = q.shape[1]
    k = gather_head_major(key_cache, block_ids, n, q.dtype)  # [kv_heads, n, L, D]
    v = gather_head_major(value_cache, block_ids, n, q.dtype)
    length = k.shape[2]
    slot = torch.arange(length, device=q.device)
    hidden = slot >= ends[:, None]  # [n, L]
    if begins is not None:
        hidden |= slot < begins[:, None]
    scores = torch.matmul(q, k.transpose(-1, -2)).float()  # [kv_heads, n, group, L]
    if k_scale_cache is not None:
        scores.mul_(gather_scales(k_scale_cache, block_ids, n))
    if soft_cap > 0:
        scores = torch.tanh(scores.div_(soft_cap)).mul_(soft_cap)
    probs = torch.softmax(scores.masked_fill_(hidden.view(1, n, 1, length), float("-inf")), dim=-1)
    # Hidden slots may hold NaN (past the context: never written, torch.empty caches, arbitrary scales):
    # zero them where they meet the zero probabilities, since 0 * NaN = NaN.
    if v_scale_cache is not None:
        probs.mul_(gather_scales(v_scale_cache, block_ids, n)).masked_fill_(hidden.view(1, n, 1, length), 0.0)
    else:
        v.masked_fill_(hidden.view(1, n, length, 1), 0.0)
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
    window: int = 0,
    soft_cap: float = 0.0,
    chunk_elements: int = CPU_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Sequences sorted by the number of blocks they read, in chunks of similar counts: each chunk gathers
    its blocks once (up to its longest span) and runs two batched matmuls per kv head group. With a window a
    sequence reads only the blocks from the one holding its first visible key."""
    layout, group = _check_decode_args(
        query, key_cache, value_cache, block_tables, context_lens, k_scale_cache, v_scale_cache, window,
        soft_cap,
    )  # fmt: skip
    window, soft_cap = check_attention_options(window, soft_cap)
    num_seqs = query.shape[0]
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    bs, kv_heads, head_dim = layout.block_size, layout.num_kv_heads, layout.head_dim
    dtype = compute_dtype(query.dtype, key_cache.dtype)
    shortest, longest = (int(n) for n in context_lens.aminmax())
    if shortest < 1 or longest > block_tables.shape[1] * bs:
        raise ValueError(
            f"context_lens must lie in [1, {block_tables.shape[1] * bs}] (block_tables width x block_size), "
            f"got {shortest}..{longest}"
        )
    lens = context_lens.long()
    first_key = (lens - window).clamp_(min=0) if window > 0 else torch.zeros_like(lens)  # [num_seqs]
    first_block = first_key // bs
    spans = (lens - 1) // bs + 1 - first_block  # blocks each sequence reads
    order = torch.argsort(spans, descending=True)
    lens, first_key, first_block, spans = (
        t.index_select(0, order) for t in (lens, first_key, first_block, spans)
    )
    spans_list = spans.tolist()
    # Table columns first_block .. first_block + longest span - 1 of each sequence. Entries before the first
    # block are never read (the window), and entries past the sequence's last block are arbitrary: read the
    # sequence's first block there instead (its data is masked out).
    columns = first_block[:, None] + torch.arange(spans_list[0], device=lens.device)  # [num_seqs, max_span]
    past_end = columns >= first_block[:, None] + spans[:, None]
    table = block_tables.index_select(0, order).gather(1, columns.clamp_(max=block_tables.shape[1] - 1))
    table = torch.where(past_end, table[:, :1], table)
    gathered_from = first_block * bs  # position of each sequence's first gathered slot
    ends = lens - gathered_from
    begins = first_key - gathered_from if window > 0 else None
    q = (query.index_select(0, order).to(dtype) * scale).view(num_seqs, kv_heads, group, head_dim)
    q = q.transpose(0, 1)  # [kv_heads, num_seqs, group, D]
    sorted_out = torch.empty((num_seqs, kv_heads, group, head_dim), dtype=query.dtype, device=query.device)
    start = 0
    while start < num_seqs:
        num_blocks = spans_list[start]  # the chunk's longest span comes first
        n = max(1, min(num_seqs - start, chunk_elements // (num_blocks * bs * kv_heads * head_dim)))
        chunk = slice(start, start + n)
        block_ids = table[chunk, :num_blocks].reshape(-1)
        chunk_out = _decode_chunk(
            q[:, chunk], block_ids, ends[chunk], None if begins is None else begins[chunk], key_cache,
            value_cache, k_scale_cache, v_scale_cache, soft_cap,
        )  # fmt: skip
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
    window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """query [num_seqs, num_heads, head_dim] -> out [num_seqs, num_heads, head_dim] in query dtype.

    block_tables [num_seqs, max_blocks] int32; context_lens [num_seqs] int32 >= 1, the current token's K/V
    already in the cache. Caches as in write_kv_cache. compiled=False keeps the CPU path on torch ops.
    window: sliding window (0: none); soft_cap: attention-logit soft cap (0: none), as in the module doc.
    """
    _check_decode_args(
        query, key_cache, value_cache, block_tables, context_lens, k_scale_cache, v_scale_cache, window,
        soft_cap,
    )  # fmt: skip
    window, soft_cap = check_attention_options(window, soft_cap)
    backend = select_backend(query, compiled_supports=cpu_decode_attention.available, compiled=compiled)
    args = (query, key_cache, value_cache, block_tables, context_lens, scale, k_scale_cache, v_scale_cache)
    if backend == "triton":
        return paged_decode_attention_triton(*args, window=window, soft_cap=soft_cap)
    if backend == "compiled":
        # The options go by keyword and only when set: the compiled kernel without them still serves the rest.
        options = {name: setting for name, setting in (("window", window), ("soft_cap", soft_cap)) if setting}
        return cpu_decode_attention.paged_decode_attention_cpu(*args, **options)
    return paged_decode_attention_torch(*args, window=window, soft_cap=soft_cap)
