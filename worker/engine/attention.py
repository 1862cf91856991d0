"""Per-step attention metadata and the paged KV cache pools.

A model's layers form KV groups by attention window (kv_groups): its full-attention layers, and one group
per window size (Mistral v0.1: one window group; Gemma 2/3: a full group and a window group). Each group has
its own pool of blocks and its own block tables (block_manager.py), because a window group frees the blocks
that fell out of every future query's window while the full group keeps every block: a sequence's KV in
window layers stops growing at about the window. A model without window layers has one group, laid out as
one pool of every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import paged_decode_attention, paged_prefill_attention, write_kv_cache
from worker.engine.config import ModelConfig

# INT8 scales are stored in float16: per token and head they cost 2 bytes beside 64 int8 values,
# which keeps the INT8 cache near 2x the tokens of a 16-bit one (float32 scales would give 1.88x).
KV_SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class KVGroup:
    """Layers whose K/V share a pool and block tables: those with one attention window."""

    window: int  # tokens a query sees, itself included; 0: full attention
    layers: tuple[int, ...]  # model layers, ascending


def kv_groups(model: ModelConfig) -> list[KVGroup]:
    """The model's KV groups: full attention first (where there is any), then by window, ascending."""
    windows = [model.window(i) for i in range(model.num_layers)]
    return [KVGroup(w, tuple(i for i, x in enumerate(windows) if x == w)) for w in sorted(set(windows))]


