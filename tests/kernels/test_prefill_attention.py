from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch

from kernels import cpu_prefill_attention, paged_decode_attention, paged_prefill_attention, write_kv_cache
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
from tests.kernels.test_decode_attention import WINDOWS, reuse_blocks_before_window

BLOCK_SIZE = 8
# (queries in this chunk, total context after it). Whole prompts of 1, block_size - 1, block_size and
# block_size + 1 tokens (q_len == seq_len, plain causal), and chunks that continue a cached prefix, one of
# them a single token, one starting mid-block and spanning several blocks.
CHUNKS = [(1, 1), (BLOCK_SIZE - 1, BLOCK_SIZE - 1), (BLOCK_SIZE, BLOCK_SIZE), (BLOCK_SIZE + 1, BLOCK_SIZE + 1),
          (3, 4 * BLOCK_SIZE + 3), (19, 4 * BLOCK_SIZE + 5), (1, 2 * BLOCK_SIZE)]  # fmt: skip
# For sliding windows: whole prompts shorter and longer than the windows (tests/kernels/test_decode_attention.py
# WINDOWS), and chunks after cached prefixes longer than them (one a single token, one starting mid-block).
WINDOW_CHUNKS = [(1, 1), (BLOCK_SIZE - 1, BLOCK_SIZE - 1), (BLOCK_SIZE + 1, BLOCK_SIZE + 1), (3 * BLOCK_SIZE - 4,
                 3 * BLOCK_SIZE - 4), (3, 4 * BLOCK_SIZE + 3), (19, 4 * BLOCK_SIZE + 5), (1, 2 * BLOCK_SIZE),
                 (5, 6 * BLOCK_SIZE + 5)]  # fmt: skip


def packed_inputs(chunks: list[tuple[int, int]], num_heads: int, head_dim: int, dtype: torch.dtype):
    q_lens = [q for q, _ in chunks]
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(
        dtype
    )
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([n for _, n in chunks], dtype=torch.int32)
    return query, query_start_loc, seq_lens


