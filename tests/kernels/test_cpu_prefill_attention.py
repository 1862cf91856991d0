"""The compiled CPU prefill-attention kernels (bfloat16 with AVX-512 BF16, float32 with AVX2 + FMA) against a
float64 causal reference; sliding windows and soft-capping against windowed_reference, a float64 reference
of this file's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_prefill_attention, paged_prefill_attention
from kernels.cpu_prefill_attention import prefill_attention_cpu

pytestmark = pytest.mark.skipif(
    cpu_prefill_attention.load_extension() is None, reason="needs a C++ toolchain"
)
needs_bf16 = pytest.mark.skipif(
    not cpu_prefill_attention.available(torch.bfloat16), reason="needs AVX-512 BF16"
)
needs_f32 = pytest.mark.skipif(not cpu_prefill_attention.available(torch.float32), reason="needs AVX2 + FMA")
needs_amx = pytest.mark.skipif(not cpu_prefill_attention.amx_enabled(), reason="needs AMX-BF16")
# (query dtype, AMX): bfloat16 runs on AMX tiles where the CPU has them, else on AVX-512 BF16; both are
# tested there
KERNELS = [
    pytest.param(torch.bfloat16, False, id="bf16", marks=needs_bf16),
    pytest.param(torch.bfloat16, True, id="bf16-amx", marks=[needs_bf16, needs_amx]),
    pytest.param(torch.float32, False, id="f32", marks=needs_f32),
]
DTYPES = [
    pytest.param(torch.bfloat16, id="bf16", marks=needs_bf16),
    pytest.param(torch.float32, id="f32", marks=needs_f32),
]
# around the kernels' key tiles (16 keys for float32, 32 for bfloat16), and a long one
LENGTHS = [1, 15, 16, 17, 31, 32, 33, 7, 200]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    # bf16 inputs and output, probabilities rounded to bf16 before P.V as in bf16 SDPA; float32 throughout
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}


def causal_reference(q, k, v, starts, lens, scale) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for start, n in zip(starts, lens, strict=True):
        rows = slice(start, start + n)
        qq = q[rows].transpose(0, 1).double()
        kk = k[rows].transpose(0, 1).double().repeat_interleave(group, 0)
        vv = v[rows].transpose(0, 1).double().repeat_interleave(group, 0)
        out[rows] = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale).transpose(0, 1)
    return out


def random_step(lens: list[int], heads: int, kv_heads: int, head_dim: int, seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return q, k, v, starts


@pytest.mark.parametrize(("dtype", "amx"), KERNELS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
def test_matches_reference(dtype, head_dim, heads, kv_heads, amx):
    q, k, v, starts = random_step(LENGTHS, heads, kv_heads, head_dim, seed=head_dim + heads, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    prefill_attention_cpu(q, k, v, starts, LENGTHS, head_dim**-0.5, out, amx=amx)
    want = causal_reference(q, k, v, starts, LENGTHS, head_dim**-0.5)
    torch.testing.assert_close(out.double(), want, **tolerance(dtype))


@pytest.mark.parametrize(("dtype", "amx"), KERNELS)
def test_writes_only_the_sequences_it_is_given(dtype, amx):
    q, k, v, starts = random_step(LENGTHS, 6, 2, 64, seed=3, dtype=dtype)
    out = torch.full_like(q, 7.0)
    chosen = [1, 4, 8]  # the last sequence too: its keys end at the tensor's end
    prefill_attention_cpu(
        q, k, v, [starts[i] for i in chosen], [LENGTHS[i] for i in chosen], 0.125, out, amx=amx
    )
    want = causal_reference(q, k, v, starts, LENGTHS, 0.125)
    for i, (start, n) in enumerate(zip(starts, LENGTHS, strict=True)):
        rows = out[start : start + n]
        if i in chosen:
            torch.testing.assert_close(rows.double(), want[start : start + n], **tolerance(dtype))
        else:
            assert rows.eq(7.0).all()


@needs_amx
def test_amx_large_scores_stay_finite():
    """A sharp softmax on AMX tiles: the first pass's row maxima keep every exponent at or below 0."""
    q, k, v, starts = random_step(LENGTHS, 9, 3, 64, seed=12, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    prefill_attention_cpu(q * 8, k * 8, v, starts, LENGTHS, 0.125, out, amx=True)
    torch.testing.assert_close(out.double(), causal_reference(q * 8, k * 8, v, starts, LENGTHS, 0.125),
                               **tolerance(torch.bfloat16))  # fmt: skip


@needs_f32
def test_float32_large_scores_stay_finite():
    """Scores in the hundreds (a sharp softmax): the online rescaling must not overflow or lose the peak."""
    q, k, v, starts = random_step(LENGTHS, 9, 3, 64, seed=11, dtype=torch.float32)
    out = torch.empty_like(q)
    prefill_attention_cpu(q * 8, k * 8, v, starts, LENGTHS, 0.125, out)
    torch.testing.assert_close(out.double(), causal_reference(q * 8, k * 8, v, starts, LENGTHS, 0.125),
                               **tolerance(torch.float32))  # fmt: skip


@pytest.mark.parametrize(("dtype", "amx"), KERNELS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 2)], ids=["gqa3", "gqa4"])
def test_chunks_after_a_prefix_match_reference(dtype, heads, kv_heads, amx):
    """kv_starts/kv_lens: each chunk's queries are the last q_len positions of a longer context."""
    # a whole context, a single query, chunks across tile edges
    out, want = attend_chunks([40, 17, 33, 200, 5], [16, 17, 1, 75, 4], heads, kv_heads, 21, dtype, amx)
    torch.testing.assert_close(out, want, **tolerance(dtype))


