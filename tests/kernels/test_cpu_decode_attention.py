"""The compiled CPU decode-attention kernel against the plain reference.

On x86 the kernel is built for the machine's ISA tier (AVX-512 or AVX2 code path); head_dim 32, 64 and 128
with up to 8 query heads per kv head take that path, other shapes the portable loop. Context lengths sit
around the block size, so blocks end part way and the slots left over by the AVX2 path's multi-slot
score steps are exercised too.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from kernels import cpu_decode_attention, paged_decode_attention
from kernels.cpu_decode_attention import paged_decode_attention_cpu, scores_int8_queries
from kernels.platform import active_tier
from kernels.reference import int8_query_reference, paged_decode_attention_reference
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


def expected(args) -> torch.Tensor:
    """The reference, with the query rounded to INT8 where the kernel scores INT8 keys against it."""
    query, key_cache, scale = args[0], args[1], args[5]
    if not scores_int8_queries(key_cache.dtype, query.shape[2], query.shape[1] // key_cache.shape[2]):
        return paged_decode_attention_reference(*args)
    rounded = list(args)
    rounded[0], rounded[5] = int8_query_reference(query.float() * scale), 1.0  # the wrapper folds the scale in
    return paged_decode_attention_reference(*rounded).to(query.dtype)  # rounded as the kernel's output is


@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_matches_reference(query_dtype, cache_dtype, num_heads, num_kv_heads, scale_dtype, head_dim):
    args = decode_args(CONTEXT_LENS, num_heads, num_kv_heads, head_dim, cache_dtype, query_dtype, scale_dtype)
    out = paged_decode_attention_cpu(*args)
    assert out.dtype == query_dtype and out.shape == args[0].shape
    want = expected(args)
    assert_close(out, want)
    assert_close(paged_decode_attention(*args), want)  # the public function dispatches here on CPU


@pytest.mark.parametrize("head_dim", [64, 128])
def test_blocks_of_more_than_16_slots_and_a_zero_query_head(head_dim):
    """The INT8 score pass takes a block 16 slots at a time (a 32-slot block is two such steps, a context may
    end in either, at an odd slot or an even one); an all-zero query head rounds to zero codes and attends
    uniformly."""
    args = list(decode_args([5, 16, 17, 31, 32, 33, 70], 6, 2, head_dim, torch.int8, torch.float32, block_size=32))
    args[0][1, 4] = 0.0
    assert_close(paged_decode_attention_cpu(*args), expected(args))


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8, 9])  # 9: past the compiled group sizes (portable loop)
def test_group_sizes(group):
    args = decode_args(CONTEXT_LENS, 2 * group, 2, 64, torch.int8, torch.float32, torch.float16, seed=group)
    assert_close(paged_decode_attention_cpu(*args), expected(args))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_float16_cache(head_dim):
    args = decode_args(CONTEXT_LENS, 6, 2, head_dim, torch.float16, torch.float32)
    assert_close(paged_decode_attention_cpu(*args), expected(args))


def test_many_sequences_of_mixed_length_land_in_their_rows():
    lens = torch.randint(1, 90, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    args = decode_args(lens, 9, 3, 64, torch.int8, torch.bfloat16, torch.float16, block_size=16, seed=4)
    assert_close(paged_decode_attention_cpu(*args), expected(args))


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
    assert_close(out, expected(args))


def draft_run_args(run_lens: list[int], run_rows: list[int], cache_dtype: torch.dtype, seed: int):
    """Rows as speculation lays them out: sequence i contributes run_rows[i] consecutive rows (its decode row
    and its draft tokens), sharing one block table, the last of them attending to run_lens[i] slots."""
    args = list(decode_args(run_lens, 9, 3, 64, cache_dtype, torch.float32, torch.float16, block_size=16, seed=seed))
    tables, lens = [], []
    for table, length, rows in zip(args[3], run_lens, run_rows, strict=True):
        tables += [table] * rows
        lens += range(length - rows + 1, length + 1)
    gen = torch.Generator().manual_seed(seed + 7)
    args[0] = torch.randn(len(lens), 9, 64, generator=gen)
    args[3] = torch.stack(tables)
    args[4] = torch.tensor(lens, dtype=torch.int32)
    return args


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float32])
@pytest.mark.parametrize(
    ("run_lens", "run_rows"),
    [([40], [5]), ([17, 33, 100, 6], [3, 1, 6, 2]), ([16, 32, 48], [2, 16, 4])],  # runs ending on, past, within blocks
    ids=["one-run", "mixed", "block-edges"],
)
def test_runs_of_draft_rows_match_rows_computed_alone(cache_dtype, run_lens, run_rows):
    """A run of rows of one sequence reads the cache once for the run; each row must come out exactly as it
    does alone (speculation is lossless only if a draft row's attention is its decode row's attention)."""
    args = draft_run_args(run_lens, run_rows, cache_dtype, seed=sum(run_lens))
    together = paged_decode_attention_cpu(*args)
    assert_close(together, expected(args))
    for row in range(args[0].shape[0]):
        alone = list(args)
        alone[0], alone[3], alone[4] = args[0][row : row + 1], args[3][row : row + 1], args[4][row : row + 1]
        assert torch.equal(paged_decode_attention_cpu(*alone)[0], together[row]), f"row {row}"


def test_rows_with_the_same_table_but_not_consecutive_positions_stay_apart():
    """Only rows one position apart form a run: the same table at equal or skipping lengths is computed
    row by row (a run would attend each row to the wrong number of slots)."""
    args = draft_run_args([60], [1], torch.int8, seed=11)
    args[0] = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(12))
    args[3] = args[3].repeat(3, 1)
    args[4] = torch.tensor([50, 50, 52], dtype=torch.int32)
    assert_close(paged_decode_attention_cpu(*args), expected(args))


@pytest.mark.skipif(active_tier() == "generic", reason="only the SIMD paths prefetch")
def test_the_build_keeps_its_software_prefetches():
    """Blocks sit anywhere in the pool, so the kernel prefetches the next ones while it works on this one.
    GCC 12 once deleted every prefetch (its mod-ref analysis took the out-of-line prefetch helper for a
    function without effects): the kernel ran ~20% slower and nothing else noticed."""
    library = cpu_decode_attention.load_extension().__file__
    listing = subprocess.run(["objdump", "-d", library], capture_output=True, text=True, check=True).stdout
    assert "prefetcht0" in listing
