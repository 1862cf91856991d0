from __future__ import annotations

import pytest
import torch

from kernels import paged_decode_attention, paged_prefill_attention
from kernels.prefill_attention import paged_prefill_attention_torch, paged_prefill_attention_triton
from kernels.reference import paged_prefill_attention_reference
from tests.kernels.helpers import (
    BACKENDS,
    DTYPE_PAIRS,
    Backend,
    PagedKV,
    assert_close,
    make_paged_kv,
    needs_cuda,
)

BLOCK_SIZE = 8
# (queries in this chunk, total context after it). Whole prompts of 1, block_size - 1, block_size and
# block_size + 1 tokens (q_len == seq_len, plain causal), and chunks that continue a cached prefix, one of
# them a single token, one starting mid-block and spanning several blocks.
CHUNKS = [(1, 1), (BLOCK_SIZE - 1, BLOCK_SIZE - 1), (BLOCK_SIZE, BLOCK_SIZE), (BLOCK_SIZE + 1, BLOCK_SIZE + 1),
          (3, 4 * BLOCK_SIZE + 3), (19, 4 * BLOCK_SIZE + 5), (1, 2 * BLOCK_SIZE)]  # fmt: skip


def packed_inputs(chunks: list[tuple[int, int]], num_heads: int, head_dim: int, dtype: torch.dtype):
    q_lens = [q for q, _ in chunks]
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(
        dtype
    )
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([n for _, n in chunks], dtype=torch.int32)
    return query, query_start_loc, seq_lens


def run_prefill(
    backend: Backend, query, kv: PagedKV, query_start_loc, seq_lens, scale: float
) -> torch.Tensor:
    kv = kv.to(backend.device)
    device = backend.device
    args = (query.to(device), kv.key_cache, kv.value_cache, kv.block_tables, query_start_loc.to(device))
    args = (*args, seq_lens.to(device), scale, kv.k_scale_cache, kv.v_scale_cache)
    if backend.triton:
        tiles = {"block_m": 16, "block_n": 16} if backend.small_tiles else {}
        return paged_prefill_attention_triton(*args, **tiles)
    return paged_prefill_attention_torch(*args)


def reference(query, kv: PagedKV, query_start_loc, seq_lens, scale: float) -> torch.Tensor:
    return paged_prefill_attention_reference(
        query, kv.key_cache, kv.value_cache, kv.block_tables, query_start_loc, seq_lens, scale,
        kv.k_scale_cache, kv.v_scale_cache,
    )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2)], ids=["mha", "gqa3"])
def test_matches_reference(backend, query_dtype, cache_dtype, num_heads, num_kv_heads):
    head_dim = 32
    kv = make_paged_kv([n for _, n in CHUNKS], num_kv_heads, head_dim, BLOCK_SIZE, cache_dtype)
    query, query_start_loc, seq_lens = packed_inputs(CHUNKS, num_heads, head_dim, query_dtype)
    out = run_prefill(backend, query, kv, query_start_loc, seq_lens, head_dim**-0.5)
    assert out.dtype == query_dtype and out.shape == query.shape
    assert_close(out, reference(query, kv, query_start_loc, seq_lens, head_dim**-0.5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_not_a_power_of_two(backend):
    chunks = [(5, 5), (4, 13)]
    kv = make_paged_kv([n for _, n in chunks], 1, 24, 4, torch.int8, scale_dtype=torch.float16)
    query, query_start_loc, seq_lens = packed_inputs(chunks, 3, 24, torch.float32)
    out = run_prefill(backend, query, kv, query_start_loc, seq_lens, 0.3)
    assert_close(out, reference(query, kv, query_start_loc, seq_lens, 0.3))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])])
