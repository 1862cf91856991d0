"""Plain, slow references of every op, written for obviousness; used only by tests.

Attention is computed in float64, one query at a time, reading the cache slot by slot.

Attention options (both ops): `window` W > 0 is a sliding window, the query at position p attending to keys
p - W < k <= p (transformers' sliding_window_overlay); 0 is plain causal attention. `soft_cap` c > 0 caps
each scaled score s to c * tanh(s / c) before masking and softmax (Gemma 2's attn_logit_softcapping); 0 is
none. The reference reads no slot before a sequence's first visible key: those blocks may hold anything.
"""

from __future__ import annotations

import torch

INT8_SCALE_EPS = 1e-8


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dimension: scale = max|x| / 127 (>= 1e-8), q = round(x / scale)."""
    x = x.float()
    scale = (x.abs().amax(dim=-1) / 127.0).clamp(min=INT8_SCALE_EPS)
    q = torch.round(x / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q, scale


def int8_query_reference(query: torch.Tensor) -> torch.Tensor:
    """A float32 query [..., head_dim] as an INT8 decode kernel scores it: per head, codes
    round(q * (127 / max|q|)) (a zero head stays zero) times max|q| / 127."""
    query = query.float()
    top = query.abs().amax(dim=-1, keepdim=True)
    # a true float32 division (127.0 / top would be computed as 127 * (1 / top), off by an ulp at times)
    inverse = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    return torch.round(query * inverse) * (top / 127.0)


def write_kv_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
) -> None:
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        block, offset = divmod(slot, block_size)
        if key_cache.dtype == torch.int8:
            key_cache[block, offset], k_scale_cache[block, offset] = quantize_reference(key[token])
            value_cache[block, offset], v_scale_cache[block, offset] = quantize_reference(value[token])
        else:
            key_cache[block, offset] = key[token].to(key_cache.dtype)
            value_cache[block, offset] = value[token].to(value_cache.dtype)


def _read_sequence(
    cache: torch.Tensor, scale_cache: torch.Tensor | None, block_table: list[int], start: int, end: int
) -> torch.Tensor:
    """Slots start..end-1 of one sequence, dequantized: [end - start, num_kv_heads, head_dim] float64."""
    block_size = cache.shape[1]
    rows = []
    for position in range(start, end):
        block, offset = block_table[position // block_size], position % block_size
        row = cache[block, offset].double()
        if scale_cache is not None:
            row = row * scale_cache[block, offset].double().unsqueeze(-1)
        rows.append(row)
    return torch.stack(rows)


def _attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, soft_cap: float = 0.0
) -> torch.Tensor:
    """One query position against its visible keys: query [num_heads, D], keys/values [n, num_kv_heads, D]."""
    group = query.shape[0] // keys.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for head in range(query.shape[0]):
        kv_head = head // group
        scores = (keys[:, kv_head] @ query[head].double()) * scale  # [n]
        if soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        out[head] = torch.softmax(scores, dim=0) @ values[:, kv_head]
    return out


def first_visible_key(position: int, window: int) -> int:
    """The first key position the query at `position` attends to."""
    return max(0, position - window + 1) if window > 0 else 0


def paged_prefill_attention_reference(
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
) -> torch.Tensor:
    out = torch.empty(query.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        table = block_tables[seq].tolist()
        q_len = starts[seq + 1] - starts[seq]
        if q_len == 0:
            continue
        first = first_visible_key(seq_len - q_len, window)  # the sequence's first query sees the most
        keys = _read_sequence(key_cache, k_scale_cache, table, first, seq_len)  # positions first..seq_len-1
        values = _read_sequence(value_cache, v_scale_cache, table, first, seq_len)
        for j in range(q_len):
            position = seq_len - q_len + j  # attends to keys first_visible_key(position)..position
            token = starts[seq] + j
            visible = slice(first_visible_key(position, window) - first, position + 1 - first)
            out[token] = _attend(query[token], keys[visible], values[visible], scale, soft_cap)
    return out.to(query.dtype)


def paged_decode_attention_reference(
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
) -> torch.Tensor:
    """Decode is prefill with one query per sequence, at its last position."""
    query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return paged_prefill_attention_reference(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        k_scale_cache,
        v_scale_cache,
        window,
        soft_cap,
    )


def int8_linear_reference(
    x: torch.Tensor,
    w_q_t: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    x_q, x_scale = quantize_reference(x)
    y = (x_q.double() @ w_q_t.double()) * x_scale.double()[:, None] * w_scale.double()[None, :]
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype or x.dtype)
