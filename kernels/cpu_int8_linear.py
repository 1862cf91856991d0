"""W8A8 linear on CPU with the passes around torch._int_mm compiled (C++ with OpenMP, built on first use).

torch._int_mm is fast here; what costs is everything around it: quantizing activations (abs, amax,
divide, round, clamp, cast) and turning int32 products back into floats (cast, two scale multiplies,
bias, cast, then the residual add or SiLU-and-multiply of the caller). csrc/int8_linear_cpu.cpp does
each side in one pass. Arguments are checked by the callers in kernels/int8_linear.py.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from kernels._cpu_build import build_extension


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here (logged once)."""
    return build_extension("freight_int8_linear_cpu", "int8_linear_cpu.cpp", fast_math=False)


def available() -> bool:
    return load_extension() is not None


def _extension() -> ModuleType:
    extension = load_extension()
    if extension is None:
        raise RuntimeError("the CPU int8-linear extension is not available")
    return extension


def quantize_per_token_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (x_q [M, K] int8, x_scale [M] float32); same results as quantize_per_token_torch."""
    x = x.contiguous()
    x_q = torch.empty(x.shape, dtype=torch.int8)
    x_scale = torch.empty((x.shape[0],), dtype=torch.float32)
    _extension().quantize_rows(x, x_q, x_scale)
    return x_q, x_scale


# oneDNN's int8 GEMM here slows down sharply past about 2048 output columns (SmolLM2's 3072-wide gate/up
# product runs at half the rate of its 1536-wide halves), so wide products run in column chunks.
MAX_GEMM_COLUMNS = 2048


def column_chunks(n: int) -> list[slice]:
    """Equal column slices of at most MAX_GEMM_COLUMNS."""
    count = -(-n // MAX_GEMM_COLUMNS)
    width = -(-n // count)
    return [slice(start, min(start + width, n)) for start in range(0, n, width)]


ROW_CHUNK = 512  # rows per product when its int32 output is consumed right away


def row_chunks(m: int) -> list[slice]:
    return [slice(start, min(start + ROW_CHUNK, m)) for start in range(0, m, ROW_CHUNK)]


def int8_linear_cpu(
    x: torch.Tensor,  # [M, K] float
    w_q_t: torch.Tensor,  # [K, N] int8
    w_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
    residual: torch.Tensor | None = None,  # [M, N]: added to the output (a transformer's skip connection)
) -> torch.Tensor:  # [M, N] in out_dtype
    x_q, x_scale = quantize_per_token_cpu(x)
    out = torch.empty((x.shape[0], w_q_t.shape[1]), dtype=out_dtype)
    bias = None if bias is None else bias.to(out_dtype).contiguous()
    residual = None if residual is None else residual.to(out_dtype)
    for cols in column_chunks(w_q_t.shape[1]):
        acc = torch._int_mm(x_q, w_q_t[:, cols])  # [M, n] int32
        _extension().dequantize_rows(
            acc,
            x_scale,
            w_scale[cols].contiguous(),
            None if bias is None else bias[cols].contiguous(),
            None if residual is None else residual[:, cols],
            out[:, cols],
        )
    return out


def int8_linear_silu_mul_cpu(
    x: torch.Tensor,  # [M, K] float
    w_q_t: torch.Tensor,  # [K, 2 * I] int8: gate columns, then up columns
    w_scale: torch.Tensor,  # [2 * I] float32
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, I] = silu(gate) * up, in out_dtype
    x_q, x_scale = quantize_per_token_cpu(x)
    half = w_q_t.shape[1] // 2
    out = torch.empty((x.shape[0], half), dtype=out_dtype)
    for cols in column_chunks(half):
        up_cols = slice(half + cols.start, half + cols.stop)
        w_gate, w_up = w_scale[cols].contiguous(), w_scale[up_cols].contiguous()
        for rows in row_chunks(x.shape[0]):  # the int32 products stay in cache for the epilogue
            gate = torch._int_mm(x_q[rows], w_q_t[:, cols])  # [m, n] int32
            up = torch._int_mm(x_q[rows], w_q_t[:, up_cols])
            _extension().dequantize_silu_mul(gate, up, x_scale[rows], w_gate, w_up, out[rows, cols])
    return out
