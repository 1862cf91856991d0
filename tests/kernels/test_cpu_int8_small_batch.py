"""The small-batch int8 product (csrc/int8_small_batch_cpu.cpp) and the linear built on it, against exact
float64 references on random codes, and against the library GEMM paths bit for bit (the same codes give
exact integer products on both, so the engine's per-batch-size dispatch never changes an output)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_int8_linear, cpu_int8_small_batch, int8_linear, quantize_weight_per_channel
from kernels.cpu_int8_small_batch import (
    int8_argmax_small_batch,
    int8_linear_silu_mul_small_batch,
    int8_linear_small_batch,
    int8_product,
    prepare,
)
from kernels.int8_linear import int8_linear_silu_mul, quantize_per_token_torch
from kernels.reference import int8_linear_reference

pytestmark = pytest.mark.skipif(not cpu_int8_small_batch.available(), reason="no C++ toolchain to build the kernel")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def codes(*shape: int, seed: int, qmax: int = 127) -> torch.Tensor:
    return torch.randint(-qmax, qmax + 1, shape, dtype=torch.int8, generator=generator(seed))


# every layout this build can run: the [N, K] codes, and the VNNI tier's panels
LAYOUTS = ["rows", "panels"] if cpu_int8_small_batch.panels_available() else ["rows"]


def layouts_for(K: int) -> list[str]:
    return [layout for layout in LAYOUTS if layout == "rows" or K % 4 == 0]


# K past a multiple of 32 or 64 (the vector loops' tails), N past a multiple of 4 (the row tile) and of 16 (a
# task), M past a multiple of 4 by 1, 2 and 3 (the VNNI tile's activation rows)
@pytest.mark.parametrize(
    ("M", "K", "N"), [(1, 32, 4), (3, 100, 37), (6, 64, 8), (16, 576, 960), (17, 130, 12), (40, 1537, 19)]
)
def test_product_is_the_exact_integer_sum(M, K, N):
    x_q, w_q = codes(M, K, seed=M), codes(N, K, seed=N)
    want = x_q.double() @ w_q.double().t()
    for layout in layouts_for(K):
        assert torch.equal(int8_product(x_q, prepare(w_q, layout)).double(), want), layout


# the panel product's register blocks: M across its 12 rows (1, 11, 12, 13, 25, 64) and its 192-row chunks (193,
# 400), N across its pairs of 16-column panels (a lone panel, a partial one, several tasks), K a multiple of 4
# but of nothing larger
@pytest.mark.skipif(not cpu_int8_small_batch.panels_available(), reason="no AVX-512 VNNI build")
@pytest.mark.parametrize(
    ("M", "K", "N"),
    [(1, 4, 1), (11, 68, 16), (12, 640, 33), (13, 100, 47), (25, 2052, 96), (64, 640, 1000), (193, 64, 40),
     (400, 132, 50)],
)  # fmt: skip
def test_panel_product_is_the_exact_integer_sum(M, K, N):
    x_q, w_q = codes(M, K, seed=M + 3), codes(N, K, seed=N + 3)
    x_q[0, :7] = -128  # the most negative activation code (the shift's correction)
    want = x_q.double() @ w_q.double().t()
    weights = prepare(w_q, "panels")
    assert weights.layout == "panels" and weights.codes is None
    assert tuple(weights.panels.shape) == (-(-N // 16), K // 4, 16, 4)
    assert torch.equal(int8_product(x_q, weights).double(), want)


def test_panel_layout_refuses_what_it_cannot_hold():
    if not cpu_int8_small_batch.panels_available():
        with pytest.raises(RuntimeError, match="AVX-512 VNNI"):
            prepare(codes(4, 64, seed=1), "panels")
        return
    with pytest.raises(ValueError, match="multiple of 4"):
        prepare(codes(4, 66, seed=1), "panels")
    assert prepare(codes(4, 66, seed=1)).layout == "rows"  # the default falls back


@pytest.mark.parametrize(
    ("M", "K", "N"), [(1, 32, 4), (3, 100, 37), (6, 64, 8), (16, 576, 960), (17, 130, 12), (40, 1537, 19)]
)
def test_seven_bit_codes_with_row_sums_give_the_exact_integer_sum(M, K, N):
    # 7-bit weights (the oneDNN backend's without VNNI) and the most negative activation code: the AVX2 loop's
    # unsigned form shifts every activation by 128 and takes 128 * sum(w) off again
    x_q, w_q = codes(M, K, seed=M + 7), codes(N, K, seed=N + 7, qmax=63)
    x_q[0, :5] = -128
    w_q[0, :3] = torch.tensor([63, -63, -63], dtype=torch.int8)
    weights = prepare(w_q, "rows")
    sums = weights.w_sums
    assert sums is not None and torch.equal(sums, w_q.sum(1, dtype=torch.int32))
    want = x_q.double() @ w_q.double().t()
    assert torch.equal(int8_product(x_q, weights).double(), want)
    without_sums = cpu_int8_small_batch.SmallBatchWeights(N, K, codes=w_q)
    assert torch.equal(int8_product(x_q, without_sums).double(), want)
    x = torch.randn(M, K, generator=generator(M))
    scale = torch.rand(N, generator=generator(N)) / 50
    assert torch.equal(int8_linear_small_batch(x, weights, scale), int8_linear_small_batch(x, without_sums, scale))


def test_row_sums_only_for_seven_bit_codes():
    assert cpu_int8_small_batch.seven_bit_row_sums(codes(8, 64, seed=3, qmax=63)) is not None
    eight_bit = codes(8, 64, seed=3, qmax=63)
    eight_bit[5, 7] = 64
    assert cpu_int8_small_batch.seven_bit_row_sums(eight_bit) is None
    assert prepare(eight_bit, "rows").w_sums is None


# M from below the tiles' threshold (8 rows) through partial and several 16-row blocks and more than the four
# accumulated at once (70), K multiples of 64 (what the tiles take; others keep the SIMD loop), N past a
# multiple of 16 (the last rows take the SIMD loop)
@pytest.mark.skipif(not cpu_int8_small_batch.amx_enabled(), reason="no AMX-INT8 on this CPU (or not allowed)")
@pytest.mark.parametrize(("M", "K", "N"), [(8, 64, 16), (16, 576, 50), (17, 1536, 576), (40, 576, 3072), (70, 128, 33)])
def test_amx_product_is_the_exact_integer_sum_and_equals_the_simd_loop(M, K, N):
    x_q, w_q = codes(M, K, seed=M + 1), codes(N, K, seed=N + 1)
    want = x_q.double() @ w_q.double().t()
    weights = prepare(w_q, "rows")
    on_tiles = int8_product(x_q, weights, amx=True)
    assert torch.equal(on_tiles.double(), want)
    assert torch.equal(on_tiles, int8_product(x_q, weights, amx=False))


def test_amx_refused_where_the_cpu_has_none():
    if cpu_int8_small_batch.load_extension().available_amx():
        pytest.skip("this CPU has AMX-INT8")
    with pytest.raises(RuntimeError, match="AMX"):
        int8_product(codes(8, 64, seed=1), prepare(codes(16, 64, seed=2), "rows"), amx=True)


def test_largest_codes_do_not_saturate():
    # |x| = 127 against +-127 weights: each int16 pair sum reaches 2 * 127 * 127 = 32258, just below the limit
    K = 96
    x_q = torch.full((3, K), 127, dtype=torch.int8)
    x_q[1] = -127
    x_q[2, ::2] = -127
    w_q = torch.full((5, K), 127, dtype=torch.int8)
    w_q[1] = -127
    w_q[2, 1::2] = -127
    for layout in layouts_for(K):
        assert torch.equal(int8_product(x_q, prepare(w_q, layout)).double(), x_q.double() @ w_q.double().t())


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
    got = int8_linear_small_batch(x, prepare(w_q), w_scale, bias, residual=residual)
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
    for layout in LAYOUTS:
        weights = prepare(w_q, layout)
        assert torch.equal(int8_linear_small_batch(x, weights, w_scale), int8_linear(x, w_q.t(), w_scale))
        assert torch.equal(
            int8_linear_silu_mul_small_batch(x, weights, w_scale), int8_linear_silu_mul(x, w_q.t(), w_scale)
        )


@pytest.mark.skipif(not cpu_int8_linear.onednn_available(), reason="torch without oneDNN's qlinear")
@pytest.mark.parametrize("M", [1, 9, 33])
def test_equals_the_onednn_path_bit_for_bit(M):
    gen = generator(M)
    K, N = 192, 80
    x = torch.randn(M, K, generator=gen)
    w_q, w_scale = quantize_weight_per_channel(torch.randn(N, K, generator=gen), cpu_int8_linear.weight_qmax())
    packed = cpu_int8_linear.prepack_codes(w_q, w_scale)
    residual = torch.randn(M, N, generator=gen)
    for layout in LAYOUTS:
        weights = prepare(w_q, layout)
        assert torch.equal(
            int8_linear_small_batch(x, weights, w_scale, residual=residual),
            cpu_int8_linear.int8_linear_onednn(x, packed, residual=residual),
        )
        for activation in ("silu", "gelu_tanh"):
            assert torch.equal(
                int8_linear_silu_mul_small_batch(x, weights, w_scale, activation=activation),
                cpu_int8_linear.int8_linear_silu_mul_onednn(x, packed, activation=activation),
            )


def logits_reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The unfused LM head's float32 logits, from torch alone: exact int32 sums, then dequantize_rows' order."""
    x_q, x_scale = quantize_per_token_torch(x)
    acc = (x_q.to(torch.int32) @ w_q.to(torch.int32).t()).float()  # exact: |sums| < 2^24 here
    return acc * x_scale[:, None] * w_scale[None, :]


