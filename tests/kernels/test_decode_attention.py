from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import paged_decode_attention
from kernels.cpu_decode_attention import scores_int8_queries
from kernels.decode_attention import paged_decode_attention_torch, paged_decode_attention_triton
from kernels.reference import int8_query_reference, paged_decode_attention_reference
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
# Sliding windows: one key, shorter than a block, a block, a non-multiple of it over several blocks, and one
# longer than every context (plain causal attention).
WINDOWS = [1, 5, BLOCK_SIZE, 2 * BLOCK_SIZE + 3, 64]
WINDOW_CONTEXT_LENS = [
    1,
    BLOCK_SIZE - 1,
    BLOCK_SIZE + 1,
    3 * BLOCK_SIZE,
    4 * BLOCK_SIZE + 3,
    6 * BLOCK_SIZE + 5,
]


def reuse_blocks_before_window(kv: PagedKV, first_keys: list[int], seed: int = 0) -> PagedKV:
    """A copy of kv as the engine leaves it with a sliding window: blocks lying wholly before a sequence's
    first visible key (first_keys[seq]) are freed and reused, so they hold NaN (float caches: keys and
    values; int8 caches: scales), and the table entries naming them now name random blocks of that garbage.
    A kernel that reads any of them fails the test."""
    kv = PagedKV(*(None if t is None else t.clone() for t in dataclasses.astuple(kv)))
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size = kv.key_cache.shape[:2]
    freed = [
        int(kv.block_tables[seq, b])
        for seq, first in enumerate(first_keys)
        for b in range(first // block_size)
    ]
    live = {int(b) for seq_table in kv.block_tables for b in seq_table if 0 <= b < num_blocks} - set(freed)
    garbage = torch.tensor(sorted(set(range(num_blocks)) - live))  # freed blocks and never-used spares
    if kv.key_cache.dtype == torch.int8:
        kv.k_scale_cache[garbage] = float("nan")
        kv.v_scale_cache[garbage] = float("nan")
    else:
        kv.key_cache[garbage] = float("nan")
        kv.value_cache[garbage] = float("nan")
    for seq, first in enumerate(first_keys):
        count = first // block_size
        picks = torch.randint(len(garbage), (count,), generator=gen)
        kv.block_tables[seq, :count] = garbage[picks].to(torch.int32)
    return kv


def run_decode(
    backend: Backend,
    query: torch.Tensor,
    kv: PagedKV,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    soft_cap: float = 0.0,
):
    kv = kv.to(backend.device)
    args = (
        query.to(backend.device),
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        context_lens.to(backend.device),
    )
    options = dict(window=window, soft_cap=soft_cap)
    if backend.triton:
        tiles = {"block_n": 16} if backend.small_tiles else {}
        return paged_decode_attention_triton(
            *args, scale, kv.k_scale_cache, kv.v_scale_cache, **options, **tiles
        )
    return paged_decode_attention_torch(*args, scale, kv.k_scale_cache, kv.v_scale_cache, **options)


def reference(
    query: torch.Tensor,
    kv: PagedKV,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    return paged_decode_attention_reference(
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        context_lens,
        scale,
        kv.k_scale_cache,
        kv.v_scale_cache,
        window=window,
        soft_cap=soft_cap,
    )


def first_keys(context_lens: list[int], window: int) -> list[int]:
    """Each decode query's first visible key: position context_len - 1 sees keys > context_len - 1 - window."""
    return [max(0, n - window) if window else 0 for n in context_lens]


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2)], ids=["mha", "gqa3"])
def test_sliding_window_matches_reference(backend, query_dtype, cache_dtype, num_heads, num_kv_heads):
    """Each window against sequences shorter and longer than it; the blocks before each window are
    reused garbage (NaN), which must not reach the output."""
    head_dim = 32
    clean = make_paged_kv(WINDOW_CONTEXT_LENS, num_kv_heads, head_dim, BLOCK_SIZE, cache_dtype)
    query = torch.randn(
        len(WINDOW_CONTEXT_LENS), num_heads, head_dim, generator=torch.Generator().manual_seed(1)
    )
    query = query.to(query_dtype)
    context_lens = torch.tensor(WINDOW_CONTEXT_LENS, dtype=torch.int32)
    for window in WINDOWS:
        kv = reuse_blocks_before_window(clean, first_keys(WINDOW_CONTEXT_LENS, window), seed=window)
        out = run_decode(backend, query, kv, context_lens, head_dim**-0.5, window=window)
        assert out.dtype == query_dtype and out.shape == query.shape
        assert_close(out, reference(query, clean, context_lens, head_dim**-0.5, window=window))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize("window", [0, 5], ids=["full", "window5"])
def test_soft_cap_matches_reference(backend, query_dtype, cache_dtype, window):
    """Scores spread over about +-10 against a cap of 3: capping changes the result (checked), alone and
    with a window."""
    head_dim, scale, soft_cap = 32, 0.5, 3.0
    clean = make_paged_kv(WINDOW_CONTEXT_LENS, 2, head_dim, BLOCK_SIZE, cache_dtype)
    kv = reuse_blocks_before_window(clean, first_keys(WINDOW_CONTEXT_LENS, window))
    query = torch.randn(len(WINDOW_CONTEXT_LENS), 6, head_dim, generator=torch.Generator().manual_seed(1))
    query = query.to(query_dtype)
    context_lens = torch.tensor(WINDOW_CONTEXT_LENS, dtype=torch.int32)
    expected = reference(query, clean, context_lens, scale, window=window, soft_cap=soft_cap)
    uncapped = reference(query, clean, context_lens, scale, window=window)
    assert (expected.double() - uncapped.double()).abs().max() > 0.1
    out = run_decode(backend, query, kv, context_lens, scale, window=window, soft_cap=soft_cap)
    assert_close(out, expected)


