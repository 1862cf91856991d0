"""The compiled CPU decode-attention kernel against the plain reference.

On x86 the kernel is built for the machine's ISA tier (AVX-512 or AVX2 code path); head_dim 32, 64 and 128
with up to 8 query heads per kv head take that path, other shapes the portable loop. Context lengths sit
around the block size, so blocks end part way and the slots left over by the AVX2 path's multi-slot
score steps are exercised too.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode_attention, paged_decode_attention
from kernels.cpu_decode_attention import paged_decode_attention_cpu
from kernels.reference import paged_decode_attention_reference
from tests.kernels.helpers import DTYPE_PAIRS, assert_close, make_paged_kv

BLOCK_SIZE = 8
CONTEXT_LENS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 4 * BLOCK_SIZE + 3]

pytestmark = pytest.mark.skipif(
    not cpu_decode_attention.available(), reason="no C++ toolchain to build the CPU kernel"
)


def decode_args(
    lens,
    heads,
    kv_heads,
    head_dim,
    cache_dtype,
    query_dtype,
    scale_dtype=torch.float32,
    block_size=BLOCK_SIZE,
    seed=1,
):
    """paged_decode_attention's arguments: random queries, random caches of `lens` in shuffled blocks."""
    kv = make_paged_kv(lens, kv_heads, head_dim, block_size, cache_dtype, scale_dtype=scale_dtype, seed=seed)
    query = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    return (query.to(query_dtype), kv.key_cache, kv.value_cache, kv.block_tables,
            torch.tensor(lens, dtype=torch.int32), head_dim**-0.5, kv.k_scale_cache, kv.v_scale_cache)  # fmt: skip


@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_matches_reference(query_dtype, cache_dtype, num_heads, num_kv_heads, scale_dtype, head_dim):
    args = decode_args(CONTEXT_LENS, num_heads, num_kv_heads, head_dim, cache_dtype, query_dtype, scale_dtype)
    out = paged_decode_attention_cpu(*args)
    assert out.dtype == query_dtype and out.shape == args[0].shape
    expected = paged_decode_attention_reference(*args)
    assert_close(out, expected)
    assert_close(paged_decode_attention(*args), expected)  # the public function dispatches here on CPU


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8, 9])  # 9: past the compiled group sizes (portable loop)
def test_group_sizes(group):
    args = decode_args(CONTEXT_LENS, 2 * group, 2, 64, torch.int8, torch.float32, torch.float16, seed=group)
    assert_close(paged_decode_attention_cpu(*args), paged_decode_attention_reference(*args))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_float16_cache(head_dim):
    args = decode_args(CONTEXT_LENS, 6, 2, head_dim, torch.float16, torch.float32)
    assert_close(paged_decode_attention_cpu(*args), paged_decode_attention_reference(*args))


def test_many_sequences_of_mixed_length_land_in_their_rows():
    lens = torch.randint(1, 90, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    args = decode_args(lens, 9, 3, 64, torch.int8, torch.bfloat16, torch.float16, block_size=16, seed=4)
    assert_close(paged_decode_attention_cpu(*args), paged_decode_attention_reference(*args))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    "lens",
    [sorted(torch.randint(1, 300, (29,), generator=torch.Generator().manual_seed(5)).tolist()), [700] + [1] * 12, [3]],
    ids=["sorted", "one-long-first", "one"],
)
def test_sequences_split_by_work_across_threads(threads, lens):
    """Threads take ranges of near-equal context (balanced_parallel.h): a length-sorted batch, one long
    sequence before many short ones (a range may be empty), a single sequence."""
    args = decode_args(lens, 9, 3, 64, torch.int8, torch.float32, torch.float16, block_size=16, seed=6)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_decode_attention_cpu(*args)
    finally:
        torch.set_num_threads(before)
    assert_close(out, paged_decode_attention_reference(*args))
