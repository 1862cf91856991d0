"""Paged attention for prefill, chunked prefill included: packed queries against cached prefix + this chunk.

Sequence i's queries are rows query_start_loc[i]:query_start_loc[i+1] of `query`; seq_lens[i] counts its
cached prefix plus this chunk, whose K/V are already in the cache. Query j of sequence i sits at position
seq_lens[i] - q_len_i + j and attends causally to keys 0..position.

window W > 0: the query at position p attends to keys p - W < k <= p only. Block-table entries of blocks
wholly before the window of the sequence's first query in the step (every position < seq_lens[i] - q_len_i
- W + 1) may hold any in-range block id whose content is arbitrary (the engine reuses those blocks): no path
reads them. soft_cap c > 0: each scaled score s becomes c * tanh(s / c) before masking and softmax.
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
    check_attention_options,
    check_float_tensor,
    check_index_tensor,
    check_paged_cache,
    check_same_device,
)
from kernels._dispatch import select_backend
from kernels._triton import cdiv, jit, next_power_of_2, require_triton_device, tl, upcast_dot
from kernels.decode_attention import compute_dtype, soft_cap_tanh

# Scores the explicit (soft-capped) CPU attention holds at once: query rows are taken in chunks of this size.
SOFT_CAP_CHUNK_ELEMENTS = 1 << 22


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
    soft_cap_log2,  # soft cap * log2(e) (SOFT_CAP only): capping scores in log2 units
    window,  # sliding window (SLIDING only)
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
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
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
    # With a window, the first key the tile's first row sees: tiles of keys before it are skipped and
    # positions before it masked out of every load (their blocks may have been reused: arbitrary content).
    first = end * 0
    if SLIDING:
        first = tl.maximum(prefix_len + tile * BLOCK_M - window + 1, 0)
    for start in range((first // BLOCK_N) * BLOCK_N, end, BLOCK_N):
        pos = start + n
        valid = pos < end
        if SLIDING:
            valid = valid & (pos >= first)
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
        if SLIDING:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        scores = scores * scale_log2
        if SOFT_CAP:
            scores = soft_cap_tanh(scores, soft_cap_log2)
        scores = tl.where(visible, scores, float("-inf"))
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
    window: int = 0,
    soft_cap: float = 0.0,
) -> tuple[PagedCacheLayout, int]:
    check_attention_options(window, soft_cap)
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
    window: int = 0,
    soft_cap: float = 0.0,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    layout, group = _check_prefill_args(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, k_scale_cache, v_scale_cache,
        window, soft_cap,
    )  # fmt: skip
    window, soft_cap = check_attention_options(window, soft_cap)
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
        block_tables, query_start_loc, seq_lens, scale * math.log2(math.e), soft_cap * math.log2(math.e),
        window, query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        layout.num_kv_heads, layout.head_dim, layout.block_size, group,
        QUANTIZED=layout.quantized,
        SLIDING=window > 0,
        SOFT_CAP=soft_cap > 0,
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
    table: torch.Tensor,
    start: int,
    end: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Slots start..end-1 of the sequence with block-table row `table`: [kv_heads, end - start, head_dim]
    in `dtype` (a strided view). Blocks before `start` are not read."""
    block_size = cache.shape[1]
    positions = torch.arange(start, end, device=table.device)
    slots = table.to(torch.int64)[positions // block_size] * block_size + positions % block_size
    return _cached_rows(cache, scale_cache, slots, dtype).transpose(0, 1)


def first_visible_key(position: int, window: int) -> int:
    """The first key position the query at `position` attends to (window 0: none, all from 0)."""
    return max(0, position - window + 1) if window > 0 else 0


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
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Each chunk's context, packed: the part of its cached prefix that its queries can see (read from the
    paged cache, dequantized; with a window, from its first query's first visible key on) then its own keys
    and values (as computed, without the cache's rounding). Without a visible cached prefix in the step
    that is `key` and `value` themselves.

    Returns keys and values [sum(context lens), kv_heads, head_dim], chunk after chunk, and each chunk's
    context length: its queries are the last q_len rows of its context.
    """
    q_lens = [end - start for start, end in zip(starts[:-1], starts[1:], strict=True)]
    # prefix rows each chunk skips (before its first query's window) and keeps
    skips = [first_visible_key(n - q, window) for n, q in zip(lens, q_lens, strict=True)]
    prefixes = [n - q - skip for n, q, skip in zip(lens, q_lens, skips, strict=True)]
    kv_lens = [prefix + q for prefix, q in zip(prefixes, q_lens, strict=True)]
    if not any(prefixes):
        return key.to(dtype), value.to(dtype), kv_lens
    block_size = key_cache.shape[1]
    prefix_lens = torch.tensor(prefixes)
    # slot of every kept prefix position, chunk after chunk
    chunk_of = torch.repeat_interleave(torch.arange(len(prefixes)), prefix_lens)
    prefix_starts = torch.cumsum(prefix_lens, 0) - prefix_lens
    # packed row r of chunk c holds prefix position r - prefix_starts[c] + skips[c]
    offsets = torch.repeat_interleave(torch.tensor(skips) - prefix_starts, prefix_lens)
    positions = torch.arange(int(prefix_lens.sum())) + offsets
    blocks = block_tables.to(torch.int64)[chunk_of, positions // block_size]
    slots = (blocks * block_size + positions % block_size).to(key.device)
    # rows of cat([own, cached]) in context order: per chunk, its prefix's rows then its own
    num_tokens = key.shape[0]
    segment_first = torch.stack([prefix_starts + num_tokens, torch.tensor(starts[:-1])], 1).flatten()
    segment_lens = torch.stack([prefix_lens, torch.tensor(q_lens)], 1).flatten()
    segment_at = torch.cumsum(segment_lens, 0) - segment_lens
    rows = torch.arange(int(segment_lens.sum())) + torch.repeat_interleave(segment_first - segment_at, segment_lens)
    rows = rows.to(key.device)
    keys = torch.cat([key.to(dtype), _cached_rows(key_cache, k_scale_cache, slots, dtype)])
    values = torch.cat([value.to(dtype), _cached_rows(value_cache, v_scale_cache, slots, dtype)])
    return keys.index_select(0, rows), values.index_select(0, rows), kv_lens


def _soft_capped_attention(
    q: torch.Tensor,  # [num_heads, q_len, D]
    keys: torch.Tensor,  # [kv_heads, L, D]
    values: torch.Tensor,  # [kv_heads, L, D]
    visible: torch.Tensor,  # [q_len, L] bool
    scale: float,
    soft_cap: float,
) -> torch.Tensor:  # [num_heads, q_len, D] float32
    """Attention with capped scores, which SDPA cannot apply: float32 scores, softmax and accumulation, a
    chunk of query rows at a time so that the scores stay small."""
    kv_heads, length, head_dim = keys.shape
    num_heads, q_len = q.shape[:2]
    group = num_heads // kv_heads
    q = q.float().reshape(kv_heads, group, q_len, head_dim)
    keys_t = keys.float().transpose(-1, -2).unsqueeze(1)  # [kv_heads, 1, D, L]
    values = values.float().unsqueeze(1)  # [kv_heads, 1, L, D]
    out = torch.empty((kv_heads, group, q_len, head_dim), dtype=torch.float32, device=q.device)
    rows = max(1, SOFT_CAP_CHUNK_ELEMENTS // (num_heads * length))
    for first in range(0, q_len, rows):
        chunk = slice(first, first + rows)
        scores = torch.matmul(q[:, :, chunk], keys_t).mul_(scale)  # [kv_heads, group, rows, L]
        scores = torch.tanh(scores.div_(soft_cap)).mul_(soft_cap)
        scores.masked_fill_(~visible[chunk], float("-inf"))  # every row sees itself: no row is all -inf
        out[:, :, chunk] = torch.matmul(torch.softmax(scores, dim=-1), values)
    return out.view(num_heads, q_len, head_dim)


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
    window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """The CPU path: with compiled=True and this step's own key/value, the compiled kernel attends for every
    chunk in one call (the visible part of a cached prefix gathered from the paged cache in front of its own
    keys); otherwise one fused scaled_dot_product_attention per sequence (float32 accumulation in its CPU
    kernel), or with a soft cap, which SDPA lacks, explicit float32 attention.

    key/value [num_tokens, kv_heads, head_dim], when given, are this chunk's keys and values as they were
    written: the chunk attends to them directly, with no gather from the cache and no dequantization (and,
    with an INT8 cache, without its rounding); the SDPA path does so for chunks without a cached prefix.
    With a window, only slots from a sequence's first visible key on are read.
    """
    layout, group = _check_prefill_args(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, k_scale_cache, v_scale_cache,
        window, soft_cap,
    )  # fmt: skip
    window, soft_cap = check_attention_options(window, soft_cap)
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
        keys, values, kv_lens = _contexts(
            key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, block_tables, starts, lens,
            query.dtype, window,
        )  # fmt: skip
        kv_starts = [0, *itertools.accumulate(kv_lens[:-1])]
        # The options go by keyword and only when set: the compiled kernel without them still serves the rest.
        options = {name: setting for name, setting in (("window", window), ("soft_cap", soft_cap)) if setting}
        cpu_prefill_attention.prefill_attention_cpu(
            query, keys, values, starts[:-1], q_lens, scale, out, kv_starts=kv_starts, kv_lens=kv_lens,
            **options,
        )  # fmt: skip
        return out
    cache_dtype = compute_dtype(query.dtype, key_cache.dtype)
    for seq, seq_len in enumerate(lens):
        q_start, q_end = starts[seq], starts[seq + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        prefix_len = seq_len - q_len
        # the first query's first visible key: blocks before it are not read
        first = first_visible_key(prefix_len, window)
        if q_len == seq_len and key is not None and value is not None:
            dtype = query.dtype
            keys = key[q_start:q_end].transpose(0, 1).to(dtype)  # [kv_heads, seq_len, D]
            values = value[q_start:q_end].transpose(0, 1).to(dtype)
        else:
            dtype = cache_dtype
            table = block_tables[seq]
            keys = _read_sequence(key_cache, k_scale_cache, table, first, seq_len, dtype)  # [kv_heads, L, D]
            values = _read_sequence(value_cache, v_scale_cache, table, first, seq_len, dtype)
        q = query[q_start:q_end].transpose(0, 1).to(dtype)  # [num_heads, q_len, D]
        if q_len == seq_len and window == 0 and soft_cap == 0:
            mask, causal = None, True
        else:  # query j sits at position prefix_len + j; key column c at position first + c
            positions = torch.arange(prefix_len, seq_len, device=query.device)[:, None]
            key_positions = torch.arange(first, seq_len, device=query.device)
            mask, causal = key_positions <= positions, False  # [q_len, L]
            if window > 0:
                mask &= key_positions > positions - window
        if soft_cap > 0:
            attended = _soft_capped_attention(q, keys, values, mask, scale, soft_cap)
        else:
            attended = F.scaled_dot_product_attention(
                q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=group > 1,
            )[0]  # fmt: skip
        out[q_start:q_end] = attended.transpose(0, 1)  # cast back to the query dtype
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
    window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] packed -> out [num_tokens, num_heads, head_dim] in query dtype.

    query_start_loc [num_seqs + 1] int32; seq_lens [num_seqs] int32 (cached prefix + this chunk);
    block_tables [num_seqs, max_blocks] int32. Caches as in write_kv_cache. key/value: optionally this
    chunk's unquantized keys and values; the CPU paths attend to them (after a cached prefix read from the
    cache), the Triton kernel always reads the cache. compiled=False keeps the CPU path on torch's SDPA
    (the engine's choice when its calibration measured SDPA faster). window: sliding window (0: none);
    soft_cap: attention-logit soft cap (0: none), as in the module doc.
    """
    args = (query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, k_scale_cache,
            v_scale_cache)  # fmt: skip
    _check_prefill_args(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, k_scale_cache, v_scale_cache,
        window, soft_cap,
    )  # fmt: skip
    window, soft_cap = check_attention_options(window, soft_cap)
    backend = select_backend(
        query, compiled_supports=lambda: cpu_prefill_attention.supports(query, key), compiled=compiled
    )
    if backend == "triton":
        return paged_prefill_attention_triton(*args, window=window, soft_cap=soft_cap)
    # "compiled": the compiled kernel attends for every chunk (paged_prefill_attention_torch calls it)
    return paged_prefill_attention_torch(
        *args, key=key, value=value, compiled=backend == "compiled", window=window, soft_cap=soft_cap
    )