def test_reference_window_semantics():
    """The reference's window: one at least as long as the context is full attention; window 1 returns the
    current token's value; in between, a longer context differs from full attention."""
    lens = [5, 13]
    kv = make_paged_kv(lens, 1, 8, 4, torch.float32)
    query = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(6))
    context_lens = torch.tensor(lens, dtype=torch.int32)
    full = reference(query, kv, context_lens, 0.5)
    torch.testing.assert_close(reference(query, kv, context_lens, 0.5, window=13), full)
    last = [kv.value_cache[kv.block_tables[seq, (n - 1) // 4], (n - 1) % 4] for seq, n in enumerate(lens)]
    torch.testing.assert_close(
        reference(query, kv, context_lens, 0.5, window=1), torch.stack(last).expand(2, 2, 8)
    )
    windowed = reference(query, kv, context_lens, 0.5, window=6)
    torch.testing.assert_close(windowed[0], full[0])
    assert not torch.allclose(windowed[1], full[1])


@pytest.mark.parametrize("window", [0, 11])
@pytest.mark.parametrize("chunk_elements", [1, 300, 1 << 20])
def test_torch_path_chunks_sorted_sequences(chunk_elements, window):
    """Many sequences of mixed lengths: the CPU path sorts them, chunks them and must put each output back."""
    lens = torch.randint(1, 45, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    clean = make_paged_kv(lens, 2, 16, BLOCK_SIZE, torch.int8, seed=4)
    kv = reuse_blocks_before_window(clean, first_keys(lens, window))
    query = torch.randn(len(lens), 6, 16, generator=torch.Generator().manual_seed(5))
    context_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention_torch(
        query, kv.key_cache, kv.value_cache, kv.block_tables, context_lens, 0.25, kv.k_scale_cache,
        kv.v_scale_cache, window=window, chunk_elements=chunk_elements,
    )  # fmt: skip
    assert_close(out, reference(query, clean, context_lens, 0.25, window=window))


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


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
def test_public_function_window_and_soft_cap_on_cpu(compiled, query_dtype, cache_dtype):
    """The CPU backends (the compiled kernel where it builds) with a window, a soft cap and both, head_dim 64;
    with a window, the blocks before it are reused garbage."""
    lens = [1, 15, 16, 17, 40, 100]
    window, soft_cap, scale = 20, 4.0, 0.4
    clean = make_paged_kv(lens, 2, 64, 16, cache_dtype)
    query = torch.randn(len(lens), 6, 64, generator=torch.Generator().manual_seed(8)).to(query_dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    expected_query, expected_scale = query, scale
    if compiled and scores_int8_queries(cache_dtype, 64, 3):  # the AVX-512 build rounds the query to INT8
        expected_query, expected_scale = int8_query_reference(query.float() * scale), 1.0
    for options in (dict(window=window), dict(soft_cap=soft_cap), dict(window=window, soft_cap=soft_cap)):
        kv = reuse_blocks_before_window(clean, first_keys(lens, options.get("window", 0)))
        out = paged_decode_attention(
            query, kv.key_cache, kv.value_cache, kv.block_tables, context_lens, scale, kv.k_scale_cache,
            kv.v_scale_cache, compiled=compiled, **options,
        )  # fmt: skip
        expected = reference(expected_query, clean, context_lens, expected_scale, **options)
        assert_close(out, expected.to(query_dtype))


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


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
def test_cuda_window_and_soft_cap(query_dtype, cache_dtype):
    """Gemma 2's shape (8 heads, 4 kv heads, head_dim 256, window 4096 scaled down to 100, cap 50) with
    default tiles, reused blocks before the window."""
    lens = [1, 15, 99, 100, 101, 777]
    window, soft_cap = 100, 50.0
    clean = make_paged_kv(lens, 4, 256, 16, cache_dtype)
    kv = reuse_blocks_before_window(clean, first_keys(lens, window)).to("cuda")
    query = torch.randn(len(lens), 8, 256).to(query_dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention(
        query.cuda(), kv.key_cache, kv.value_cache, kv.block_tables, context_lens.cuda(), 256**-0.5,
        kv.k_scale_cache, kv.v_scale_cache, window=window, soft_cap=soft_cap,
    )  # fmt: skip
    assert_close(out, reference(query, clean, context_lens, 256**-0.5, window=window, soft_cap=soft_cap))


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
        (lambda a: a.update(window=-1), "window must be an int >= 0"),
        (lambda a: a.update(window=4.0), "window must be an int >= 0"),
        (lambda a: a.update(soft_cap=-1.0), "soft_cap must be a finite float >= 0"),
        (lambda a: a.update(soft_cap=float("nan")), "soft_cap must be a finite float >= 0"),
        (lambda a: a.update(soft_cap=float("inf")), "soft_cap must be a finite float >= 0"),
    ],
)
def test_rejects_bad_arguments(change, message):
    args = _valid_args()
    change(args)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args)
