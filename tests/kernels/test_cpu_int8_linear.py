"""The compiled CPU W8A8 passes (quantize, dequantize + bias + residual, dequantize + SiLU-and-multiply)
against the plain references, on random inputs whose rows have a tail past a multiple of 16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_int8_linear, int8_linear, quantize_weight_per_channel
from kernels.cpu_int8_linear import int8_linear_cpu, int8_linear_silu_mul_cpu, quantize_per_token_cpu
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "K", "I"), [(1, 64, 8), (9, 96, 40), (33, 576, 1536), (600, 64, 2100)])
def test_silu_mul_matches_the_unfused_product(dtype, M, K, I):  # noqa: E741
    x = randn(M, K, seed=5, dtype=dtype)
    w_q, w_scale = quantize_weight_per_channel(randn(2 * I, K, seed=6))
    got = int8_linear_silu_mul_cpu(x, w_q.t(), w_scale, dtype)
    gate, up = int8_linear_reference(x, w_q.t(), w_scale, None, torch.float64).chunk(2, dim=-1)
    assert got.dtype == dtype and got.shape == (M, I)
    _close(got, F.silu(gate) * up)
    assert torch.equal(int8_linear_silu_mul(x, w_q.t(), w_scale), got)


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
