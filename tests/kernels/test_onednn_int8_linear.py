"""The oneDNN W8A8 backend (u8 x s8 qlinear on a prepacked weight, our quantize and epilogue passes) against
float64 references of the same quantized math: exact integer products, so only float rounding differs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_int8_linear, quantize_weight_per_channel
from kernels.cpu_int8_linear import (
    OnednnWeight,
    int8_linear_onednn,
    int8_linear_silu_mul_onednn,
    prepack_onednn,
    weight_qmax,
)
from kernels.platform import cpu_info
from kernels.reference import quantize_reference

pytestmark = pytest.mark.skipif(
    not cpu_int8_linear.onednn_available(), reason="no C++ toolchain, or torch without oneDNN's qlinear"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # float16 runs the portable epilogue loops


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K], weight [N, K] float -> [M, N] float64: the quantized product this backend computes."""
    x_q, x_scale = quantize_reference(x)
    w_q, w_scale = quantize_weight_per_channel(weight, weight_qmax())
    return (x_q.double() @ w_q.double().t()) * x_scale.double()[:, None] * w_scale.double()


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # float32: the epilogue's few roundings; 16-bit outputs: one rounding to 8 or 11 significant bits
    tolerance = 2e-6 if got.dtype == torch.float32 else 1e-2
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, atol=tolerance * scale, rtol=tolerance)


def test_weight_qmax_is_the_largest_exact_range():
    qmax = weight_qmax()
    assert qmax == 63 or (qmax == 127 and cpu_info().has_vnni)
    assert cpu_int8_linear._worst_case_exact(qmax)
    if qmax == 63:  # without VNNI, full-range weights saturate vpmaddubsw's int16 pair sums
        assert not cpu_int8_linear._worst_case_exact(127)


@pytest.mark.parametrize(("M", "K", "N"), [(1, 64, 24), (7, 100, 37), (300, 576, 136)])
def test_product_is_the_exact_integer_sum(M, K, N):
    gen = torch.Generator().manual_seed(M)
    qmax = weight_qmax()
    w_q = torch.randint(-qmax, qmax + 1, (N, K), dtype=torch.int8, generator=gen)
    w_q[0] = qmax  # the largest sums: every code at its limit
    x_u8 = torch.randint(1, 256, (M, K), dtype=torch.uint8, generator=gen)
    x_u8[0] = 255
    w = cpu_int8_linear._prepack(w_q, torch.ones(N))  # prepacked for ROW_CHUNK = 512 rows, run with M
    want = (x_u8.long() - 128) @ w_q.long().t()  # |sums| < 2**24 here: exact in float32
    assert torch.equal(cpu_int8_linear._qlinear(x_u8, w), want.float())


def test_prepack_quantizes_per_channel_at_weight_qmax():
    weight = randn(40, 64, seed=1)
    w = prepack_onednn(weight)
    assert isinstance(w, OnednnWeight) and (w.N, w.K) == (40, 64)
    assert torch.equal(w.w_scale, quantize_weight_per_channel(weight, weight_qmax())[1])
    assert torch.equal(prepack_onednn(weight.to(torch.bfloat16)).w_scale,
                       quantize_weight_per_channel(weight.to(torch.bfloat16), weight_qmax())[1])  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "K", "N"), [(1, 64, 24), (5, 100, 37), (40, 256, 136), (601, 576, 960)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_linear_matches_the_quantized_reference(dtype, M, K, N, with_bias, with_residual):
    x = randn(M, K, seed=2, dtype=dtype)
    weight = randn(N, K, seed=3)
    bias = randn(N, seed=4, dtype=dtype) if with_bias else None
    residual = randn(M, N, seed=5, dtype=dtype) * 4 if with_residual else None
    got = int8_linear_onednn(x, prepack_onednn(weight), bias, None, residual)
    want = reference(x, weight)
    if bias is not None:
        want = want + bias.double()
    if residual is not None:
        want = want + residual.double()
    assert got.dtype == dtype and got.shape == (M, N)
    assert_close(got, want)


@pytest.mark.parametrize(
    ("x_dtype", "out_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_linear_out_dtype_and_views(x_dtype, out_dtype):
    # x a column slice of a wider tensor, residual a row view (row stride N + 8) in x's dtype
    M, K, N = 9, 96, 48
    x = randn(M, K + 5, seed=6, dtype=x_dtype)[:, 2 : K + 2]
    residual = randn(M, N + 8, seed=7, dtype=x_dtype)[:, 4 : N + 4]
    weight = randn(N, K, seed=8)
    got = int8_linear_onednn(x, prepack_onednn(weight), None, out_dtype, residual)
    assert got.dtype == out_dtype
    assert_close(got, reference(x, weight) + residual.to(out_dtype).double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "K", "I"), [(1, 64, 8), (9, 96, 37), (33, 576, 1536), (601, 64, 40)])
def test_silu_mul_matches_the_quantized_reference(dtype, M, K, I):  # noqa: E741
    x = randn(M, K, seed=9, dtype=dtype)
    weight = randn(2 * I, K, seed=10)
    got = int8_linear_silu_mul_onednn(x, prepack_onednn(weight))
    gate, up = reference(x, weight).chunk(2, dim=-1)
    assert got.dtype == dtype and got.shape == (M, I)
    assert_close(got, F.silu(gate) * up)


def test_row_counts_are_padded_to_few_buckets():
    counts = range(1, cpu_int8_linear.ROW_CHUNK + 1)
    padded = [cpu_int8_linear.padded_rows(m) for m in counts]
    assert padded[:15] == list(range(1, 16))  # small batches run as they are
    assert all(m <= p <= m * 9 / 8 for m, p in zip(counts, padded, strict=True))
    assert len(set(padded)) <= 56 and padded[-1] == cpu_int8_linear.ROW_CHUNK


def test_rows_do_not_depend_on_the_padding():
    # 601 rows: a full 512-row chunk, then 89 rows run as 96; 37 rows run as 40
    x, weight = randn(601, 64, seed=17), randn(48, 64, seed=18)
    w = prepack_onednn(weight)
    whole, silu = int8_linear_onednn(x, w), int8_linear_silu_mul_onednn(x, w)
    for m in (37, 89, 512, 600):
        assert torch.equal(int8_linear_onednn(x[:m], w), whole[:m])
        assert torch.equal(int8_linear_silu_mul_onednn(x[:m], w), silu[:m])


def test_approximates_the_float_product():
    x, weight, bias = randn(64, 576, seed=11), randn(1536, 576, seed=12), randn(1536, seed=13)
    got = int8_linear_onednn(x, prepack_onednn(weight), bias)
    want = x @ weight.t() + bias
    relative = ((got - want).norm() / want.norm()).item()
    assert relative < (0.02 if weight_qmax() == 127 else 0.025), relative  # measured 0.011 and 0.017


def test_rejects_bad_arguments():
    w = prepack_onednn(randn(16, 32, seed=14))
    x = randn(4, 32, seed=15)
    with pytest.raises(ValueError, match="K = 31 columns"):
        int8_linear_onednn(x[:, :31], w)
    with pytest.raises(ValueError, match="bias must have shape"):
        int8_linear_onednn(x, w, torch.zeros(15))
    with pytest.raises(ValueError, match="residual must have shape"):
        int8_linear_onednn(x, w, residual=torch.zeros(4, 15))
    with pytest.raises(ValueError, match="out_dtype must be"):
        int8_linear_onednn(x, w, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        int8_linear_onednn(x[None], w)
    with pytest.raises(ValueError, match="gate, then up"):
        int8_linear_silu_mul_onednn(x, prepack_onednn(randn(15, 32, seed=16)))