def attend_chunks(
    contexts: list[int],
    q_lens: list[int],
    heads: int,
    kv_heads: int,
    seed: int,
    dtype: torch.dtype,
    amx: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks whose queries are the last q_len positions of their contexts, packed on their own (keys and
    values stay whole contexts): the kernel's output and the float64 reference for those rows."""
    q, k, v, kv_starts = random_step(contexts, heads, kv_heads, 64, seed=seed, dtype=dtype)
    want = causal_reference(q, k, v, kv_starts, contexts, 0.125)
    rows = torch.cat(
        [torch.arange(s + n - m, s + n) for s, n, m in zip(kv_starts, contexts, q_lens, strict=True)]
    )
    chunk_q = q[rows].contiguous()
    q_starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    out = torch.full_like(chunk_q, float("nan"))
    prefill_attention_cpu(
        chunk_q, k, v, q_starts, q_lens, 0.125, out, kv_starts=kv_starts, kv_lens=contexts, amx=amx
    )
    return out.double(), want[rows]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rejects_chunks_outside_the_tensors(dtype):
    q, k, v, starts = random_step([8, 8], 2, 2, 64, seed=2, dtype=dtype)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="q_len must be in"):
        prefill_attention_cpu(q, k, v, [0], [8], 0.125, out, kv_starts=[0], kv_lens=[4])
    with pytest.raises(RuntimeError, match="key rows out of range"):
        prefill_attention_cpu(q, k, v, [0], [8], 0.125, out, kv_starts=[10], kv_lens=[8])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", ["same", torch.int8])
