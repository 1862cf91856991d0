from __future__ import annotations

import pytest
import torch

from kernels import paged_decode_attention
from kernels.decode_attention import paged_decode_attention_torch, paged_decode_attention_triton
from kernels.reference import paged_decode_attention_reference
from tests.kernels.helpers import (
    BACKENDS,
    CUDA,
    DTYPE_PAIRS,
    Backend,
    PagedKV,
    assert_close,
    make_paged_kv,
    needs_cuda,
)

BLOCK_SIZE = 8
# 1 token, one short of a block, a full block, one past it, and a long context over five blocks.
CONTEXT_LENS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 4 * BLOCK_SIZE + 3]


def run_decode(backend: Backend, query: torch.Tensor, kv: PagedKV, context_lens: torch.Tensor, scale: float):
    kv = kv.to(backend.device)
    args = (
        query.to(backend.device),
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        context_lens.to(backend.device),
    )
    if backend.triton:
        tiles = {"block_n": 16} if backend.small_tiles else {}
        return paged_decode_attention_triton(*args, scale, kv.k_scale_cache, kv.v_scale_cache, **tiles)
    return paged_decode_attention_torch(*args, scale, kv.k_scale_cache, kv.v_scale_cache)


def reference(query: torch.Tensor, kv: PagedKV, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return paged_decode_attention_reference(
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        context_lens,
        scale,
        kv.k_scale_cache,
        kv.v_scale_cache,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2)], ids=["mha", "gqa3"])
def test_matches_reference(backend, query_dtype, cache_dtype, num_heads, num_kv_heads):
    head_dim = 32
    kv = make_paged_kv(CONTEXT_LENS, num_kv_heads, head_dim, BLOCK_SIZE, cache_dtype)
    query = torch.randn(len(CONTEXT_LENS), num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    query = query.to(query_dtype)
    context_lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32)
    out = run_decode(backend, query, kv, context_lens, head_dim**-0.5)
    assert out.dtype == query_dtype and out.shape == query.shape
    assert_close(out, reference(query, kv, context_lens, head_dim**-0.5))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_head_dim_not_a_power_of_two_and_float16_scales(backend, cache_dtype):
    kv = make_paged_kv([5, 13], 1, 24, 4, cache_dtype, scale_dtype=torch.float16)
    query = torch.randn(2, 3, 24, generator=torch.Generator().manual_seed(2))
    context_lens = torch.tensor([5, 13], dtype=torch.int32)
    assert_close(run_decode(backend, query, kv, context_lens, 0.3), reference(query, kv, context_lens, 0.3))


@pytest.mark.parametrize("chunk_elements", [1, 300, 1 << 20])
def test_torch_path_chunks_sorted_sequences(chunk_elements):
    """Many sequences of mixed lengths: the CPU path sorts them, chunks them and must put each output back."""
    lens = torch.randint(1, 45, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    kv = make_paged_kv(lens, 2, 16, BLOCK_SIZE, torch.int8, seed=4)
    query = torch.randn(len(lens), 6, 16, generator=torch.Generator().manual_seed(5))
    context_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention_torch(
        query, kv.key_cache, kv.value_cache, kv.block_tables, context_lens, 0.25, kv.k_scale_cache,
        kv.v_scale_cache, chunk_elements=chunk_elements,
    )  # fmt: skip
    assert_close(out, reference(query, kv, context_lens, 0.25))


@pytest.mark.parametrize("backend", [pytest.param(Backend("torch", "cpu"), id="cpu"), CUDA])
def test_public_function_dispatches_by_device(backend):
    kv = make_paged_kv(CONTEXT_LENS, 2, 32, BLOCK_SIZE, torch.int8).to(backend.device)
    query = torch.randn(len(CONTEXT_LENS), 6, 32, device=backend.device)
    context_lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32, device=backend.device)
    out = paged_decode_attention(
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        context_lens,
        0.2,
        kv.k_scale_cache,
        kv.v_scale_cache,
    )
    assert out.device == query.device
    assert_close(out, reference(query.cpu(), kv.to("cpu"), context_lens.cpu(), 0.2))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
def test_cuda_realistic_shape(query_dtype, cache_dtype):
    """SmolLM2's attention shape (9 heads, 3 kv heads, head_dim 64, blocks of 16) with default tiles."""
    lens = [1, 15, 16, 17, 200, 777]
    kv = make_paged_kv(lens, 3, 64, 16, cache_dtype).to("cuda")
    query = torch.randn(len(lens), 9, 64).to(query_dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention(
        query.cuda(), kv.key_cache, kv.value_cache, kv.block_tables, context_lens.cuda(), 0.125,
        kv.k_scale_cache, kv.v_scale_cache,
    )  # fmt: skip
    assert_close(out, reference(query, kv.to("cpu"), context_lens, 0.125))


def _valid_args() -> dict:
    kv = make_paged_kv([3, 9], 2, 16, 4, torch.int8)
    return dict(
        query=torch.randn(2, 6, 16),
        key_cache=kv.key_cache,
        value_cache=kv.value_cache,
        block_tables=kv.block_tables,
        context_lens=torch.tensor([3, 9], dtype=torch.int32),
        scale=0.25,
        k_scale_cache=kv.k_scale_cache,
        v_scale_cache=kv.v_scale_cache,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(query=torch.randn(2, 5, 16)), "multiple of num_kv_heads"),
        (lambda a: a.update(query=torch.randn(2, 6, 8)), "head_dim"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must be torch.int32"),
        (
            lambda a: a.update(context_lens=torch.tensor([3], dtype=torch.int32)),
            "context_lens must have shape",
        ),
        (
            lambda a: a.update(context_lens=torch.tensor([0, 9], dtype=torch.int32)),
            "context_lens must lie in",
        ),
        (
            lambda a: a.update(context_lens=torch.tensor([3, 99], dtype=torch.int32)),
            "context_lens must lie in",
        ),
        (lambda a: a.update(k_scale_cache=None), "k_scale_cache is required"),
        (lambda a: a.update(value_cache=a["value_cache"][:, :2]), "value_cache"),
        (lambda a: a.update(query=torch.randn(2, 6, 16).to(torch.int32)), "query must be float32"),
    ],
)
def test_rejects_bad_arguments(change, message):
    args = _valid_args()
    change(args)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args)
