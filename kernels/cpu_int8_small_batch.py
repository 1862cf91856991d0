"""W8A8 linear for a small batch on CPU: our own int8 product (csrc/int8_small_batch_cpu.cpp), which streams
the weights once, between the same quantize and epilogue passes as the library GEMMs (cpu_int8_linear.py).

Below a few dozen rows a product is bound by reading its weights, and the library GEMMs fall far short of
that: oneDNN's qlinear reads the LM head at ~3 GB/s at M = 1 on the 2-core AVX2 VM and loses to float32 up
to M = 16. The products are exact integer sums, so with the same weight codes the results equal those of
the library GEMM bit for bit, whichever path a batch size takes (worker/engine/plan/small_batch.py
measures up to which M this one is faster).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from kernels import cpu_int8_linear
from kernels._checks import check_float_tensor, resolve_out_dtype
from kernels._cpu_build import build_extension
from kernels.platform import amx_allowed


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here (logged once)."""
    return build_extension("freight_int8_small_batch_cpu", "int8_small_batch_cpu.cpp", fast_math=False)


def available() -> bool:
    """The product kernel and the quantize/epilogue passes around it both built."""
    return load_extension() is not None and cpu_int8_linear.available()


@functools.cache
def amx_enabled() -> bool:
    """Whether the product runs on AMX tiles: the CPU and OS allow it and platform.amx_allowed()."""
    extension = load_extension()
    return extension is not None and extension.available_amx() and amx_allowed()


def _modules() -> tuple[ModuleType, ModuleType]:
    product, passes = load_extension(), cpu_int8_linear.load_extension()
    if product is None or passes is None:
        raise RuntimeError("the CPU small-batch int8 kernels are not available")
    return product, passes


def seven_bit_row_sums(w_q: torch.Tensor) -> torch.Tensor | None:
    """w_q [N, K] int8 -> its row sums [N] int32 where every code is within [-63, 63] (the oneDNN backend's
    codes without VNNI), else None. With them the AVX2 product takes its unsigned-activation form (the
    kernel's header); computed once per weight, at load."""
    if w_q.dtype != torch.int8 or w_q.dim() != 2:
        raise ValueError(f"w_q must be a 2-D int8 tensor, got {w_q.dtype} {tuple(w_q.shape)}")
    if w_q.numel() and int(w_q.abs().max()) > 63:
        return None
    return w_q.sum(dim=1, dtype=torch.int32).contiguous()


def int8_product(
    x_q: torch.Tensor, w_q: torch.Tensor, amx: bool | None = None, w_sums: torch.Tensor | None = None
) -> torch.Tensor:
    """x_q [M, K] int8, w_q [N, K] int8 (codes in [-127, 127]) -> x_q @ w_q.T as [M, N] int32, exact.
    amx: on AMX tiles (where K is a multiple of 64; the same integers); None: where amx_enabled().
    w_sums: seven_bit_row_sums(w_q), only for codes within [-63, 63] (the same integers, faster on AVX2)."""
    for name, t in (("x_q", x_q), ("w_q", w_q)):
        if t.dtype != torch.int8 or t.dim() != 2 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a 2-D int8 CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if x_q.shape[1] != w_q.shape[1]:
        raise ValueError(f"x_q is [M, K] = {list(x_q.shape)} but w_q is [N, K] = {list(w_q.shape)}")
    if w_sums is not None and (w_sums.dtype != torch.int32 or tuple(w_sums.shape) != (w_q.shape[0],)):
        raise ValueError(f"w_sums must be int32 [{w_q.shape[0]}], got {w_sums.dtype} {tuple(w_sums.shape)}")
    out = torch.empty((x_q.shape[0], w_q.shape[0]), dtype=torch.int32)
    # amx=True where the CPU has no AMX is refused by the kernel (RuntimeError)
    _modules()[0].product(
        x_q.contiguous(), w_q.contiguous(), out, amx_enabled() if amx is None else amx,
        None if w_sums is None else w_sums.contiguous(),
    )  # fmt: skip
    return out


