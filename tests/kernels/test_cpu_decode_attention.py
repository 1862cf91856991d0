"""The compiled CPU decode-attention kernel against the plain reference.

On x86 the kernel is built for the machine's ISA tier (AVX-512 or AVX2 code path); head_dim 32, 64, 128 and
256 with up to 8 query heads per kv head take that path, other shapes the portable loop. Context lengths sit
around the block size, so blocks end part way and the slots left over by the AVX2 path's multi-slot
score steps are exercised too.

Sliding windows and soft-capping are checked against windowed_reference below, a float64 reference of this
file's own (kernels.reference's functions take neither option).
"""

from __future__ import annotations

import functools
import itertools
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


def expected(args, window: int = 0, soft_cap: float = 0.0) -> torch.Tensor:
    """The reference, with the query rounded to INT8 where the kernel scores INT8 keys against it."""
    query, key_cache, scale = args[0], args[1], args[5]
    reference = paged_decode_attention_reference
    if window or soft_cap:
        reference = functools.partial(windowed_reference, window=window, soft_cap=soft_cap)
    if not scores_int8_queries(key_cache.dtype, query.shape[2], query.shape[1] // key_cache.shape[2]):
        return reference(*args)
    rounded = list(args)
    rounded[0], rounded[5] = int8_query_reference(query.float() * scale), 1.0  # the wrapper folds the scale in
    return reference(*rounded).to(query.dtype)  # rounded as the kernel's output is


def windowed_reference(
    query, key_cache, value_cache, block_tables, context_lens, scale, k_scale_cache=None, v_scale_cache=None,
    *, window: int, soft_cap: float,
) -> torch.Tensor:  # fmt: skip
    """float64, row by row: row i attends slots [context_lens[i] - window, context_lens[i]) (all of them for
    window 0), reading only those; each score s (scale applied) becomes soft_cap * tanh(s / soft_cap)."""
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // kv_heads

    def read(cache, scales, slots):  # [n, kv_heads, head_dim] float64
        rows = cache.flatten(0, 1)[slots].double()
        return rows if scales is None else rows * scales.flatten(0, 1)[slots].double()[..., None]

    out = torch.empty(query.shape, dtype=torch.float64)
    for i, length in enumerate(context_lens.tolist()):
        positions = range(max(0, length - window) if window else 0, length)
        table = block_tables[i].tolist()
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in positions])
        keys = read(key_cache, k_scale_cache, slots).repeat_interleave(group, 1)  # [n, heads, D]
        values = read(value_cache, v_scale_cache, slots).repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", query[i].double(), keys) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), values)
    return out.to(query.dtype)


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


# ---------------------------------------------------------------------------------------------------------
# Sliding windows and soft-capping

# several sequences of mixed lengths
WINDOW_LENS = [1, 5, BLOCK_SIZE, BLOCK_SIZE + 1, 20, 4 * BLOCK_SIZE + 3, 57]
# 1; not a multiple of the block size; exactly one block; past it; larger than every context
WINDOWS = [1, 5, BLOCK_SIZE, 13, 1000]


def free_blocks_before_windows(args, window: int, rows_of_seq=None) -> None:
    """What the engine does with a sliding window: blocks wholly before a sequence's window are freed and
    reused. Here their table entries all name one block outside every context (NaN in float caches, NaN
    scales in INT8 ones), and the window's first block holds NaN in the slots before the window starts. A
    kernel that reads any of them returns NaN. rows_of_seq: row ranges sharing one table (draft runs); the
    earliest window start of the range counts."""
    if not window:
        return
    key_cache, value_cache, tables, lens = args[1], args[2], args[3], args[4]
    block_size = key_cache.shape[1]
    in_context = {int(tables[i, t // block_size]) for i, n in enumerate(lens.tolist()) for t in range(n)}
    nan_block = next(b for b in range(key_cache.shape[0]) if b not in in_context)
    for rows in rows_of_seq or [range(i, i + 1) for i in range(len(lens))]:
        start = max(0, int(lens[rows[0]]) - window)  # the first row of a run starts earliest
        first_block = start // block_size
        for row in rows:
            tables[row, :first_block] = nan_block
        block = int(tables[rows[0], first_block])
        if args[6] is not None:
            args[6][block, : start % block_size] = float("nan")
            args[7][block, : start % block_size] = float("nan")
        else:
            key_cache[block, : start % block_size] = float("nan")
            value_cache[block, : start % block_size] = float("nan")


@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS[:3])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 1)], ids=["gqa3", "gqa4"])
@pytest.mark.parametrize("window", WINDOWS)
def test_window_matches_reference_and_never_reads_before_it(query_dtype, cache_dtype, num_heads, num_kv_heads,
                                                            window):  # fmt: skip
    args = list(decode_args(WINDOW_LENS, num_heads, num_kv_heads, 64, cache_dtype, query_dtype, seed=window))
    want = expected(args, window=window)
    free_blocks_before_windows(args, window)
    out = paged_decode_attention_cpu(*args, window=window)
    assert not out.isnan().any()
    assert_close(out, want)