# N past a block of 256 rows and a tile of 16, several tasks a row; M across the VNNI tile's 4 rows and AMX's 8
@pytest.mark.parametrize(("M", "K", "N"), [(1, 64, 5), (3, 160, 1000), (9, 576, 4099), (24, 640, 2048), (70, 128, 777)])
def test_argmax_equals_the_max_of_the_logits(M, K, N):
    gen = generator(M * N)
    x = torch.randn(M, K, generator=gen)
    w_q, w_scale = quantize_weight_per_channel(torch.randn(N, K, generator=gen))
    logits = logits_reference(x, w_q, w_scale)
    expected = logits.max(dim=-1)
    for layout in LAYOUTS:
        weights = prepare(w_q, layout)
        indices, values = int8_argmax_small_batch(x, weights, w_scale)
        assert torch.equal(indices, expected.indices) and torch.equal(values, expected.values), layout
        # and the engine's unfused path, whose logits are these
        unfused = int8_linear_small_batch(x, weights, w_scale, out_dtype=torch.float32)
        assert torch.equal(indices, unfused.max(-1).indices), layout


def test_argmax_with_seven_bit_codes_and_row_sums():
    gen = generator(13)
    x = torch.randn(24, 576, generator=gen)
    w_q, w_scale = quantize_weight_per_channel(torch.randn(3000, 576, generator=gen), qmax=63)
    weights = prepare(w_q, "rows")
    assert weights.w_sums is not None
    expected = logits_reference(x, w_q, w_scale).max(dim=-1)
    indices, values = int8_argmax_small_batch(x, weights, w_scale)
    assert torch.equal(indices, expected.indices) and torch.equal(values, expected.values)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_argmax_takes_the_first_of_tied_maxima_and_the_first_nan(layout):
    gen = generator(5)
    K, N = 96, 3000
    x = torch.randn(4, K, generator=gen)
    w_q, w_scale = quantize_weight_per_channel(torch.randn(N, K, generator=gen))
    logits = logits_reference(x, w_q, w_scale)
    top = logits.max(dim=-1).indices
    # copies of each row's winner far later (another block, another task) and just before it: the earliest wins
    for i, j in enumerate(top.tolist()):
        for copy in (j - 1, N - 7 - i):
            if copy >= 0:
                w_q[copy], w_scale[copy] = w_q[j], w_scale[j]
    logits = logits_reference(x, w_q, w_scale)
    weights = prepare(w_q, layout)
    indices, _ = int8_argmax_small_batch(x, weights, w_scale)
    assert torch.equal(indices, logits.max(dim=-1).indices)
    assert (indices < top).any(), "a copy before the winner was meant to take its place"
    # a NaN scale makes a NaN logit in every row; torch's max picks the first NaN, whatever else is larger
    w_scale[2500] = w_scale[1700] = float("nan")
    indices, values = int8_argmax_small_batch(x, weights, w_scale)
    assert indices.tolist() == [1700] * 4 and values.isnan().all()
    assert torch.equal(indices, logits_reference(x, w_q, w_scale).max(dim=-1).indices)