def _check(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    check_float_tensor("x", x, 2)
    N, K = w_q.shape
    if x.shape[1] != K:
        raise ValueError(f"x has K = {x.shape[1]} columns but w_q is [N, K] = [{N}, {K}]")
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != (N,):
        raise ValueError(f"w_scale must be float32 [{N}], got {w_scale.dtype} {tuple(w_scale.shape)}")
    return resolve_out_dtype(x, out_dtype)


def int8_linear_small_batch(
    x: torch.Tensor,  # [M, K] float
    w_q: torch.Tensor,  # [N, K] int8 codes
    w_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,  # default x.dtype
    residual: torch.Tensor | None = None,  # [M, N]: added to the output
    w_sums: torch.Tensor | None = None,  # seven_bit_row_sums(w_q), for 7-bit codes
) -> torch.Tensor:  # [M, N] = x @ w.T (+ bias) (+ residual), in out_dtype
    out_dtype = _check(x, w_q, w_scale, out_dtype)
    M, N = x.shape[0], w_q.shape[0]
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias must have shape [{N}], got {tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != (M, N):
        raise ValueError(f"residual must have shape [{M}, {N}], got {tuple(residual.shape)}")
    x_q, x_scale = cpu_int8_linear.quantize_per_token_cpu(x)
    out = torch.empty((M, N), dtype=out_dtype)
    _modules()[1].dequantize_rows(
        int8_product(x_q, w_q, w_sums=w_sums), x_scale, w_scale.contiguous(),
        None if bias is None else bias.to(out_dtype).contiguous(),
        None if residual is None else residual.to(out_dtype), out,
    )  # fmt: skip
    return out


def int8_linear_silu_mul_small_batch(
    x: torch.Tensor,  # [M, K] float
    w_q: torch.Tensor,  # [2 * I, K] int8 codes: gate rows, then up rows
    w_scale: torch.Tensor,  # [2 * I] float32
    out_dtype: torch.dtype | None = None,  # default x.dtype
    w_sums: torch.Tensor | None = None,  # seven_bit_row_sums(w_q), for 7-bit codes
) -> torch.Tensor:  # [M, I] = silu(x @ w_gate.T) * (x @ w_up.T), in out_dtype
    out_dtype = _check(x, w_q, w_scale, out_dtype)
    if w_q.shape[0] % 2:
        raise ValueError(f"the gate/up weight must have 2 * I rows (gate, then up), got N = {w_q.shape[0]}")
    half = w_q.shape[0] // 2
    x_q, x_scale = cpu_int8_linear.quantize_per_token_cpu(x)
    acc = int8_product(x_q, w_q, w_sums=w_sums)  # [M, 2 * I] int32
    out = torch.empty((x.shape[0], half), dtype=out_dtype)
    _modules()[1].dequantize_silu_mul(
        acc[:, :half], acc[:, half:], x_scale, w_scale[:half].contiguous(), w_scale[half:].contiguous(), out
    )
    return out


def int8_argmax_small_batch(
    x: torch.Tensor,  # [M, K] float
    w_q: torch.Tensor,  # [N, K] int8 codes
    w_scale: torch.Tensor,  # [N] float32
    w_sums: torch.Tensor | None = None,  # seven_bit_row_sums(w_q), for 7-bit codes
) -> tuple[torch.Tensor, torch.Tensor]:  # indices [M] int64, values [M] float32
    """Each row's first maximal entry of int8_linear_small_batch(x, w_q, w_scale) (float32 out), and its
    value, without making the [M, N] product: a greedy step's LM head (the kernel's comment says why)."""
    _check(x, w_q, w_scale, torch.float32)
    if w_q.shape[0] == 0:
        raise ValueError("w_q must have at least one row")
    if w_sums is not None and (w_sums.dtype != torch.int32 or tuple(w_sums.shape) != (w_q.shape[0],)):
        raise ValueError(f"w_sums must be int32 [{w_q.shape[0]}], got {w_sums.dtype} {tuple(w_sums.shape)}")
    x_q, x_scale = cpu_int8_linear.quantize_per_token_cpu(x)
    return _modules()[0].argmax_product(
        x_q, x_scale, w_q.contiguous(), w_scale.contiguous(), amx_enabled(),
        None if w_sums is None else w_sums.contiguous(),
    )
