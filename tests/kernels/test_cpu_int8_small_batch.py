"""The small-batch int8 product (csrc/int8_small_batch_cpu.cpp) and the linear built on it, against exact
float64 references on random codes, and against the library GEMM paths bit for bit (the same codes give
exact integer products on both, so the engine's per-batch-size dispatch never changes an output)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_int8_linear, cpu_int8_small_batch, int8_linear, quantize_weight_per_channel
from kernels.cpu_int8_small_batch import (
    int8_linear_silu_mul_small_batch,
    int8_linear_small_batch,
    int8_product,
)
from kernels.int8_linear import int8_linear_silu_mul
from kernels.reference import int8_linear_reference

pytestmark = pytest.mark.skipif(not cpu_int8_small_batch.available(), reason="no C++ toolchain to build the kernel")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def codes(*shape: int, seed: int, qmax: int = 127) -> torch.Tensor:
    return torch.randint(-qmax, qmax + 1, shape, dtype=torch.int8, generator=generator(seed))


# K past a multiple of 32 or 64 (the vector loops' tails), N past a multiple of 4 (the row tile) and of 16 (a
# task), M past a multiple of 4 by 1, 2 and 3 (the VNNI tile's activation rows)
@pytest.mark.parametrize(
    ("M", "K", "N"), [(1, 32, 4), (3, 100, 37), (6, 64, 8), (16, 576, 960), (17, 130, 12), (40, 1537, 19)]
)
def test_product_is_the_exact_integer_sum(M, K, N):
    x_q, w_q = codes(M, K, seed=M), codes(N, K, seed=N)
    want = x_q.double() @ w_q.double().t()
    assert torch.equal(int8_product(x_q, w_q).double(), want)


@pytest.mark.parametrize(
    ("M", "K", "N"), [(1, 32, 4), (3, 100, 37), (6, 64, 8), (16, 576, 960), (17, 130, 12), (40, 1537, 19)]
)
def test_seven_bit_codes_with_row_sums_give_the_exact_integer_sum(M, K, N):
    # 7-bit weights (the oneDNN backend's without VNNI) and the most negative activation code: the AVX2 loop's
    # unsigned form shifts every activation by 128 and takes 128 * sum(w) off again
    x_q, w_q = codes(M, K, seed=M + 7), codes(N, K, seed=N + 7, qmax=63)
    x_q[0, :5] = -128
    w_q[0, :3] = torch.tensor([63, -63, -63], dtype=torch.int8)
    sums = cpu_int8_small_batch.seven_bit_row_sums(w_q)
    assert sums is not None and torch.equal(sums, w_q.sum(1, dtype=torch.int32))
    want = x_q.double() @ w_q.double().t()
    assert torch.equal(int8_product(x_q, w_q, w_sums=sums).double(), want)
    x = torch.randn(M, K, generator=generator(M))
    scale = torch.rand(N, generator=generator(N)) / 50
    assert torch.equal(int8_linear_small_batch(x, w_q, scale, w_sums=sums), int8_linear_small_batch(x, w_q, scale))


def test_row_sums_only_for_seven_bit_codes():
    assert cpu_int8_small_batch.seven_bit_row_sums(codes(8, 64, seed=3, qmax=63)) is not None
    eight_bit = codes(8, 64, seed=3, qmax=63)
    eight_bit[5, 7] = 64
    assert cpu_int8_small_batch.seven_bit_row_sums(eight_bit) is None
    with pytest.raises(ValueError, match="w_sums must be int32"):
        int8_product(codes(2, 64, seed=1), codes(8, 64, seed=2), w_sums=torch.zeros(7, dtype=torch.int32))


# M from below the tiles' threshold (8 rows) through partial and several 16-row blocks and more than the four
# accumulated at once (70), K multiples of 64 (what the tiles take; others keep the SIMD loop), N past a
# multiple of 16 (the last rows take the SIMD loop)
@pytest.mark.skipif(not cpu_int8_small_batch.amx_enabled(), reason="no AMX-INT8 on this CPU (or not allowed)")
@pytest.mark.parametrize(("M", "K", "N"), [(8, 64, 16), (16, 576, 50), (17, 1536, 576), (40, 576, 3072), (70, 128, 33)])
def test_amx_product_is_the_exact_integer_sum_and_equals_the_simd_loop(M, K, N):
    x_q, w_q = codes(M, K, seed=M + 1), codes(N, K, seed=N + 1)
    want = x_q.double() @ w_q.double().t()
    on_tiles = int8_product(x_q, w_q, amx=True)
    assert torch.equal(on_tiles.double(), want)
    assert torch.equal(on_tiles, int8_product(x_q, w_q, amx=False))


def test_amx_refused_where_the_cpu_has_none():
    if cpu_int8_small_batch.load_extension().available_amx():
        pytest.skip("this CPU has AMX-INT8")
    with pytest.raises(RuntimeError, match="AMX"):
        int8_product(codes(8, 64, seed=1), codes(16, 64, seed=2), amx=True)


def test_largest_codes_do_not_saturate():
    # |x| = 127 against +-127 weights: each int16 pair sum reaches 2 * 127 * 127 = 32258, just below the limit
    K = 96
    x_q = torch.full((3, K), 127, dtype=torch.int8)
    x_q[1] = -127
    x_q[2, ::2] = -127
    w_q = torch.full((5, K), 127, dtype=torch.int8)
    w_q[1] = -127
    w_q[2, 1::2] = -127
    assert torch.equal(int8_product(x_q, w_q).double(), x_q.double() @ w_q.double().t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 5, 32])
def test_linear_matches_the_reference(dtype, M):
    gen = generator(M)
    K, N = 200, 72
    x = torch.randn(M, K, generator=gen).to(dtype)
    weight = torch.randn(N, K, generator=gen) * K**-0.5
    bias = torch.randn(N, generator=gen).to(dtype)
    residual = torch.randn(M, N, generator=gen).to(dtype)
    w_q, w_scale = quantize_weight_per_channel(weight)
    got = int8_linear_small_batch(x, w_q, w_scale, bias, residual=residual)
    want = int8_linear_reference(x, w_q.t(), w_scale, bias).to(dtype) + residual
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance * want.abs().max().item(), rtol=tolerance)


@pytest.mark.parametrize("M", [1, 7, 24])
def test_equals_the_int_mm_path_bit_for_bit(M):
    gen = generator(M)
    K, N = 160, 96
    x = torch.randn(M, K, generator=gen)
    w_q, w_scale = quantize_weight_per_channel(torch.randn(N, K, generator=gen))
    assert torch.equal(int8_linear_small_batch(x, w_q, w_scale), int8_linear(x, w_q.t(), w_scale))
    assert torch.equal(int8_linear_silu_mul_small_batch(x, w_q, w_scale), int8_linear_silu_mul(x, w_q.t(), w_scale))


@pytest.mark.skipif(not cpu_int8_linear.onednn_available(), reason="torch without oneDNN's qlinear")
@pytest.mark.parametrize("M", [1, 9, 33])
def test_equals_the_onednn_path_bit_for_bit(M):
    gen = generator(M)
    K, N = 192, 80
    x = torch.randn(M, K, generator=gen)
    w_q, w_scale = quantize_weight_per_channel(torch.randn(N, K, generator=gen), cpu_int8_linear.weight_qmax())
    packed = cpu_int8_linear.prepack_codes(w_q, w_scale)
    residual = torch.randn(M, N, generator=gen)
    assert torch.equal(
        int8_linear_small_batch(x, w_q, w_scale, residual=residual),
        cpu_int8_linear.int8_linear_onednn(x, packed, residual=residual),
    )
    assert torch.equal(
        int8_linear_silu_mul_small_batch(x, w_q, w_scale), cpu_int8_linear.int8_linear_silu_mul_onednn(x, packed)
    )


def test_bad_arguments_are_named():
    x_q, w_q = codes(2, 16, seed=1), codes(3, 16, seed=2)
    with pytest.raises(ValueError, match="x_q must be a 2-D int8"):
        int8_product(x_q.float(), w_q)
    with pytest.raises(ValueError, match=r"w_q is \[N, K\]"):
        int8_product(x_q, codes(3, 17, seed=3))
    with pytest.raises(ValueError, match="w_scale must be float32"):
        int8_linear_small_batch(torch.randn(2, 16), w_q, torch.ones(4))
    with pytest.raises(ValueError, match="residual must have shape"):
        int8_linear_small_batch(torch.randn(2, 16), w_q, torch.ones(3), residual=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="2 \\* I rows"):
        int8_linear_silu_mul_small_batch(torch.randn(2, 16), w_q, torch.ones(3))