def run_prefill(
    backend: Backend,
    query,
    kv: PagedKV,
    query_start_loc,
    seq_lens,
    scale: float,
    window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    kv = kv.to(backend.device)
    device = backend.device
    args = (query.to(device), kv.key_cache, kv.value_cache, kv.block_tables, query_start_loc.to(device))
    args = (*args, seq_lens.to(device), scale, kv.k_scale_cache, kv.v_scale_cache)
    options = dict(window=window, soft_cap=soft_cap)
    if backend.triton:
        tiles = {"block_m": 16, "block_n": 16} if backend.small_tiles else {}
        return paged_prefill_attention_triton(*args, **options, **tiles)
    return paged_prefill_attention_torch(*args, **options)


def reference(
    query, kv: PagedKV, query_start_loc, seq_lens, scale: float, window: int = 0, soft_cap: float = 0.0
) -> torch.Tensor:
    return paged_prefill_attention_reference(
        query, kv.key_cache, kv.value_cache, kv.block_tables, query_start_loc, seq_lens, scale,
        kv.k_scale_cache, kv.v_scale_cache, window=window, soft_cap=soft_cap,
    )  # fmt: skip


def first_keys(chunks: list[tuple[int, int]], window: int) -> list[int]:
    """Each chunk's first visible key, its first query's (position seq_len - q_len): the blocks wholly before
    it may be freed."""
    return [max(0, n - q - window + 1) if window else 0 for q, n in chunks]


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
# few heads: the interpreter's time grows with its programs, one per (query tile, head, sequence)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (3, 1)], ids=["mha", "gqa3"])
def test_sliding_window_matches_reference(backend, query_dtype, cache_dtype, num_heads, num_kv_heads):
    """Each window against prompts and prefixed chunks shorter and longer than it; the blocks before each
    chunk's first window are reused garbage (NaN), which must not reach the output."""
    head_dim = 32
    clean = make_paged_kv([n for _, n in WINDOW_CHUNKS], num_kv_heads, head_dim, BLOCK_SIZE, cache_dtype)
    query, query_start_loc, seq_lens = packed_inputs(WINDOW_CHUNKS, num_heads, head_dim, query_dtype)
    for window in WINDOWS:
        kv = reuse_blocks_before_window(clean, first_keys(WINDOW_CHUNKS, window), seed=window)
        out = run_prefill(backend, query, kv, query_start_loc, seq_lens, head_dim**-0.5, window=window)
        assert out.dtype == query_dtype and out.shape == query.shape
        assert_close(out, reference(query, clean, query_start_loc, seq_lens, head_dim**-0.5, window=window))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize("window", [0, 5], ids=["full", "window5"])
def test_soft_cap_matches_reference(backend, query_dtype, cache_dtype, window):
    """Scores spread over about +-10 against a cap of 3: capping changes the result (checked), alone and
    with a window."""
    head_dim, scale, soft_cap = 32, 0.5, 3.0
    clean = make_paged_kv([n for _, n in WINDOW_CHUNKS], 1, head_dim, BLOCK_SIZE, cache_dtype)
    kv = reuse_blocks_before_window(clean, first_keys(WINDOW_CHUNKS, window))
    query, query_start_loc, seq_lens = packed_inputs(WINDOW_CHUNKS, 3, head_dim, query_dtype)
    expected = reference(query, clean, query_start_loc, seq_lens, scale, window=window, soft_cap=soft_cap)
    uncapped = reference(query, clean, query_start_loc, seq_lens, scale, window=window)
    assert (expected.double() - uncapped.double()).abs().max() > 0.1
    out = run_prefill(backend, query, kv, query_start_loc, seq_lens, scale, window=window, soft_cap=soft_cap)
    assert_close(out, expected)


@pytest.mark.parametrize(("window", "soft_cap"), [(0, 0.0), (5, 0.0), (0, 3.0), (7, 3.0)])
def test_reference_matches_transformers(window, soft_cap):
    """The reference's window and soft cap are transformers': its sliding-window causal mask function
    (kv_idx > q_idx - window) and Gemma 2's eager attention (scores capped before the mask), over a whole
    prompt, and over a chunk after a cached prefix (the prompt's last rows)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    seq_len, num_heads, num_kv_heads, head_dim, scale = 29, 4, 2, 16, 0.6
    kv = make_paged_kv([seq_len], num_kv_heads, head_dim, 4, torch.float64)
    query = torch.randn(
        seq_len, num_heads, head_dim, generator=torch.Generator().manual_seed(9), dtype=torch.float64
    )
    table = kv.block_tables[0].long()
    slots = table[torch.arange(seq_len) // 4] * 4 + torch.arange(seq_len) % 4
    keys = kv.key_cache.view(-1, num_kv_heads, head_dim)[slots]  # [seq_len, kv_heads, D]
    values = kv.value_cache.view(-1, num_kv_heads, head_dim)[slots]
    mask_function = sliding_window_causal_mask_function(window) if window else causal_mask_function
    positions = torch.arange(seq_len)
    allowed = mask_function(0, 0, positions[:, None], positions[None, :])  # [seq_len, seq_len]
    additive = torch.zeros(seq_len, seq_len, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    module = types.SimpleNamespace(num_key_value_groups=num_heads // num_kv_heads, training=False)
    expected, _ = eager_attention_forward(
        module, query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        additive[None, None], scaling=scale, softcap=soft_cap or None,
    )  # fmt: skip
    expected = expected[0]  # [seq_len, num_heads, D]
    for q_len in (seq_len, 6):  # the whole prompt, then its last 6 rows after a prefix of 23
        starts = torch.tensor([0, q_len], dtype=torch.int32)
        ours = paged_prefill_attention_reference(
            query[-q_len:], kv.key_cache, kv.value_cache, kv.block_tables, starts,
            torch.tensor([seq_len], dtype=torch.int32), scale, window=window, soft_cap=soft_cap,
        )  # fmt: skip
        # transformers' eager attention takes its softmax in float32
        torch.testing.assert_close(ours, expected[-q_len:], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("query_dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.int8)]
)
@pytest.mark.parametrize(("window", "soft_cap"), [(5, 0.0), (0, 3.0), (BLOCK_SIZE, 3.0)])
def test_fresh_keys_with_window_and_soft_cap(query_dtype, cache_dtype, window, soft_cap):
    """The CPU paths given the chunks' own keys and values (SDPA / explicit attention, and the compiled
    kernel where it builds and supports head_dim 64), with reused garbage before each window."""
    chunks = [(1, 1), (20, 20), (3, 35), (19, 37), (1, 16), (12, 53)]
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    clean = make_paged_kv([n for _, n in chunks], num_kv_heads, head_dim, BLOCK_SIZE, cache_dtype)
    query, query_start_loc, seq_lens = packed_inputs(chunks, num_heads, head_dim, query_dtype)
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(query.shape[0], num_kv_heads, head_dim, generator=gen).to(query_dtype)
    value = torch.randn(query.shape[0], num_kv_heads, head_dim, generator=gen).to(query_dtype)
    slots = [
        int(clean.block_tables[seq, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
        for seq, (q_len, seq_len) in enumerate(chunks)
        for p in range(seq_len - q_len, seq_len)
    ]
    write_kv_cache(key, value, clean.key_cache, clean.value_cache, torch.tensor(slots), clean.k_scale_cache,
                   clean.v_scale_cache)  # fmt: skip
    kv = reuse_blocks_before_window(clean, first_keys(chunks, window))
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, query_start_loc, seq_lens, 0.3,
            kv.k_scale_cache, kv.v_scale_cache)  # fmt: skip
    expected = reference(query, clean, query_start_loc, seq_lens, 0.3, window=window, soft_cap=soft_cap)
    for compiled in (False, True):
        out = paged_prefill_attention(
            *args, key=key, value=value, compiled=compiled, window=window, soft_cap=soft_cap
        )
        if cache_dtype == torch.float32:
            assert_close(out, expected)
        else:  # INT8 rounding of the chunks' own K and V: about 1% of a value's range
            torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.05)


def stand_in_prefill_kernel(calls: list) -> Callable[..., None]:
    """A float64 stand-in for cpu_prefill_attention.prefill_attention_cpu, written to its contract: each
    chunk's queries are the last q_len rows of its context; context row i sees rows j, i - window < j <= i;
    scores scaled, then capped. It records (kv_lens, options) and checks that no gathered row is garbage."""

    def kernel(query, key, value, q_starts, q_lens, scale, out, kv_starts, kv_lens, **options) -> None:
        calls.append((kv_lens, options))
        assert torch.isfinite(key).all() and torch.isfinite(value).all()
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        for q_start, q_len, kv_start, kv_len in zip(q_starts, q_lens, kv_starts, kv_lens, strict=True):
            for i in range(kv_len - q_len, kv_len):
                seen = slice(kv_start + max(0, i - options.get("window", kv_len) + 1), kv_start + i + 1)
                token = q_start + i - (kv_len - q_len)
                q = (
                    query[token].view(num_kv_heads, num_heads // num_kv_heads, -1).double()
                )  # [kv_heads, group, D]
                scores = torch.einsum("hgd,jhd->hgj", q, key[seen].double()) * scale
                if options.get("soft_cap"):
                    scores = options["soft_cap"] * torch.tanh(scores / options["soft_cap"])
                attended = torch.einsum("hgj,jhd->hgd", torch.softmax(scores, dim=-1), value[seen].double())
                out[token] = attended.reshape(num_heads, -1).to(out.dtype)

    return kernel


def test_compiled_path_gathers_only_the_visible_prefix(monkeypatch):
    """What the torch path hands the compiled kernel (a stand-in here): with a window, for each chunk only
    the part of its cached prefix that its first query sees, none of it garbage, and the options; without
    options, whole contexts and no option keywords."""
    chunks = [(1, 1), (20, 20), (3, 35), (19, 37), (1, 16), (12, 53), (4, 6)]
    window, soft_cap, scale = 11, 3.0, 0.3
    clean = make_paged_kv([n for _, n in chunks], 2, 16, BLOCK_SIZE, torch.float32)
    query, query_start_loc, seq_lens = packed_inputs(chunks, 6, 16, torch.float32)
    rows = [int(clean.block_tables[seq, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
            for seq, (q_len, n) in enumerate(chunks) for p in range(n - q_len, n)]  # fmt: skip
    key = clean.key_cache.view(-1, 2, 16)[rows]  # the chunks' own keys and values, as the cache holds them
    value = clean.value_cache.view(-1, 2, 16)[rows]
    calls: list = []
    monkeypatch.setattr(cpu_prefill_attention, "supports", lambda query, key: True)
    monkeypatch.setattr(cpu_prefill_attention, "prefill_attention_cpu", stand_in_prefill_kernel(calls))

    kv = reuse_blocks_before_window(clean, first_keys(chunks, window))
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, query_start_loc, seq_lens, scale)
    out = paged_prefill_attention_torch(*args, key=key, value=value, window=window, soft_cap=soft_cap)
    visible_lens = [n - first for (_, n), first in zip(chunks, first_keys(chunks, window), strict=True)]
    assert calls == [(visible_lens, {"window": window, "soft_cap": soft_cap})]
    expected = reference(query, clean, query_start_loc, seq_lens, scale, window=window, soft_cap=soft_cap)
    assert_close(out, expected)

    args = (query, clean.key_cache, clean.value_cache, clean.block_tables, query_start_loc, seq_lens, scale)
    out = paged_prefill_attention_torch(*args, key=key, value=value)
    assert calls[-1] == ([n for _, n in chunks], {})
    assert_close(out, reference(query, clean, query_start_loc, seq_lens, scale))


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
    options = dict(window=10, soft_cap=2.0)
    prefill = paged_prefill_attention(query, *caches, query_start_loc, seq_lens, 0.2, *scales, **options)
    decode = paged_decode_attention(query, *caches, seq_lens, 0.2, *scales, **options)
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


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_PAIRS)
def test_cuda_window_and_soft_cap(query_dtype, cache_dtype):
    """Gemma 2's attention shape (8 heads, 4 kv heads, head_dim 256, cap 50; window 4096 scaled down to 100)
    with default tiles: a long prompt, a chunk after a prefix longer than the window whose blocks before it
    are reused garbage, a short prompt."""
    chunks = [(300, 300), (130, 517), (17, 17)]
    window, soft_cap = 100, 50.0
    clean = make_paged_kv([n for _, n in chunks], 4, 256, 16, cache_dtype)
    kv = reuse_blocks_before_window(clean, first_keys(chunks, window))
    query, query_start_loc, seq_lens = packed_inputs(chunks, 8, 256, query_dtype)
    out = run_prefill(
        Backend("cuda", "cuda"), query, kv, query_start_loc, seq_lens, 256**-0.5, window, soft_cap
    )
    expected = reference(query, clean, query_start_loc, seq_lens, 256**-0.5, window=window, soft_cap=soft_cap)
    assert_close(out, expected)


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
    for options, message in [
        (dict(window=-1), "window must be an int >= 0"),
        (dict(window=2.5), "window must be an int >= 0"),
        (dict(soft_cap=-0.5), "soft_cap must be a finite float >= 0"),
        (dict(soft_cap=float("nan")), "soft_cap must be a finite float >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            paged_prefill_attention(query, *caches, query_start_loc, seq_lens, 0.25, **options)


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
