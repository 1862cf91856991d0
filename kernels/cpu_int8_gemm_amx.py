"""INT8 GEMM on AMX tiles for many rows (csrc/int8_gemm_amx_cpu.cpp): prefill chunks and large decode batches.

Exact s8 x s8 products into int32, so with the same weight codes and the same epilogue a row's outputs do
not depend on which product (this one, the small-batch kernel, oneDNN's qlinear) multiplied it. The weights
are packed once, at load, into the tiles' VNNI layout; K must be a multiple of 64 (every model we load).
Built in the avx512 tier; usable where the CPU has AMX-INT8, the kernel grants the tile registers and
platform.amx_allowed().
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels import cpu_int8_linear
from kernels._checks import check_float_tensor, resolve_out_dtype
from kernels._cpu_build import build_extension
from kernels.platform import amx_allowed

K_MULTIPLE = 64  # bytes of K per tile product


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here (logged once)."""
    return build_extension("freight_int8_gemm_amx_cpu", "int8_gemm_amx_cpu.cpp", fast_math=False)


@functools.cache
def available() -> bool:
    """Whether the GEMM runs here: built, AMX-INT8 usable, and AMX allowed (platform.amx_allowed())."""
    extension = load_extension()
    return extension is not None and extension.available() and amx_allowed()


@dataclass(frozen=True)
class AmxWeight:
    """An [N, K] weight's codes packed for the tiles."""

    packed: torch.Tensor  # [ceil(N / 32) * 2, K / 64, 16, 64] int8
    N: int
    K: int


def supports(weight: torch.Tensor) -> bool:
    """Whether an [N, K] weight can run here: K a multiple of 64, on the CPU, the GEMM available."""
    return (
        weight.dim() == 2
        and weight.shape[1] % K_MULTIPLE == 0
        and weight.device.type == "cpu"
        and available()
    )


def pack(w_q: torch.Tensor) -> AmxWeight:
    """w_q [N, K] int8 codes (K a multiple of 64) -> the packed weight."""
    if w_q.dtype != torch.int8 or w_q.dim() != 2 or w_q.shape[1] % K_MULTIPLE:
        raise ValueError(f"w_q must be [N, K] int8 with K a multiple of {K_MULTIPLE}, got {w_q.dtype} "
                         f"{tuple(w_q.shape)}")  # fmt: skip
    extension = load_extension()
    if extension is None:
        raise RuntimeError("the AMX int8 GEMM is not available in this build")
    return AmxWeight(extension.pack_weight(w_q.contiguous()), w_q.shape[0], w_q.shape[1])


def product(x_q: torch.Tensor, w: AmxWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x_q [M, K] int8 -> x_q @ w_q.T as [M, N] int32, exact (written into `out` when given)."""
    if x_q.dtype != torch.int8 or x_q.dim() != 2 or x_q.shape[1] != w.K:
        raise ValueError(f"x_q must be [M, {w.K}] int8, got {x_q.dtype} {tuple(x_q.shape)}")
    if out is None:
        out = torch.empty((x_q.shape[0], w.N), dtype=torch.int32)
    elif out.dtype != torch.int32 or tuple(out.shape) != (x_q.shape[0], w.N) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{x_q.shape[0]}, {w.N}] int32 tensor")
    extension = load_extension()
    if extension is None or not available():
        raise RuntimeError("the AMX int8 GEMM is not usable here")
    extension.product(x_q.contiguous(), w.packed, out)
    return out


def pack_gated(w_q: torch.Tensor) -> AmxWeight:
    """A gate-then-up weight [2 * I, K] (I a multiple of 16) packed so that each 32-column block holds 16
    gate columns and their 16 up columns: silu(gate) * up is then formed from one block of products."""
    two_i, k = w_q.shape
    if two_i % 32:
        raise ValueError(f"the gated packing needs 2 * I a multiple of 32, got {two_i}")
    interleaved = w_q.view(2, two_i // 32, 16, k).transpose(0, 1).reshape(two_i, k)
    return pack(interleaved)


@dataclass(frozen=True)
class QuantizedRows:
    """Activations already quantized per token (e.g. by norm.rms_norm_quantize_cpu, fused with the norm that
    makes them): the codes and scales the GEMM would have made of the float rows, and those rows' dtype."""

    codes: torch.Tensor  # [M, K] int8
    scales: torch.Tensor  # [M] float32
    dtype: torch.dtype  # the float rows' dtype: the default output dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


def _quantized(
    x: torch.Tensor | QuantizedRows, w: AmxWeight, out_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    if isinstance(x, QuantizedRows):
        if x.codes.dtype != torch.int8 or x.codes.dim() != 2 or x.scales.shape != (x.codes.shape[0],):
            raise ValueError(f"codes must be [M, K] int8 with [M] scales, got {x.codes.dtype} {tuple(x.codes.shape)}")
        x_q, x_scale, out_dtype = x.codes.contiguous(), x.scales.contiguous(), out_dtype or x.dtype
    else:
        check_float_tensor("x", x, 2)
        out_dtype = resolve_out_dtype(x, out_dtype)
        x_q, x_scale = cpu_int8_linear.quantize_per_token_cpu(x)
    if x_q.shape[1] != w.K:
        raise ValueError(f"x has K = {x_q.shape[1]} columns but the weight is [N, K] = [{w.N}, {w.K}]")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the AMX epilogue writes float32 or bfloat16, not {out_dtype}")
    return x_q, x_scale, out_dtype


def int8_linear_amx(
    x: torch.Tensor | QuantizedRows,  # [M, K] float, or its codes and scales
    w: AmxWeight,
    w_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,  # default x.dtype
    residual: torch.Tensor | None = None,  # [M, N]: added to the output
) -> torch.Tensor:  # [M, N] = x @ w.T (+ bias) (+ residual), in out_dtype
    """W8A8 on the tiles: the same per-token quantization and, applied to each block of products while it
    is in L1, the same epilogue as the other INT8 paths (csrc/int8_epilogue_avx512.h)."""
    x_q, x_scale, out_dtype = _quantized(x, w, out_dtype)
    M = x_q.shape[0]
    if residual is not None and tuple(residual.shape) != (M, w.N):
        raise ValueError(f"residual must have shape [{M}, {w.N}], got {tuple(residual.shape)}")
    out = torch.empty((M, w.N), dtype=out_dtype)
    load_extension().linear(
        x_q, w.packed, x_scale, w_scale.contiguous(),
        None if bias is None else bias.to(out_dtype).contiguous(),
        None if residual is None else residual.to(out_dtype).contiguous(), out,
    )  # fmt: skip
    return out


def int8_linear_silu_mul_amx(
    x: torch.Tensor | QuantizedRows,  # [M, K] float, or its codes and scales
    w: AmxWeight,  # pack_gated() of the [2 * I, K] gate-then-up codes
    w_scale: torch.Tensor,  # [2 * I] float32: gate scales, then up scales
    out_dtype: torch.dtype | None = None,  # default x.dtype
) -> torch.Tensor:  # [M, I] = silu(x @ w_gate.T) * (x @ w_up.T), in out_dtype
    x_q, x_scale, out_dtype = _quantized(x, w, out_dtype)
    out = torch.empty((x_q.shape[0], w.N // 2), dtype=out_dtype)
    load_extension().silu_mul(x_q, w.packed, x_scale, w_scale.contiguous(), out)
    return out
