"""Per-step attention metadata and the paged KV cache pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import paged_decode_attention, paged_prefill_attention, write_kv_cache
from worker.engine.config import ModelConfig

# INT8 scales are stored in float16: per token and head they cost 2 bytes beside 64 int8 values,
# which keeps the INT8 cache near 2x the tokens of a 16-bit one (float32 scales would give 1.88x).
KV_SCALE_DTYPE = torch.float16


@dataclass
class AttentionMetadata:
    """Where each token of a packed step goes: decodes first, then prefill chunks."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32
    prefill_block_tables: torch.Tensor | None  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor | None  # [num_prefills + 1] int32, relative to the prefill part
    prefill_seq_lens: torch.Tensor | None  # [num_prefills] int32


class KVCache:
    """One preallocated pool of blocks per layer, shared by all sequences through block tables."""

    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.keys = torch.empty(shape, dtype=dtype, device=device)  # [layers, blocks, block_size, kv_heads, head_dim]
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.quantized = dtype == torch.int8
        # CPU: the compiled kernels or torch's paths (worker/engine/attention_plan.py measures which)
        self.compiled_decode = True
        self.compiled_prefill = True
        if self.quantized:
            scale_shape = shape[:-1]  # [layers, blocks, block_size, kv_heads]
            self.key_scales = torch.ones(scale_shape, dtype=KV_SCALE_DTYPE, device=device)
            self.value_scales = torch.ones(scale_shape, dtype=KV_SCALE_DTYPE, device=device)

    @staticmethod
    def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        per_token_head = model.head_dim * dtype.itemsize
        if dtype == torch.int8:
            per_token_head += KV_SCALE_DTYPE.itemsize
        return 2 * model.num_layers * block_size * model.num_kv_heads * per_token_head

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        if self.quantized:
            return self.keys[index], self.values[index], self.key_scales[index], self.value_scales[index]
        return self.keys[index], self.values[index], None, None

    def attend(
        self,
        layer_index: int,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        key_cache, value_cache, key_scales, value_scales = self.layer(layer_index)
        write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping, key_scales, value_scales)
        nd = meta.num_decode_tokens
        if nd == query.shape[0]:
            return paged_decode_attention(
                query, key_cache, value_cache, meta.decode_block_tables, meta.decode_context_lens,
                scale, key_scales, value_scales, compiled=self.compiled_decode,
            )
        if nd == 0:
            return paged_prefill_attention(
                query, key_cache, value_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                meta.prefill_seq_lens, scale, key_scales, value_scales, key=key, value=value,
                compiled=self.compiled_prefill,
            )
        out = torch.empty_like(query)
        out[:nd] = paged_decode_attention(
            query[:nd], key_cache, value_cache, meta.decode_block_tables, meta.decode_context_lens,
            scale, key_scales, value_scales, compiled=self.compiled_decode,
        )
        out[nd:] = paged_prefill_attention(
            query[nd:], key_cache, value_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
            meta.prefill_seq_lens, scale, key_scales, value_scales, key=key[nd:], value=value[nd:],
            compiled=self.compiled_prefill,
        )
        return out