def split_kv_blocks(
    groups: list[KVGroup], layer_blocks: int, window_blocks: list[int], useful: int | None = None
) -> list[int]:
    """Blocks of each group's pool from a budget of `layer_blocks` blocks of one layer (KV memory over
    bytes_per_layer_block). window_blocks[g]: the blocks window group g needs to hold every sequence that
    can run at once (engine: max_num_seqs decodes' windows plus a step's prefill chunks); useful: the most
    blocks a pool could ever use (None: no cap).

    The window pools take what lets them never bind before the full pool (min(full pool, their need): a
    sequence never holds more window blocks than full ones, nor more than its window's worth), the full
    pool the rest. So a batch is bounded by the full pool alone, which grows by what the windows save: for
    Gemma 3 1B (INT8, 2 GiB, 256 sequences) 15.7k full blocks instead of 10.0k. Only when the budget is
    too small for even that are all pools the same size (short sequences use as many blocks in each).
    Without a full group (Mistral v0.1) the window pools split the budget in proportion to their needs;
    without window layers the one pool takes it all.
    """
    layers = [len(g.layers) for g in groups]
    full = [i for i, g in enumerate(groups) if not g.window]
    if not full:
        total = sum(n * w for n, w in zip(layers, window_blocks, strict=True))
        counts = [layer_blocks * w // total for w in window_blocks]
        return [min(c, useful) for c in counts] if useful is not None else counts
    (f,) = full

    def cost(n: int) -> int:  # layer blocks of a full pool of n blocks and its window pools
        pools = [n if i == f else min(n, w) for i, w in enumerate(window_blocks)]
        return sum(size * blocks for size, blocks in zip(layers, pools, strict=True))

    lo, hi = 0, layer_blocks // layers[f]  # the largest full pool that fits: cost is monotone
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= layer_blocks else (lo, mid - 1)
    n = min(lo, useful) if useful is not None else lo
    return [n if i == f else min(n, w) for i, w in enumerate(window_blocks)]


@dataclass
class GroupTables:
    """One KV group's part of a step: where the step's K/V go and which blocks each row reads."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    prefill_block_tables: torch.Tensor | None  # [num_prefills, max_blocks] int32


@dataclass
class AttentionMetadata:
    """Where each token of a packed step goes: decodes first, then prefill chunks.

    The slot mapping and block tables are KV group 0's; other_groups holds those of groups 1, 2, ... (left
    empty, every group uses group 0's: a cache whose pools are allocated alike, as smoothing.prefill's).
    Context lengths, query ranges and positions are the step's, shared by the groups."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32
    prefill_block_tables: torch.Tensor | None  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor | None  # [num_prefills + 1] int32, relative to the prefill part
    prefill_seq_lens: torch.Tensor | None  # [num_prefills] int32
    other_groups: tuple[GroupTables, ...] = ()

    def tables(self, group: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Group `group`'s (slot_mapping, decode_block_tables, prefill_block_tables)."""
        if group == 0 or not self.other_groups:
            return self.slot_mapping, self.decode_block_tables, self.prefill_block_tables
        t = self.other_groups[group - 1]
        return t.slot_mapping, t.decode_block_tables, t.prefill_block_tables


@dataclass
class KVPool:
    """One KV group's preallocated blocks, shared by all sequences through that group's block tables."""

    window: int
    num_blocks: int
    keys: torch.Tensor  # [group_layers, num_blocks, block_size, kv_heads, head_dim]
    values: torch.Tensor
    key_scales: torch.Tensor | None  # [group_layers, num_blocks, block_size, kv_heads] (INT8 caches)
    value_scales: torch.Tensor | None


class KVCache:
    """One pool per KV group (kv_groups), each a preallocated block pool per layer of the group."""

    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int | Sequence[int],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """num_blocks: per KV group, or one count for every group."""
        self.groups = kv_groups(model)
        counts = [num_blocks] * len(self.groups) if isinstance(num_blocks, int) else list(num_blocks)
        if len(counts) != len(self.groups):
            raise ValueError(f"{len(counts)} block counts for {len(self.groups)} KV groups")
        self.block_size = block_size
        self.dtype = dtype
        self.quantized = dtype == torch.int8
        # CPU: the compiled kernels or torch's paths (worker/engine/plan/attention.py measures which)
        self.compiled_decode = True
        self.compiled_prefill = True
        self.pools: list[KVPool] = []
        self._where: list[tuple[int, int]] = [(0, 0)] * model.num_layers  # layer -> (group, index in group)
        for g, (group, n) in enumerate(zip(self.groups, counts, strict=True)):
            shape = (len(group.layers), n, block_size, model.num_kv_heads, model.head_dim)
            scales = self.quantized
            self.pools.append(KVPool(
                window=group.window,
                num_blocks=n,
                keys=torch.empty(shape, dtype=dtype, device=device),
                values=torch.empty(shape, dtype=dtype, device=device),
                key_scales=torch.ones(shape[:-1], dtype=KV_SCALE_DTYPE, device=device) if scales else None,
                value_scales=torch.ones(shape[:-1], dtype=KV_SCALE_DTYPE, device=device) if scales else None,
            ))  # fmt: skip
            for i, layer in enumerate(group.layers):
                self._where[layer] = (g, i)
        # the ops' window / soft-cap keywords, per layer; none for plain full attention
        cap = model.attn_logit_softcap
        self._options: list[dict[str, float]] = [
            ({"window": model.window(i)} if model.window(i) else {}) | ({"soft_cap": cap} if cap else {})
            for i in range(model.num_layers)
        ]  # fmt: skip
        # group 0's pool as before KV groups: every layer of a model without window layers
        first = self.pools[0]
        self.num_blocks = first.num_blocks
        self.keys, self.values = first.keys, first.values  # [layers, blocks, block_size, kv_heads, head_dim]
        if self.quantized:
            self.key_scales, self.value_scales = first.key_scales, first.value_scales

    @staticmethod
    def bytes_per_layer_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block of one layer: keys and values (and their INT8 scales)."""
        per_token_head = model.head_dim * dtype.itemsize
        if dtype == torch.int8:
            per_token_head += KV_SCALE_DTYPE.itemsize
        return 2 * block_size * model.num_kv_heads * per_token_head

    @staticmethod
    def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block of every layer."""
        return model.num_layers * KVCache.bytes_per_layer_block(model, block_size, dtype)

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        """(key_cache, value_cache, key_scales, value_scales) of layer `index`; scales None unless INT8."""
        g, i = self._where[index]
        pool = self.pools[g]
        if self.quantized:
            return pool.keys[i], pool.values[i], pool.key_scales[i], pool.value_scales[i]
        return pool.keys[i], pool.values[i], None, None

    def attend(
        self,
        layer_index: int,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,  # the model's softmax scale
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        key_cache, value_cache, key_scales, value_scales = self.layer(layer_index)
        slot_mapping, decode_tables, prefill_tables = meta.tables(self._where[layer_index][0])
        options = self._options[layer_index]
        write_kv_cache(key, value, key_cache, value_cache, slot_mapping, key_scales, value_scales)
        nd = meta.num_decode_tokens
        if nd == query.shape[0]:
            return paged_decode_attention(
                query, key_cache, value_cache, decode_tables, meta.decode_context_lens,
                scale, key_scales, value_scales, compiled=self.compiled_decode, **options,
            )
        if nd == 0:
            return paged_prefill_attention(
                query, key_cache, value_cache, prefill_tables, meta.prefill_query_start_loc,
                meta.prefill_seq_lens, scale, key_scales, value_scales, key=key, value=value,
                compiled=self.compiled_prefill, **options,
            )
        out = torch.empty_like(query)
        out[:nd] = paged_decode_attention(
            query[:nd], key_cache, value_cache, decode_tables, meta.decode_context_lens,
            scale, key_scales, value_scales, compiled=self.compiled_decode, **options,
        )
        out[nd:] = paged_prefill_attention(
            query[nd:], key_cache, value_cache, prefill_tables, meta.prefill_query_start_loc,
            meta.prefill_seq_lens, scale, key_scales, value_scales, key=key[nd:], value=value[nd:],
            compiled=self.compiled_prefill, **options,
        )
        return out