@pytest.mark.parametrize("window", [3, 16, 40])
@pytest.mark.parametrize("head_dim", [32, 128, 256])
def test_window_at_other_head_dims_and_block_sizes(window, head_dim):
    """head_dim 32, 128, 256 (and 64 above); 32-slot blocks, which the INT8 score pass takes 16 at a time."""
    args = list(decode_args([5, 31, 33, 70, 129], 8, 2, head_dim, torch.int8, torch.float32, block_size=32))
    want = expected(args, window=window)
    free_blocks_before_windows(args, window)
    assert_close(paged_decode_attention_cpu(*args, window=window), want)


@pytest.mark.parametrize("window", [0, 3, 10])
@pytest.mark.parametrize("soft_cap", [0.0, 1.5])
def test_window_and_soft_cap_on_the_portable_path(window, soft_cap):
    """Groups of 9 heads are past the compiled group sizes: the portable loop takes them."""
    args = list(decode_args(WINDOW_LENS, 18, 2, 64, torch.int8, torch.float32, seed=3))
    args[0] = args[0] * 3  # scores of a few units: the cap bends them
    want = expected(args, window=window, soft_cap=soft_cap)
    free_blocks_before_windows(args, window)
    assert_close(paged_decode_attention_cpu(*args, window=window, soft_cap=soft_cap), want)


@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize("soft_cap", [0.5, 2.0, 50.0])
@pytest.mark.parametrize("window", [0, 6])
def test_soft_cap_matches_reference(query_dtype, cache_dtype, soft_cap, window):
    """Queries scaled up so that scores reach several units: a cap of 0.5 or 2 saturates most of them, 50
    barely bends them (Gemma 2's attention cap)."""
    args = list(decode_args(WINDOW_LENS, 6, 2, 64, cache_dtype, query_dtype, seed=int(soft_cap) + window))
    args[0] = (args[0].float() * 4).to(query_dtype)
    want = expected(args, window=window, soft_cap=soft_cap)
    free_blocks_before_windows(args, window)
    assert_close(paged_decode_attention_cpu(*args, window=window, soft_cap=soft_cap), want)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float32])
@pytest.mark.parametrize(
    ("run_lens", "run_rows"),
    [([40], [5]), ([17, 33, 100, 6], [3, 1, 6, 2]), ([16, 32, 48], [2, 16, 4])],
    ids=["one-run", "mixed", "block-edges"],
)
@pytest.mark.parametrize(
    ("window", "soft_cap"), [(1, 0.0), (7, 0.0), (16, 0.0), (21, 0.0), (7, 2.0), (0, 2.0)]
)
def test_runs_of_draft_rows_with_a_window_match_rows_computed_alone(cache_dtype, run_lens, run_rows, window,
                                                                    soft_cap):  # fmt: skip
    """Each row of a run has its own window start (one slot later per row) and is still computed bit for bit
    as alone, blocks before the run's first window freed (NaN)."""
    args = draft_run_args(run_lens, run_rows, cache_dtype, seed=sum(run_lens) + window)
    args[0] = args[0] * 2
    want = expected(args, window=window, soft_cap=soft_cap)
    bounds = [0, *itertools.accumulate(run_rows)]
    free_blocks_before_windows(args, window, [range(a, b) for a, b in itertools.pairwise(bounds)])
    together = paged_decode_attention_cpu(*args, window=window, soft_cap=soft_cap)
    assert_close(together, want)
    for row in range(args[0].shape[0]):
        alone = list(args)
        alone[0], alone[3], alone[4] = args[0][row : row + 1], args[3][row : row + 1], args[4][row : row + 1]
        alone_out = paged_decode_attention_cpu(*alone, window=window, soft_cap=soft_cap)
        assert torch.equal(alone_out[0], together[row]), f"row {row}"


@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(4, 1), (8, 4), (8, 1)], ids=["gemma3-270m", "gqa2", "gqa8"]
)
def test_head_dim_256(query_dtype, cache_dtype, num_heads, num_kv_heads):
    """Gemma 3 (270M: 4 heads, 1 kv head) and Gemma 2 use head_dim 256: the compiled fast path takes it."""
    lens = CONTEXT_LENS + [70]
    args = decode_args(lens, num_heads, num_kv_heads, 256, cache_dtype, query_dtype, block_size=16)
    assert_close(paged_decode_attention_cpu(*args), expected(args))


def test_rejects_a_negative_window_or_cap():
    args = decode_args([4], 2, 2, 64, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention_cpu(*args, window=-1)
    with pytest.raises(ValueError, match="soft_cap"):
        paged_decode_attention_cpu(*args, soft_cap=-1.0)
