"""The compiled CPU prefill-attention kernel (AVX-512 BF16) against a float64 causal reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_prefill_attention, paged_prefill_attention
from kernels.cpu_prefill_attention import prefill_attention_cpu

pytestmark = pytest.mark.skipif(
    cpu_prefill_attention.load_extension() is None, reason="needs a C++ toolchain and AVX-512 BF16"
)
LENGTHS = [1, 31, 32, 33, 7, 200]  # around the kernel's 32-key tiles, and a long one


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


def random_step(lens: list[int], heads: int, kv_heads: int, head_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, heads, head_dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return q, k, v, starts


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (9, 3)], ids=["mha", "gqa3"])
def test_matches_reference(head_dim, heads, kv_heads):
    q, k, v, starts = random_step(LENGTHS, heads, kv_heads, head_dim, seed=head_dim + heads)
    out = torch.full_like(q, float("nan"))
    prefill_attention_cpu(q, k, v, starts, LENGTHS, head_dim**-0.5, out)
    want = causal_reference(q, k, v, starts, LENGTHS, head_dim**-0.5)
    # bf16 inputs and output; probabilities rounded to bf16 before P.V, as in bf16 SDPA
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


def test_writes_only_the_sequences_it_is_given():
    q, k, v, starts = random_step(LENGTHS, 6, 2, 64, seed=3)
    out = torch.full_like(q, 7.0)
    chosen = [1, 4]
    prefill_attention_cpu(q, k, v, [starts[i] for i in chosen], [LENGTHS[i] for i in chosen], 0.125, out)
    want = causal_reference(q, k, v, starts, LENGTHS, 0.125)
    for i, (start, n) in enumerate(zip(starts, LENGTHS, strict=True)):
        rows = out[start : start + n]
        if i in chosen:
            torch.testing.assert_close(rows.double(), want[start : start + n], atol=2e-2, rtol=2e-2)
        else:
            assert rows.eq(7.0).all()


def test_public_function_uses_it_for_whole_context_chunks():
    """paged_prefill_attention with fresh keys: whole-context sequences take the kernel, the rest the cache."""
    from tests.kernels.helpers import make_paged_kv

    lens = [40, 9]
    kv = make_paged_kv(lens, 2, 64, 16, torch.bfloat16)
    q, k, v, starts = random_step(lens, 6, 2, 64, seed=5)
    slots = [int(kv.block_tables[s, p // 16]) * 16 + p % 16 for s, n in enumerate(lens) for p in range(n)]
    from kernels import write_kv_cache

    write_kv_cache(k, v, kv.key_cache, kv.value_cache, torch.tensor(slots))
    loc = torch.tensor([0, 40, 49], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, loc, seq_lens, 0.125)
    fresh = paged_prefill_attention(*args, key=k, value=v)
    torch.testing.assert_close(
        fresh.double(), causal_reference(q, k, v, starts, lens, 0.125), atol=2e-2, rtol=2e-2
    )
