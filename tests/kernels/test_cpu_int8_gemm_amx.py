"""The AMX tile GEMM (csrc/int8_gemm_amx_cpu.cpp): exact integer products against float64 on random codes,
and its fused epilogues bit for bit against the small-batch path on the same codes (the engine sends a
batch to one or the other by its size, so a row's outputs must not depend on which one ran)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import cpu_int8_gemm_amx, quantize_weight_per_channel
from kernels.cpu_int8_small_batch import int8_linear_silu_mul_small_batch, int8_linear_small_batch, prepare
from kernels.reference import int8_linear_reference

pytestmark = pytest.mark.skipif(
    not cpu_int8_gemm_amx.available(), reason="no AMX-INT8 on this CPU (or not allowed)"
)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def codes(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator(seed))


# M within one 32-row strip, past it by 1, several strips with a tail; N past a multiple of 32 (padded
# columns) and of 16; K one chunk to 24 chunks
@pytest.mark.parametrize(
    ("M", "K", "N"), [(1, 64, 16), (31, 576, 50), (33, 128, 33), (70, 1536, 576), (300, 576, 960)]
)
def test_product_is_the_exact_integer_sum(M, K, N):
    x_q, w_q = codes(M, K, seed=M), codes(N, K, seed=N)
    got = cpu_int8_gemm_amx.product(x_q, cpu_int8_gemm_amx.pack(w_q))
    assert torch.equal(got.double(), x_q.double() @ w_q.double().t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("M", "K", "N"), [(1, 64, 16), (37, 576, 960), (129, 1536, 50)])
def test_linear_equals_the_small_batch_path_bit_for_bit(M, K, N, dtype):
    gen = generator(M + N)
    w_q, w_scale = quantize_weight_per_channel(torch.randn(N, K, generator=gen))
    x = (torch.randn(M, K, generator=gen) * 3).to(dtype)
    bias, residual = torch.randn(N, generator=gen).to(dtype), torch.randn(M, N, generator=gen).to(dtype)
    tiles = cpu_int8_gemm_amx.pack(w_q)
    got = cpu_int8_gemm_amx.int8_linear_amx(x, tiles, w_scale, bias, residual=residual)
    assert got.dtype == dtype
    assert torch.equal(got, int8_linear_small_batch(x, prepare(w_q), w_scale, bias, residual=residual))
    assert torch.equal(
        cpu_int8_gemm_amx.int8_linear_amx(x, tiles, w_scale), int8_linear_small_batch(x, prepare(w_q), w_scale)
    )
    want = int8_linear_reference(x.float(), w_q.t(), w_scale, bias.float()) + residual.float()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("M", "K", "I"), [(5, 64, 16), (40, 576, 1536), (257, 128, 48)])
def test_gated_silu_mul_equals_the_small_batch_path_bit_for_bit(M, K, I, dtype):  # noqa: E741
    gen = generator(M + I)
    w_q, w_scale = quantize_weight_per_channel(torch.randn(2 * I, K, generator=gen))
    x = torch.randn(M, K, generator=gen).to(dtype)
    got = cpu_int8_gemm_amx.int8_linear_silu_mul_amx(x, cpu_int8_gemm_amx.pack_gated(w_q), w_scale)
    assert got.shape == (M, I) and got.dtype == dtype
    assert torch.equal(got, int8_linear_silu_mul_small_batch(x, prepare(w_q), w_scale))


def test_refusals_say_what_is_wrong():
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu_int8_gemm_amx.pack(codes(16, 100, seed=1))
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_int8_gemm_amx.pack_gated(codes(48, 64, seed=1))
    tiles = cpu_int8_gemm_amx.pack(codes(16, 128, seed=2))
    with pytest.raises(ValueError, match=r"\[M, 128\] int8"):
        cpu_int8_gemm_amx.product(codes(4, 64, seed=3), tiles)
    with pytest.raises(ValueError, match="K = 64 columns"):
        cpu_int8_gemm_amx.int8_linear_amx(torch.randn(4, 64), tiles, torch.ones(16))
    with pytest.raises(ValueError, match="residual must have shape"):
        cpu_int8_gemm_amx.int8_linear_amx(
            torch.randn(4, 128), tiles, torch.ones(16), residual=torch.zeros(4, 15)
        )


@pytest.mark.parametrize("env", [{"FREIGHT_CPU_AMX": "0"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}])
def test_turning_amx_off_takes_the_backend_out_of_the_measurement(env):
    # the tier without AMX, as a machine without it runs: no tile GEMM, and the scheme measurement never offers it
    code = ("import torch; from kernels import cpu_int8_gemm_amx; from worker.engine.plan.schemes import candidate_schemes; "
            "print(cpu_int8_gemm_amx.available(), sorted(s.name for s in candidate_schemes(torch.device('cpu'))))")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    available, names = run.stdout.strip().split(" ", 1)
    assert available == "False" and "/amx" not in names and "bfloat16+int8/int_mm" in names


@pytest.mark.parametrize("gated", [False, True], ids=["linear", "silu_mul"])
def test_prequantized_rows_give_the_float_rows_outputs(gated):
    """The engine hands the GEMM codes made by the fused norm (QuantizedRows): the same outputs as from the
    float rows it would have quantized itself."""
    x = torch.randn(40, 576, generator=generator(7)).bfloat16()
    w_q, w_scale = codes(64, 576, seed=8), torch.rand(64, generator=generator(9)) * 0.01
    x_q, x_scale = cpu_int8_gemm_amx.cpu_int8_linear.quantize_per_token_cpu(x)
    rows = cpu_int8_gemm_amx.QuantizedRows(x_q, x_scale, x.dtype)
    if gated:
        w = cpu_int8_gemm_amx.pack_gated(w_q)
        got, want = (cpu_int8_gemm_amx.int8_linear_silu_mul_amx(a, w, w_scale) for a in (rows, x))
    else:
        w = cpu_int8_gemm_amx.pack(w_q)
        got, want = (cpu_int8_gemm_amx.int8_linear_amx(a, w, w_scale) for a in (rows, x))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
