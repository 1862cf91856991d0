from __future__ import annotations

import pytest
import torch

from kernels import cpu_int8_linear, write_kv_cache
from kernels.kv_cache import write_kv_cache_cpu, write_kv_cache_torch, write_kv_cache_triton
from kernels.reference import write_kv_cache_reference
from tests.kernels.helpers import BACKENDS

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 6, 4, 3, 24


def random_caches(cache_dtype: torch.dtype, scale_dtype: torch.dtype, gen: torch.Generator):
    """Caches already full of other tokens, so the test also sees that untouched slots stay as they were."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if cache_dtype == torch.int8:
        caches = [torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen) for _ in range(2)]
        scales = [torch.rand(shape[:3], generator=gen).to(scale_dtype) for _ in range(2)]
        return caches + scales
    return [torch.randn(shape, generator=gen).to(cache_dtype) for _ in range(2)] + [None, None]


def fused_qkv_slices(num_tokens: int, dtype: torch.dtype, gen: torch.Generator):
    """key and value as the engine makes them: strided views into one fused qkv projection output."""
    width = KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, 3 * width, generator=gen).to(dtype)
    key = qkv[:, width : 2 * width].view(num_tokens, KV_HEADS, HEAD_DIM)
    value = qkv[:, 2 * width :].view(num_tokens, KV_HEADS, HEAD_DIM)
    assert not key.is_contiguous()
    return key, value


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype", "scale_dtype"),
    [
        (torch.float32, torch.float32, None),
        (torch.bfloat16, torch.bfloat16, None),
        (torch.float32, torch.int8, torch.float32),
        (torch.bfloat16, torch.int8, torch.float32),
        (torch.bfloat16, torch.int8, torch.float16),
    ],
    ids=["fp32", "bf16", "fp32-int8", "bf16-int8", "bf16-int8-fp16scales"],
)
def test_matches_reference(backend, src_dtype, cache_dtype, scale_dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens = 9
    key, value = fused_qkv_slices(num_tokens, src_dtype, gen)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]  # scattered over blocks
    expected = random_caches(cache_dtype, scale_dtype, gen)
    actual = [t.clone().to(backend.device) if t is not None else None for t in expected]
    write_kv_cache_reference(key, value, *expected[:2], slots, *expected[2:])

    write = write_kv_cache_triton if backend.triton else write_kv_cache_torch
    device = backend.device
    write(key.to(device), value.to(device), actual[0], actual[1], slots.to(device), actual[2], actual[3])

    for got, want in zip(actual, expected, strict=True):
        if want is None:
            continue
        got = got.cpu()
        if got.dtype == torch.int8:
            # x / scale can round differently in the last bit on another device: allow one step, rarely.
            diff = (got.int() - want.int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01
            if not backend.triton:
                assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_round_trip_is_within_half_a_step(backend):
    """Dequantized values are within scale / 2 of the input; a zero row stores zeros, not NaN."""
    gen = torch.Generator().manual_seed(1)
    key, value = fused_qkv_slices(5, torch.float32, gen)
    key[2, 1] = 0.0
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [torch.zeros(shape, dtype=torch.int8, device=backend.device) for _ in range(2)]
    scales = [torch.zeros(shape[:3], device=backend.device) for _ in range(2)]
    slots = torch.tensor([0, 5, 11, 12, 23])
    write = write_kv_cache_triton if backend.triton else write_kv_cache_torch
    device = backend.device
    write(key.to(device), value.to(device), caches[0], caches[1], slots.to(device), scales[0], scales[1])
    for src, cache, scale in zip((key, value), caches, scales, strict=True):
        q = cache.cpu().view(-1, KV_HEADS, HEAD_DIM)[slots].float()
        s = scale.cpu().view(-1, KV_HEADS)[slots]
        assert torch.all((q * s[..., None] - src).abs() <= s[..., None] / 2 * (1 + 1e-5))
        assert q.abs().amax(dim=-1)[s > 1e-8].eq(127).all()  # the largest element maps to +-127
    assert caches[0].view(-1, KV_HEADS, HEAD_DIM)[11, 1].eq(0).all()


def test_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(2)
    key, value = fused_qkv_slices(3, torch.float32, gen)
    k8, v8, ks, vs = random_caches(torch.int8, torch.float32, gen)
    slots = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="k_scale_cache is required"):
        write_kv_cache(key, value, k8, v8, slots)
    with pytest.raises(ValueError, match="slot_mapping must be torch.int64"):
        write_kv_cache(key, value, k8, v8, slots.int(), ks, vs)
    with pytest.raises(ValueError, match=r"key must be \[num_tokens, num_kv_heads, head_dim\]"):
        write_kv_cache(key[:, :2], value, k8, v8, slots, ks, vs)
    with pytest.raises(ValueError, match="k_scale_cache must be float"):
        write_kv_cache(key, value, k8, v8, slots, ks[:, :2], vs)
    with pytest.raises(ValueError, match="contiguous"):
        write_kv_cache(key, value, k8.transpose(0, 1), v8.transpose(0, 1), slots, ks, vs)


@pytest.mark.skipif(not cpu_int8_linear.available(), reason="needs a C++ toolchain")
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16], ids=["fp32-scales", "fp16-scales"])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64], ids=["tail", "d64"])
def test_compiled_writer_is_bit_exact_with_torch(src_dtype, scale_dtype, head_dim):
    """The compiled INT8 writer: the same codes and scales as the torch path, on strided inputs, and the
    slots it is not given stay as they were."""
    gen = torch.Generator().manual_seed(7)
    num_tokens, width = 11, KV_HEADS * head_dim
    qkv = (torch.randn(num_tokens, 3 * width, generator=gen) * 3).to(src_dtype)
    key = qkv[:, width : 2 * width].view(num_tokens, KV_HEADS, head_dim)
    value = qkv[:, 2 * width :].view(num_tokens, KV_HEADS, head_dim)
    key[4, 1] = 0  # an all-zero row keeps the minimum scale
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, head_dim)
    want = [torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen) for _ in range(2)]
    want += [torch.rand(shape[:3], generator=gen).to(scale_dtype) for _ in range(2)]
    got = [t.clone() for t in want]
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    write_kv_cache_torch(key, value, want[0], want[1], slots, want[2], want[3])
    write_kv_cache_cpu(key, value, got[0], got[1], slots, got[2], got[3])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.skipif(not cpu_int8_linear.available(), reason="needs a C++ toolchain")
def test_compiled_writer_refuses_a_slot_outside_the_cache():
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [torch.zeros(shape, dtype=torch.int8) for _ in range(2)] + [
        torch.ones(shape[:3]) for _ in range(2)
    ]
    key = torch.randn(2, KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="outside the cache"):
        write_kv_cache_cpu(
            key, key, caches[0], caches[1], torch.tensor([0, NUM_BLOCKS * BLOCK_SIZE]), *caches[2:]
        )