def test_one_query_per_sequence_equals_decode(device):
    lens = [1, 9, 30]
    kv = make_paged_kv(lens, 2, 32, BLOCK_SIZE, torch.int8).to(device)
    query = torch.randn(3, 6, 32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(4, dtype=torch.int32, device=device)
    caches = (kv.key_cache, kv.value_cache, kv.block_tables)
    scales = (kv.k_scale_cache, kv.v_scale_cache)
    prefill = paged_prefill_attention(query, *caches, query_start_loc, seq_lens, 0.2, *scales)
    decode = paged_decode_attention(query, *caches, seq_lens, 0.2, *scales)
    assert_close(prefill, decode)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
def test_cuda_realistic_shape(query_dtype, cache_dtype):
    """SmolLM2's attention shape with default tiles: a long prompt, a chunk after a prefix, a short prompt."""
    chunks = [(300, 300), (130, 517), (17, 17)]
    kv = make_paged_kv([n for _, n in chunks], 3, 64, 16, cache_dtype)
    query, query_start_loc, seq_lens = packed_inputs(chunks, 9, 64, query_dtype)
    out = run_prefill(Backend("cuda", "cuda"), query, kv, query_start_loc, seq_lens, 0.125)
    assert_close(out, reference(query, kv, query_start_loc, seq_lens, 0.125))


def test_rejects_bad_arguments():
    kv = make_paged_kv([4, 9], 2, 16, 4, torch.float32)
    query, query_start_loc, seq_lens = packed_inputs([(4, 4), (3, 9)], 6, 16, torch.float32)
    caches = (kv.key_cache, kv.value_cache, kv.block_tables)
    with pytest.raises(ValueError, match="query_start_loc must have shape"):
        paged_prefill_attention(query, *caches, query_start_loc[:-1], seq_lens, 0.25)
    with pytest.raises(ValueError, match="seq_lens must be torch.int32"):
        paged_prefill_attention(query, *caches, query_start_loc, seq_lens.long(), 0.25)
    with pytest.raises(ValueError, match="only for int8 caches"):
        paged_prefill_attention(query, *caches, query_start_loc, seq_lens, 0.25, kv.key_cache[..., 0], None)
    with pytest.raises(ValueError, match="sequence 1: 3 queries but seq_lens = 99"):
        paged_prefill_attention(
            query, *caches, query_start_loc, torch.tensor([4, 99], dtype=torch.int32), 0.25
        )
    with pytest.raises(ValueError, match="3 queries but seq_lens = 2"):
        paged_prefill_attention(
            query, *caches, query_start_loc, torch.tensor([4, 2], dtype=torch.int32), 0.25
        )


@pytest.mark.parametrize(
    ("query_dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.int8)]
)
def test_fresh_keys_and_values_stand_in_for_the_cache(query_dtype, cache_dtype):
    """The CPU path attends to the chunk's own keys and values for sequences without a cached prefix; with a
    float32 cache that is exactly what the cache holds, and with an INT8 cache it differs only by the cache's
    rounding. Chunks with a prefix still read the cache."""
    from kernels import write_kv_cache

    num_heads, num_kv_heads, head_dim = 6, 2, 32
    kv = make_paged_kv([n for _, n in CHUNKS], num_kv_heads, head_dim, BLOCK_SIZE, cache_dtype)
    query, query_start_loc, seq_lens = packed_inputs(CHUNKS, num_heads, head_dim, query_dtype)
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(query.shape[0], num_kv_heads, head_dim, generator=gen).to(query_dtype)
    value = torch.randn(query.shape[0], num_kv_heads, head_dim, generator=gen).to(query_dtype)
    slots = [
        int(kv.block_tables[seq, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
        for seq, (q_len, seq_len) in enumerate(CHUNKS)
        for p in range(seq_len - q_len, seq_len)
    ]
    write_kv_cache(key, value, kv.key_cache, kv.value_cache, torch.tensor(slots), kv.k_scale_cache,
                   kv.v_scale_cache)  # fmt: skip
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, query_start_loc, seq_lens, 0.2,
            kv.k_scale_cache, kv.v_scale_cache)  # fmt: skip
    fresh = paged_prefill_attention(*args, key=key, value=value)
    expected = reference(query, kv, query_start_loc, seq_lens, 0.2)
    if cache_dtype == torch.float32:
        assert_close(fresh, expected)
    else:  # INT8 rounding of K and V: about 1% of a value's range
        torch.testing.assert_close(fresh.float(), expected.float(), atol=0.05, rtol=0.05)
        prefixed = [i for i, (q, n) in enumerate(CHUNKS) if q < n]
        for seq in prefixed:  # these rows read the cache, as without fresh keys
            rows = slice(int(query_start_loc[seq]), int(query_start_loc[seq + 1]))
            torch.testing.assert_close(fresh[rows], paged_prefill_attention(*args)[rows])
