from __future__ import annotations

import pytest
import torch

from kernels import int8_linear, quantize_per_token, quantize_weight_per_channel
from kernels.int8_linear import int8_linear_torch, int8_linear_triton, quantize_per_token_triton
from kernels.quantize import quantize_per_token_torch
from kernels.reference import int8_linear_reference, quantize_reference
from tests.kernels.helpers import BACKENDS, needs_cuda


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("M", "K"), [(1, 20), (5, 64), (33, 1100)])
def test_quantize_per_token_matches_reference(backend, dtype, M, K):
    x = randn(M, K, seed=M, dtype=dtype)
    x[0, :] = 0.0  # an all-zero row quantizes to zeros with the smallest scale, not NaN
    quantize = quantize_per_token_triton if backend.triton else quantize_per_token_torch
    x_q, x_scale = quantize(x.to(backend.device))
    want_q, want_scale = quantize_reference(x)
    assert x_q.dtype == torch.int8 and x_scale.dtype == torch.float32
    torch.testing.assert_close(x_scale.cpu(), want_scale, rtol=1e-6, atol=0)
    diff = (x_q.cpu().int() - want_q.int()).abs()
    assert diff.max() <= (1 if backend.triton else 0)  # x / scale may differ in the last bit on a GPU
    assert x_q[0].eq(0).all() and x_scale[0].item() == pytest.approx(1e-8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("M", "K", "N", "x_dtype", "out_dtype", "with_bias"),
    [
        (1, 64, 24, torch.float32, None, False),
        (3, 48, 80, torch.bfloat16, None, True),
        (17, 130, 40, torch.float32, torch.bfloat16, True),
        (40, 256, 136, torch.bfloat16, torch.float32, False),
    ],
)
@pytest.mark.parametrize("layout", ["transposed-view", "contiguous"])
def test_int8_linear_matches_reference(backend, M, K, N, x_dtype, out_dtype, with_bias, layout):
    x = randn(M, K, seed=1, dtype=x_dtype)
    w_q, w_scale = quantize_weight_per_channel(randn(N, K, seed=2))
    w_q_t = w_q.t() if layout == "transposed-view" else w_q.t().contiguous()
    bias = randn(N, seed=3, dtype=x_dtype) if with_bias else None
    want = int8_linear_reference(x, w_q_t, w_scale, bias, out_dtype)

    device = backend.device
    linear = int8_linear_triton if backend.triton else int8_linear_torch
    bias_arg = bias.to(device) if bias is not None else None
    got = linear(x.to(device), w_q_t.to(device), w_scale.to(device), bias_arg, out_dtype)
    assert got.dtype == (out_dtype or x_dtype) and got.shape == (M, N)
    # The reference's products are exact, so only the output rounding (and on a GPU the rare off-by-one
    # activation code, worth one scale step) separates them.
    tolerance = 1e-5 if got.dtype == torch.float32 and not backend.triton else 2e-2
    scale = want.double().abs().max().item()
    torch.testing.assert_close(got.cpu().double(), want.double(), atol=tolerance * scale, rtol=tolerance)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])])
def test_int8_linear_approximates_the_float_product(device):
    x, w, bias = randn(64, 576, seed=4), randn(1536, 576, seed=5), randn(1536, seed=6)
    w_q, w_scale = quantize_weight_per_channel(w)
    got = int8_linear(x.to(device), w_q.t().to(device), w_scale.to(device), bias.to(device)).cpu()
    want = x @ w.t() + bias
    relative = (got - want).norm() / want.norm()
    assert relative < 0.02, relative


def test_quantize_weight_per_channel_rows():
    w = randn(7, 33, seed=7)
    w_q, w_scale = quantize_weight_per_channel(w)
    assert w_q.shape == (7, 33) and w_q.is_contiguous() and w_scale.shape == (7,)
    assert torch.all((w_q.float() * w_scale[:, None] - w).abs() <= w_scale[:, None] / 2 * (1 + 1e-5))
    assert torch.equal(quantize_per_token(w)[0], w_q)


@pytest.mark.parametrize("qmax", [63, 127])
def test_quantize_weight_per_channel_qmax(qmax):
    w = randn(9, 40, seed=10) * 5
    w_q, w_scale = quantize_weight_per_channel(w, qmax)
    assert torch.equal(w_q.abs().amax(dim=1), torch.full((9,), qmax, dtype=torch.int8))  # rows reach qmax
    torch.testing.assert_close(w_scale, w.abs().amax(dim=1) / qmax, rtol=0, atol=0)
    assert torch.all((w_q.float() * w_scale[:, None] - w).abs() <= w_scale[:, None] / 2 * (1 + 1e-5))
    for bad in (0, 128):
        with pytest.raises(ValueError, match="qmax must be in"):
            quantize_weight_per_channel(w, bad)


def test_rejects_bad_arguments():
    x = randn(4, 32, seed=8)
    w_q, w_scale = quantize_weight_per_channel(randn(16, 32, seed=9))
    with pytest.raises(ValueError, match="w_q_t must be a 2-D int8"):
        int8_linear(x, w_q.t().float(), w_scale)
    with pytest.raises(ValueError, match="K = 32 columns"):
        int8_linear(x, w_q, w_scale)
    with pytest.raises(ValueError, match="w_scale must be float32"):
        int8_linear(x, w_q.t(), w_scale.double())
    with pytest.raises(ValueError, match="bias must have shape"):
        int8_linear(x, w_q.t(), w_scale, bias=torch.zeros(3))
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        quantize_per_token(x[None])
