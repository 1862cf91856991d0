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


def int8_linear_cpu(
    x: torch.Tensor,  # [M, K] float
    w_q_t: torch.Tensor,  # [K, N] int8
    w_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
    residual: torch.Tensor | None = None,  # [M, N]: added to the output (a transformer's skip connection)
) -> torch.Tensor:  # [M, N] in out_dtype
    x_q, x_scale = quantize_per_token_cpu(x)
    acc = torch._int_mm(x_q, w_q_t)  # [M, N] int32
    out = torch.empty(acc.shape, dtype=out_dtype)
    _extension().dequantize_rows(
        acc,
        x_scale,
        w_scale.contiguous(),
        None if bias is None else bias.to(out_dtype).contiguous(),
        None if residual is None else residual.to(out_dtype).contiguous(),
        out,
    )
    return out


def int8_linear_silu_mul_cpu(
    x: torch.Tensor,  # [M, K] float
    w_q_t: torch.Tensor,  # [K, 2 * I] int8: gate columns, then up columns
    w_scale: torch.Tensor,  # [2 * I] float32
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, I] = silu(gate) * up, in out_dtype
    x_q, x_scale = quantize_per_token_cpu(x)
    acc = torch._int_mm(x_q, w_q_t)  # [M, 2 * I] int32
    out = torch.empty((acc.shape[0], acc.shape[1] // 2), dtype=out_dtype)
    _extension().dequantize_silu_mul(acc, x_scale, w_scale.contiguous(), out)
    return out