@pytest.mark.skipif(not cpu_int8_small_batch.amx_enabled(), reason="no AMX-INT8 on this CPU (or not allowed)")
def test_argmax_on_amx_tiles_equals_the_simd_loop():
    gen = generator(11)
    x = torch.randn(40, 640, generator=gen)
    w_q, w_scale = quantize_weight_per_channel(torch.randn(5000, 640, generator=gen))
    expected = logits_reference(x, w_q, w_scale).max(dim=-1)
    indices, values = int8_argmax_small_batch(x, prepare(w_q, "rows"), w_scale)
    assert torch.equal(indices, expected.indices) and torch.equal(values, expected.values)


def test_bad_arguments_are_named():
    x_q, w_q = codes(2, 16, seed=1), prepare(codes(3, 16, seed=2))
    with pytest.raises(ValueError, match="x_q must be a 2-D int8"):
        int8_product(x_q.float(), w_q)
    with pytest.raises(ValueError, match=r"the weight is \[N, K\]"):
        int8_product(x_q, prepare(codes(3, 20, seed=3)))
    with pytest.raises(ValueError, match="w_q must be a 2-D int8"):
        prepare(codes(3, 16, seed=2).float())
    with pytest.raises(ValueError, match="w_scale must be float32"):
        int8_linear_small_batch(torch.randn(2, 16), w_q, torch.ones(4))
    with pytest.raises(ValueError, match="residual must have shape"):
        int8_linear_small_batch(torch.randn(2, 16), w_q, torch.ones(3), residual=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="w_scale must be float32"):
        int8_argmax_small_batch(torch.randn(2, 16), w_q, torch.ones(4))
    with pytest.raises(ValueError, match="at least one row"):
        int8_argmax_small_batch(torch.randn(2, 16), prepare(codes(0, 16, seed=4)), torch.ones(0))
    with pytest.raises(ValueError, match="2 \\* I rows"):
        int8_linear_silu_mul_small_batch(torch.randn(2, 16), w_q, torch.ones(3))
