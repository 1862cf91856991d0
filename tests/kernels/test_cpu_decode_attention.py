"""The compiled CPU decode-attention kernel against the plain reference."""

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


@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_matches_reference(query_dtype, cache_dtype, num_heads, num_kv_heads, scale_dtype):
    head_dim = 32
    kv = make_paged_kv(CONTEXT_LENS, num_kv_heads, head_dim, BLOCK_SIZE, cache_dtype, scale_dtype=scale_dtype)
    query = torch.randn(len(CONTEXT_LENS), num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    query = query.to(query_dtype)
    lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, lens, head_dim**-0.5, kv.k_scale_cache,
            kv.v_scale_cache)  # fmt: skip
    out = paged_decode_attention_cpu(*args)
    assert out.dtype == query_dtype and out.shape == query.shape
    expected = paged_decode_attention_reference(*args)
    assert_close(out, expected)
    assert_close(paged_decode_attention(*args), expected)  # the public function dispatches here on CPU


def test_many_sequences_of_mixed_length_land_in_their_rows():
    lens = torch.randint(1, 90, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    kv = make_paged_kv(lens, 3, 64, 16, torch.int8, scale_dtype=torch.float16, seed=4)
    query = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, torch.tensor(lens, dtype=torch.int32), 0.125,
            kv.k_scale_cache, kv.v_scale_cache)  # fmt: skip
    assert_close(paged_decode_attention_cpu(*args), paged_decode_attention_reference(*args))
