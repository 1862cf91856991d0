"""The compiled CPU W8A8 passes (quantize, dequantize + bias + residual, dequantize + SiLU-and-multiply)
against the plain references, on random inputs whose rows have a tail past a multiple of 16 (AVX-512) and
of 8 (AVX2). Which SIMD path runs is the build's tier; FREIGHT_CPU_ISA=generic runs the portable loops."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_int8_linear, int8_linear, quantize_weight_per_channel
from kernels.cpu_int8_linear import (
    int8_linear_cpu,
    int8_linear_silu_mul_cpu,
    quantize_per_token_cpu,
    quantize_per_token_u8_cpu,
)
from kernels.int8_linear import int8_linear_silu_mul, int8_linear_torch
from kernels.reference import int8_linear_reference, quantize_reference

pytestmark = pytest.mark.skipif(
    not cpu_int8_linear.available(), reason="no C++ toolchain to build the kernel"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # float16 runs the portable loops


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "K"), [(1, 20), (7, 64), (33, 1100)])
def test_quantize_is_exactly_the_reference(dtype, M, K):
    x = randn(M, K, seed=K, dtype=dtype) * 3
    x[0, :] = 0.0  # an all-zero row quantizes to zeros with the smallest scale
    x_q, x_scale = quantize_per_token_cpu(x)
    want_q, want_scale = quantize_reference(x)
    assert torch.equal(x_q, want_q)
    assert torch.equal(x_scale, want_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "K"), [(3, 5), (7, 64), (33, 1100)])
def test_quantize_u8_is_the_codes_plus_128(dtype, M, K):
    x = randn(M, K, seed=K + 1, dtype=dtype) * 3
    x_u8, x_scale = quantize_per_token_u8_cpu(x)
    want_q, want_scale = quantize_reference(x)
    assert x_u8.dtype == torch.uint8
    assert torch.equal(x_u8.int() - 128, want_q.int())
    assert torch.equal(x_scale, want_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rounds_halves_to_even(dtype):
    # absmax 127 makes the scale 1, so x / scale is exact and every odd multiple of 0.5 is a tie
    halves = torch.arange(-126.5, 127.0, 1.0)  # 254 ties
    x = torch.cat([torch.tensor([127.0]), halves, halves.flip(0)])[None].to(dtype)
    for quantize in (quantize_per_token_cpu, quantize_per_token_u8_cpu):
        x_q, x_scale = quantize(x)
        assert x_scale.item() == 1.0
        assert torch.equal(
            x_q.int() - (128 if x_q.dtype == torch.uint8 else 0), quantize_reference(x)[0].int()
        )


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    tolerance = 1e-5 if got.dtype == torch.float32 else 1e-2
    scale = want.double().abs().max().item()
    torch.testing.assert_close(got.double(), want.double(), atol=tolerance * scale, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "K", "N"), [(1, 64, 24), (5, 130, 40), (40, 256, 136), (3, 32, 4100)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_linear_with_bias_and_residual(dtype, M, K, N, with_bias, with_residual):
    x = randn(M, K, seed=1, dtype=dtype)
    w_q, w_scale = quantize_weight_per_channel(randn(N, K, seed=2))
    bias = randn(N, seed=3, dtype=dtype) if with_bias else None
    residual = randn(M, N, seed=4, dtype=dtype) * 4 if with_residual else None
    got = int8_linear_cpu(x, w_q.t(), w_scale, bias, dtype, residual)
    want = int8_linear_reference(x, w_q.t(), w_scale, bias, torch.float64)
    if residual is not None:
        want = want + residual.double()
    assert got.dtype == dtype and got.shape == (M, N)
    _close(got, want)
    # the public function dispatches here on CPU
    assert torch.equal(int8_linear(x, w_q.t(), w_scale, bias, residual=residual), got)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "K", "I"), [(1, 64, 8), (9, 96, 40), (33, 576, 1536), (600, 64, 2100)])
def test_silu_mul_matches_the_unfused_product(dtype, M, K, I, activation):  # noqa: E741
    x = randn(M, K, seed=5, dtype=dtype)
    w_q, w_scale = quantize_weight_per_channel(randn(2 * I, K, seed=6))
    got = int8_linear_silu_mul_cpu(x, w_q.t(), w_scale, dtype, activation)
    gate, up = int8_linear_reference(x, w_q.t(), w_scale, None, torch.float64).chunk(2, dim=-1)
    assert got.dtype == dtype and got.shape == (M, I)
    _close(got, ACTIVATIONS[activation](gate) * up)
    assert torch.equal(int8_linear_silu_mul(x, w_q.t(), w_scale, activation=activation), got)


def _products(M: int, N: int, seed: int) -> torch.Tensor:
    """Random int32 products [M, N], small enough (|acc| < 2**24) to be exact as float32."""
    return torch.randint(
        -(2**20), 2**20, (M, N), generator=torch.Generator().manual_seed(seed), dtype=torch.int32
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "N"), [(1, 5), (6, 37), (33, 264)])
def test_dequantize_float_products_like_int32(dtype, M, N):
    acc = _products(M, N, seed=N)
    x_scale = torch.rand(M, generator=torch.Generator().manual_seed(1)) * 1e-3 + 1e-4
    w_scale = torch.rand(N, generator=torch.Generator().manual_seed(2)) * 1e-3 + 1e-4
    bias = randn(N, seed=3, dtype=dtype)
    residual_wide = randn(M, N + 3, seed=4, dtype=dtype)
    residual = residual_wide[:, 1 : N + 1]  # a row view: row stride N + 3
    want = acc.double() * x_scale.double()[:, None] * w_scale.double() + bias.double() + residual.double()
    extension = cpu_int8_linear.load_extension()
    outs = []
    # float32 products as a row view (row stride 2N), as the SiLU epilogue reads oneDNN's [M, 2I] product
    for products in (acc, torch.cat([acc.float(), acc.float()], dim=1)[:, N:]):
        out = torch.empty(M, N, dtype=dtype)
        extension.dequantize_rows(products, x_scale, w_scale, bias, residual, out)
        _close(out, want)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "I"), [(1, 5), (6, 37), (33, 264)])
def test_silu_mul_float_products_like_int32(dtype, M, I, activation):  # noqa: E741
    acc = _products(M, 2 * I, seed=I)
    x_scale = torch.rand(M, generator=torch.Generator().manual_seed(5)) * 1e-5 + 1e-6
    w_scale = torch.rand(2 * I, generator=torch.Generator().manual_seed(6)) + 1e-2  # |gate| up to ~10
    gate, up = (acc.double() * x_scale.double()[:, None] * w_scale.double()).chunk(2, dim=1)
    want = ACTIVATIONS[activation](gate) * up
    extension = cpu_int8_linear.load_extension()
    outs = []
    for gate_acc, up_acc in (
        (acc[:, :I].contiguous(), acc[:, I:].contiguous()),
        (acc.float()[:, :I], acc.float()[:, I:]),
    ):
        out = torch.empty(M, I, dtype=dtype)
        extension.dequantize_silu_mul(gate_acc, up_acc, x_scale, w_scale[:I], w_scale[I:], out, activation)
        _close(out, want)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_epilogues_reject_mismatched_arguments():
    extension = cpu_int8_linear.load_extension()
    acc, scale = _products(4, 16, seed=0), torch.ones(4)
    with pytest.raises(RuntimeError, match="int32 or float32"):
        extension.dequantize_rows(acc.double(), scale, torch.ones(16), None, None, torch.empty(4, 16))
    with pytest.raises(RuntimeError, match="w_scale must be"):
        extension.dequantize_rows(acc, scale, torch.ones(15), None, None, torch.empty(4, 16))
    with pytest.raises(RuntimeError, match="share dtype and row stride"):
        extension.dequantize_silu_mul(
            acc, acc.float(), scale, torch.ones(16), torch.ones(16), torch.empty(4, 16)
        )


def test_wide_products_run_in_equal_column_chunks():
    assert cpu_int8_linear.column_chunks(3072) == [slice(0, 1536), slice(1536, 3072)]
    assert cpu_int8_linear.column_chunks(4100) == [slice(0, 1367), slice(1367, 2734), slice(2734, 4100)]
    assert cpu_int8_linear.column_chunks(960) == [slice(0, 960)]


def test_fused_paths_agree_with_the_torch_path():
    x = randn(64, 576, seed=7, dtype=torch.bfloat16)
    w_q, w_scale = quantize_weight_per_channel(randn(192, 576, seed=8))
    torch_path = int8_linear_torch(x, w_q.t(), w_scale)
    assert (int8_linear(x, w_q.t(), w_scale).float() - torch_path.float()).abs().max() <= 2**-6 * (
        torch_path.float().abs().max()
    )


def test_rejects_bad_arguments():
    x = randn(4, 32, seed=9)
    w_q, w_scale = quantize_weight_per_channel(randn(16, 32, seed=10))
    with pytest.raises(ValueError, match="residual must have shape"):
        int8_linear(x, w_q.t(), w_scale, residual=torch.zeros(4, 15))
    with pytest.raises(ValueError, match="gate, then up"):
        int8_linear_silu_mul(x, quantize_weight_per_channel(randn(15, 32, seed=11))[0].t(), w_scale[:15])
