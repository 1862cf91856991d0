"""Paged attention for prefill, chunked prefill included: packed queries against cached prefix + this chunk.

Sequence i's queries are rows query_start_loc[i]:query_start_loc[i+1] of `query`; seq_lens[i] counts its
cached prefix plus this chunk, whose K/V are already in the cache. Query j of sequence i sits at position
seq_lens[i] - q_len_i + j and attends causally to keys 0..position.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from kernels import cpu_prefill_attention
from kernels._checks import (
    PagedCacheLayout,
    check_attention_heads,
    check_float_tensor,
    check_index_tensor,
    check_paged_cache,
    check_same_device,
)
from kernels._dispatch import select_backend
from kernels._triton import cdiv, jit, next_power_of_2, require_triton_device, tl, upcast_dot
from kernels.decode_attention import compute_dtype


@jit
def _paged_prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim], last dim contiguous
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float (QUANTIZED only)
    v_scale_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    scale_log2,  # softmax scale * log2(e): the kernel uses exp2
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    num_kv_heads,
    head_dim,
    block_size,
    group_size,
    QUANTIZED: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (tile of BLOCK_M queries, query head, sequence).
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len
    kv_head = head // group_size
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    q_mask = (m < q_len)[:, None] & (d < head_dim)[None, :]
    tokens = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    q_pos = prefix_len + m  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)  # finite: exp2 of (-inf) - (-inf) would be NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys any row of this tile may see; none for tiles past the sequence's queries (their stores are masked).
    end = tl.minimum(seq_len, prefix_len + (tile + 1) * BLOCK_M)
    end = tl.where(tile * BLOCK_M < q_len, end, 0)
    for start in range(0, end, BLOCK_N):
        pos = start + n
        valid = pos < end
        block_ids = tl.load(block_tables_ptr + seq * stride_bt + pos // block_size, mask=valid, other=0)
        slots = block_ids.to(tl.int64) * block_size + pos % block_size  # [BLOCK_N]
        kv_offsets = (slots[:, None] * num_kv_heads + kv_head) * head_dim + d[None, :]
        kv_mask = valid[:, None] & (d < head_dim)[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)  # int8 is exact in bf16
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] float32
        if QUANTIZED:
            k_scale = tl.load(k_scale_ptr + slots * num_kv_heads + kv_head, mask=valid, other=0.0).to(
                tl.float32
            )
            scores = scores * k_scale[None, :]
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores * scale_log2, float("-inf"))
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
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only in rows past q_len, never stored
    out_offsets = tokens[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check_prefill_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale_cache: torch.Tensor | None,
    v_scale_cache: torch.Tensor | None,
) -> tuple[PagedCacheLayout, int]:
    layout = check_paged_cache(key_cache, value_cache, k_scale_cache, v_scale_cache)
    check_float_tensor("query", query, 3)
    group = check_attention_heads(query, layout)
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_index_tensor("seq_lens", seq_lens, torch.int32, (num_seqs,))
    check_index_tensor("query_start_loc", query_start_loc, torch.int32, (num_seqs + 1,))
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}"
        )
    check_index_tensor("block_tables", block_tables, torch.int32, tuple(block_tables.shape))
    check_same_device(
        query=query, cache=key_cache, block_tables=block_tables, starts=query_start_loc, lens=seq_lens
    )
    return layout, group


def paged_prefill_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    layout, group = _check_prefill_args(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, k_scale_cache, v_scale_cache
    )
    require_triton_device(query, key_cache)
    out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if query.shape[0] == 0 or num_seqs == 0:
        return out
    max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())  # one device sync per call
    grid = (cdiv(max_q_len, block_m), query.shape[1], num_seqs)
    _paged_prefill_kernel[grid](
        out, query, key_cache, value_cache,
        k_scale_cache if layout.quantized else key_cache, v_scale_cache if layout.quantized else value_cache,
        block_tables, query_start_loc, seq_lens, scale * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        layout.num_kv_heads, layout.head_dim, layout.block_size, group,
        QUANTIZED=layout.quantized,
        UPCAST_DOT=upcast_dot(query.dtype),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or upcast_dot(query.dtype) else "tf32",
        BLOCK_M=block_m,
        BLOCK_D=max(16, next_power_of_2(layout.head_dim)),
        BLOCK_N=block_n,
    )  # fmt: skip
    return out


def _cached_rows(
    cache: torch.Tensor, scale_cache: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:  # [len(slots), kv_heads, head_dim] in dtype, dequantized from an INT8 cache
    _, _, num_kv_heads, head_dim = cache.shape
    rows = cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
    if scale_cache is None:
        return rows.to(dtype)
    scales = scale_cache.view(-1, num_kv_heads).index_select(0, slots)
    return (rows.float() * scales.float()[..., None]).to(dtype)


def _read_sequence(
    cache: torch.Tensor,
    scale_cache: torch.Tensor | None,
    block_ids: torch.Tensor,
    length: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The first `length` slots of one sequence: [kv_heads, length, head_dim] in `dtype` (a strided view)."""
    block_size = cache.shape[1]
    offsets = torch.arange(block_size, device=block_ids.device)
    slots = (block_ids.to(torch.int64)[:, None] * block_size + offsets).flatten()[:length]
    return _cached_rows(cache, scale_cache, slots, dtype).transpose(0, 1)