def test_public_function_runs_every_chunk_in_one_call(dtype, cache_dtype, monkeypatch):
    """paged_prefill_attention with fresh keys: whole-context chunks and chunks after a cached prefix (read
    from the paged cache, dequantized when it is int8) all take the kernel, in one call."""
    from kernels import write_kv_cache
    from tests.kernels.helpers import make_paged_kv

    calls = []
    monkeypatch.setattr(
        cpu_prefill_attention,
        "prefill_attention_cpu",
        lambda *args, **kw: calls.append(kw["kv_lens"]) or prefill_attention_cpu(*args, **kw),
    )
    cache_dtype = dtype if cache_dtype == "same" else cache_dtype
    contexts, q_lens = [40, 9, 50], [40, 9, 18]  # the last: 32 cached tokens (two blocks), then 18 new
    kv = make_paged_kv(contexts, 2, 64, 16, cache_dtype, seed=4)
    q, k, v, starts = random_step(contexts, 6, 2, 64, seed=5, dtype=dtype)
    slots = [int(kv.block_tables[s, p // 16]) * 16 + p % 16 for s, n in enumerate(contexts) for p in range(n)]
    write_kv_cache(
        k, v, kv.key_cache, kv.value_cache, torch.tensor(slots), kv.k_scale_cache, kv.v_scale_cache
    )
    rows = torch.cat(
        [torch.arange(s + n - m, s + n) for s, n, m in zip(starts, contexts, q_lens, strict=True)]
    )
    loc = torch.tensor([0, 40, 49, 67], dtype=torch.int32)
    args = (q[rows], kv.key_cache, kv.value_cache, kv.block_tables, loc, torch.tensor(contexts, dtype=torch.int32),
            0.125, kv.k_scale_cache, kv.v_scale_cache)  # fmt: skip
    got = paged_prefill_attention(*args, key=k[rows], value=v[rows])
    assert calls == [contexts]  # every chunk in one call
    # the prefix as the cache holds it (rounded to int8 there), the chunks' own keys as computed
    k_seen, v_seen = k.clone(), v.clone()
    if cache_dtype == torch.int8:
        for t, cache, scales in (
            (k_seen, kv.key_cache, kv.k_scale_cache),
            (v_seen, kv.value_cache, kv.v_scale_cache),
        ):
            for p in range(32):
                slot = slots[49 + p]
                t[49 + p] = (
                    cache.view(-1, 2, 64)[slot].float() * scales.view(-1, 2)[slot, :, None].float()
                ).to(dtype)
    want = causal_reference(q, k_seen, v_seen, starts, contexts, 0.125)
    torch.testing.assert_close(got.double(), want[rows], **tolerance(dtype))


@pytest.mark.parametrize(("dtype", "amx"), KERNELS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_row_blocks_split_by_work_across_threads(dtype, threads, amx):
    """Row blocks of later positions attend to more keys; threads take ranges of near-equal keys
    (balanced_parallel.h), over chunks sorted by length behind cached prefixes of different lengths; on AMX
    each thread configures its own tiles."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, want = attend_chunks([9, 30, 64, 120, 260], [9, 12, 1, 100, 130], 9, 3, 23, dtype, amx)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, want, **tolerance(dtype))


# ---------------------------------------------------------------------------------------------------------
# Sliding windows, soft-capping, head_dim 256


def windowed_reference(q, k, v, kv_starts, contexts, q_lens, scale, window=0, soft_cap=0.0) -> torch.Tensor:
    """float64: the last q_len rows of each context as queries (rows of `q` at the same index as in k and v);
    the query at context index i sees context rows j with i - window < j <= i (j <= i for window 0), each
    score s (scale applied) becoming soft_cap * tanh(s / soft_cap). Returns those queries' rows, in order."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for start, n, m in zip(kv_starts, contexts, q_lens, strict=True):
        kk = k[start : start + n].double().repeat_interleave(group, 1)  # [n, heads, D]
        vv = v[start : start + n].double().repeat_interleave(group, 1)
        qq = q[start + n - m : start + n].double()  # [m, heads, D]
        scores = torch.einsum("ihd,jhd->hij", qq, kk) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        i = torch.arange(n - m, n)[:, None]
        j = torch.arange(n)[None, :]
        visible = (j <= i) & ((j > i - window) if window else True)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        outs.append(torch.einsum("hij,jhd->ihd", probs, vv))
    return torch.cat(outs)


def attend_windowed(contexts, q_lens, heads, kv_heads, head_dim, seed, dtype, amx=False, *, window=0,
                    soft_cap=0.0, score_gain=1.0, nan_before_window=False):  # fmt: skip
    """attend_chunks with options: the kernel's output for the chunks' queries and the reference. With
    nan_before_window, context rows before the first query's window hold NaN (the kernel must not read
    them)."""
    q, k, v, kv_starts = random_step(contexts, heads, kv_heads, head_dim, seed=seed, dtype=dtype)
    q = (q.float() * score_gain).to(dtype)
    scale = head_dim**-0.5
    want = windowed_reference(q, k, v, kv_starts, contexts, q_lens, scale, window, soft_cap)
    if nan_before_window and window:
        k, v = k.clone(), v.clone()
        for start, n, m in zip(kv_starts, contexts, q_lens, strict=True):
            unseen = max(0, n - m - window + 1)
            k[start : start + unseen] = float("nan")
            v[start : start + unseen] = float("nan")
    rows = [torch.arange(s + n - m, s + n) for s, n, m in zip(kv_starts, contexts, q_lens, strict=True)]
    chunk_q = q[torch.cat(rows)].contiguous()
    q_starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    out = torch.full_like(chunk_q, float("nan"))
    prefill_attention_cpu(chunk_q, k, v, q_starts, q_lens, scale, out, kv_starts=kv_starts, kv_lens=contexts,
                          amx=amx, window=window, soft_cap=soft_cap)  # fmt: skip
    return out.double(), want


# whole contexts, a single query after a prefix, chunks across tile edges (16 keys float32, 32 bfloat16)
CHUNK_CONTEXTS, CHUNK_Q_LENS = [40, 17, 33, 200, 5, 90], [40, 17, 1, 75, 4, 13]


@pytest.mark.parametrize(("dtype", "amx"), KERNELS)
# 1; off, on and past the key tiles; larger than every context
@pytest.mark.parametrize("window", [1, 7, 16, 17, 32, 50, 1000])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 1)], ids=["gqa3", "gqa4"])
def test_window_matches_reference_and_never_reads_before_it(dtype, amx, window, heads, kv_heads):
    """Context rows before the first query's window hold NaN: the kernel must not read them."""
    out, want = attend_windowed(CHUNK_CONTEXTS, CHUNK_Q_LENS, heads, kv_heads, 64, 31 + window, dtype, amx,
                                window=window, nan_before_window=True)  # fmt: skip
    torch.testing.assert_close(out, want, **tolerance(dtype))


@pytest.mark.parametrize(("dtype", "amx"), KERNELS)
@pytest.mark.parametrize("window", [5, 24])
def test_a_context_trimmed_to_the_window_gives_the_same_rows(dtype, amx, window):
    """The caller may pass only the context rows the window can reach (or any front past them): indices stay
    relative to the context passed, so the output is the same."""
    out, want = attend_windowed([150, 64], [40, 64], 6, 2, 64, 5, dtype, amx, window=window)
    trimmed, _ = attend_windowed([150, 64], [40, 64], 6, 2, 64, 5, dtype, amx, window=window,
                                 nan_before_window=True)  # fmt: skip
    torch.testing.assert_close(out, want, **tolerance(dtype))
    torch.testing.assert_close(trimmed, out, rtol=0, atol=0)
    # the same chunk given a context that starts at the first query's window (rows before it dropped)
    q, k, v, kv_starts = random_step([150], 6, 2, 64, seed=9, dtype=dtype)
    scale, cut = 0.125, 150 - 40 - window + 1
    whole, part = torch.empty_like(q[110:]), torch.empty_like(q[110:])
    prefill_attention_cpu(q[110:], k, v, [0], [40], scale, whole, kv_starts=[0], kv_lens=[150], amx=amx,
                          window=window)  # fmt: skip
    prefill_attention_cpu(q[110:], k[cut:], v[cut:], [0], [40], scale, part, kv_starts=[0],
                          kv_lens=[150 - cut], amx=amx, window=window)  # fmt: skip
    torch.testing.assert_close(part, whole, rtol=0, atol=0)


@pytest.mark.parametrize(("dtype", "amx"), KERNELS)
@pytest.mark.parametrize("soft_cap", [0.5, 3.0, 50.0])
@pytest.mark.parametrize("window", [0, 20])
def test_soft_cap_matches_reference(dtype, amx, soft_cap, window):
    """Scores of several units (queries scaled up): caps of 0.5 and 3 saturate many, 50 (Gemma 2's) bends them
    a little."""
    out, want = attend_windowed(CHUNK_CONTEXTS, CHUNK_Q_LENS, 9, 3, 64, 41, dtype, amx, window=window,
                                soft_cap=soft_cap, score_gain=4.0)  # fmt: skip
    torch.testing.assert_close(out, want, **tolerance(dtype))


@pytest.mark.parametrize(("dtype", "amx"), KERNELS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 1), (8, 4)], ids=["gemma3-270m", "gqa2"])
@pytest.mark.parametrize(("window", "soft_cap"), [(0, 0.0), (37, 0.0), (0, 30.0), (37, 30.0)])
def test_head_dim_256(dtype, amx, heads, kv_heads, window, soft_cap):
    """Gemma 3 (270M: 4 heads, 1 kv head; sliding-window layers) and Gemma 2 (soft cap) use head_dim 256."""
    out, want = attend_windowed(CHUNK_CONTEXTS, CHUNK_Q_LENS, heads, kv_heads, 256, 51, dtype, amx, window=window,
                                soft_cap=soft_cap, score_gain=2.0)  # fmt: skip
    torch.testing.assert_close(out, want, **tolerance(dtype))


@pytest.mark.parametrize(("dtype", "amx"), KERNELS)
@pytest.mark.parametrize("threads", [1, 3])
def test_windowed_row_blocks_split_across_threads(dtype, amx, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, want = attend_windowed([9, 30, 64, 120, 260], [9, 12, 1, 100, 130], 9, 3, 64, 23, dtype, amx,
                                    window=33, soft_cap=5.0, nan_before_window=True)  # fmt: skip
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, want, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rejects_a_negative_window_or_cap(dtype):
    q, k, v, starts = random_step([8], 2, 2, 64, seed=2, dtype=dtype)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="window"):
        prefill_attention_cpu(q, k, v, [0], [8], 0.125, out, window=-1)
    with pytest.raises(ValueError, match="soft_cap"):
        prefill_attention_cpu(q, k, v, [0], [8], 0.125, out, soft_cap=-2.0)
