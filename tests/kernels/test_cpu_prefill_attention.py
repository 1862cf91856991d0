"""The compiled CPU prefill-attention kernels (bfloat16 with AVX-512 BF16, float32 with AVX2 + FMA) against a
float64 causal reference."""

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
def test_matches_reference(dtype, head_dim, heads, kv_heads):
    q, k, v, starts = random_step(LENGTHS, heads, kv_heads, head_dim, seed=head_dim + heads, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    prefill_attention_cpu(q, k, v, starts, LENGTHS, head_dim**-0.5, out)
    want = causal_reference(q, k, v, starts, LENGTHS, head_dim**-0.5)
    torch.testing.assert_close(out.double(), want, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_writes_only_the_sequences_it_is_given(dtype):
    q, k, v, starts = random_step(LENGTHS, 6, 2, 64, seed=3, dtype=dtype)
    out = torch.full_like(q, 7.0)
    chosen = [1, 4, 8]  # the last sequence too: its keys end at the tensor's end
    prefill_attention_cpu(q, k, v, [starts[i] for i in chosen], [LENGTHS[i] for i in chosen], 0.125, out)
    want = causal_reference(q, k, v, starts, LENGTHS, 0.125)
    for i, (start, n) in enumerate(zip(starts, LENGTHS, strict=True)):
        rows = out[start : start + n]
        if i in chosen:
            torch.testing.assert_close(rows.double(), want[start : start + n], **tolerance(dtype))
        else:
            assert rows.eq(7.0).all()


@needs_f32
def test_float32_large_scores_stay_finite():
    """Scores in the hundreds (a sharp softmax): the online rescaling must not overflow or lose the peak."""
    q, k, v, starts = random_step(LENGTHS, 9, 3, 64, seed=11, dtype=torch.float32)
    out = torch.empty_like(q)
    prefill_attention_cpu(q * 8, k * 8, v, starts, LENGTHS, 0.125, out)
    torch.testing.assert_close(out.double(), causal_reference(q * 8, k * 8, v, starts, LENGTHS, 0.125),
                               **tolerance(torch.float32))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_function_uses_it_for_whole_context_chunks(dtype, monkeypatch):
    """paged_prefill_attention with fresh keys: whole-context sequences take the kernel, the rest the cache."""
    from kernels import write_kv_cache
    from tests.kernels.helpers import make_paged_kv

    calls = []
    monkeypatch.setattr(
        cpu_prefill_attention,
        "prefill_attention_cpu",
        lambda *args: calls.append(args[4]) or prefill_attention_cpu(*args),  # args[4]: seq_lens
    )
    lens = [40, 9]
    kv = make_paged_kv(lens, 2, 64, 16, dtype)
    q, k, v, starts = random_step(lens, 6, 2, 64, seed=5, dtype=dtype)
    slots = [int(kv.block_tables[s, p // 16]) * 16 + p % 16 for s, n in enumerate(lens) for p in range(n)]
    write_kv_cache(k, v, kv.key_cache, kv.value_cache, torch.tensor(slots))
    loc = torch.tensor([0, 40, 49], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, loc, seq_lens, 0.125)
    fresh = paged_prefill_attention(*args, key=k, value=v)
    assert calls == [lens]  # both sequences in one call
    torch.testing.assert_close(
        fresh.double(), causal_reference(q, k, v, starts, lens, 0.125), **tolerance(dtype)
    )