def _contexts(
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]: the chunks' own keys, row-aligned with the queries
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale_cache: torch.Tensor | None,
    v_scale_cache: torch.Tensor | None,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    starts: list[int],  # [num_seqs + 1] query rows
    lens: list[int],  # [num_seqs] context lengths
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # keys, values: [sum(lens), kv_heads, head_dim], chunk after chunk
    """Each chunk's whole context, packed: its cached prefix (read from the paged cache, dequantized) then
    its own keys and values (as computed, without the cache's rounding). Without a cached prefix in the step
    that is `key` and `value` themselves."""
    prefixes = [n - (end - start) for n, start, end in zip(lens, starts[:-1], starts[1:], strict=True)]
    if not any(prefixes):
        return key.to(dtype), value.to(dtype)
    block_size = key_cache.shape[1]
    prefix_lens = torch.tensor(prefixes)
    # slot of every prefix position, chunk after chunk
    chunk_of = torch.repeat_interleave(torch.arange(len(prefixes)), prefix_lens)
    prefix_starts = torch.cumsum(prefix_lens, 0) - prefix_lens
    positions = torch.arange(int(prefix_lens.sum())) - torch.repeat_interleave(prefix_starts, prefix_lens)
    blocks = block_tables.to(torch.int64)[chunk_of, positions // block_size]
    slots = (blocks * block_size + positions % block_size).to(key.device)
    # rows of cat([own, cached]) in context order: per chunk, its prefix's rows then its own
    num_tokens = key.shape[0]
    segment_first = torch.stack([prefix_starts + num_tokens, torch.tensor(starts[:-1])], 1).flatten()
    segment_lens = torch.stack([prefix_lens, torch.tensor(lens) - prefix_lens], 1).flatten()
    segment_at = torch.cumsum(segment_lens, 0) - segment_lens
    rows = torch.arange(int(segment_lens.sum())) + torch.repeat_interleave(segment_first - segment_at, segment_lens)
    rows = rows.to(key.device)
    keys = torch.cat([key.to(dtype), _cached_rows(key_cache, k_scale_cache, slots, dtype)])
    values = torch.cat([value.to(dtype), _cached_rows(value_cache, v_scale_cache, slots, dtype)])
    return keys.index_select(0, rows), values.index_select(0, rows)


def paged_prefill_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    compiled: bool = True,
) -> torch.Tensor:
    """The CPU path: with compiled=True and this step's own key/value, the compiled kernel attends for every
    chunk in one call (a cached prefix gathered from the paged cache in front of its own keys); otherwise one
    fused scaled_dot_product_attention per sequence (float32 accumulation in its CPU kernel).

    key/value [num_tokens, kv_heads, head_dim], when given, are this chunk's keys and values as they were
    written: the chunk attends to them directly, with no gather from the cache and no dequantization (and,
    with an INT8 cache, without its rounding); the SDPA path does so for chunks without a cached prefix.
    """
    layout, group = _check_prefill_args(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, k_scale_cache, v_scale_cache
    )
    out = torch.empty_like(query)
    if key is not None and value is not None and (key.shape != value.shape or key.shape[0] != query.shape[0]):
        raise ValueError(f"key and value must be [{query.shape[0]}, kv_heads, head_dim], got {tuple(key.shape)}")
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for seq, seq_len in enumerate(lens):
        if starts[seq + 1] - starts[seq] > seq_len or cdiv(seq_len, layout.block_size) > block_tables.shape[1]:
            raise ValueError(
                f"sequence {seq}: {starts[seq + 1] - starts[seq]} queries but seq_lens = {seq_len} with "
                f"{block_tables.shape[1]} blocks"
            )
    if compiled and cpu_prefill_attention.supports(query, key):
        q_lens = [end - start for start, end in zip(starts[:-1], starts[1:], strict=True)]
        keys, values = _contexts(
            key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, block_tables, starts, lens,
            query.dtype,
        )  # fmt: skip
        kv_starts = [0, *itertools.accumulate(lens[:-1])]
        cpu_prefill_attention.prefill_attention_cpu(
            query, keys, values, starts[:-1], q_lens, scale, out, kv_starts=kv_starts, kv_lens=lens
        )
        return out
    cache_dtype = compute_dtype(query.dtype, key_cache.dtype)
    for seq, seq_len in enumerate(lens):
        q_start, q_end = starts[seq], starts[seq + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = cdiv(seq_len, layout.block_size)
        if q_len == seq_len and key is not None and value is not None:
            dtype = query.dtype
            keys = key[q_start:q_end].transpose(0, 1).to(dtype)  # [kv_heads, seq_len, D]
            values = value[q_start:q_end].transpose(0, 1).to(dtype)
        else:
            dtype = cache_dtype
            block_ids = block_tables[seq, :num_blocks]
            keys = _read_sequence(key_cache, k_scale_cache, block_ids, seq_len, dtype)  # [kv_heads, seq_len, D]
            values = _read_sequence(value_cache, v_scale_cache, block_ids, seq_len, dtype)
        q = query[q_start:q_end].transpose(0, 1).to(dtype)  # [num_heads, q_len, D]
        if q_len == seq_len:
            mask, causal = None, True
        else:  # a cached prefix: query j sits at position seq_len - q_len + j
            positions = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask, causal = torch.arange(seq_len, device=query.device) <= positions[:, None], False
        attended = F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=group > 1,
        )  # fmt: skip
        out[q_start:q_end] = attended[0].transpose(0, 1)  # cast back to the query dtype
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    compiled: bool = True,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] packed -> out [num_tokens, num_heads, head_dim] in query dtype.

    query_start_loc [num_seqs + 1] int32; seq_lens [num_seqs] int32 (cached prefix + this chunk);
    block_tables [num_seqs, max_blocks] int32. Caches as in write_kv_cache. key/value: optionally this
    chunk's unquantized keys and values; the CPU paths attend to them (after a cached prefix read from the
    cache), the Triton kernel always reads the cache. compiled=False keeps the CPU path on torch's SDPA
    (the engine's choice when its calibration measured SDPA faster).
    """
    args = (query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, k_scale_cache,
            v_scale_cache)  # fmt: skip
    _check_prefill_args(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, k_scale_cache, v_scale_cache
    )
    backend = select_backend(
        query, compiled_supports=lambda: cpu_prefill_attention.supports(query, key), compiled=compiled
    )
    if backend == "triton":
        return paged_prefill_attention_triton(*args)
    # "compiled": the compiled kernel attends for every chunk (paged_prefill_attention_torch calls it)
    return paged_prefill_attention_torch(*args, key=key, value=value, compiled=backend == "compiled")
