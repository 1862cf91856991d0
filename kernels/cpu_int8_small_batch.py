"""W8A8 linear for a small batch on CPU: our own int8 product (csrc/int8_small_batch_cpu.cpp), which streams
the weights once, between the same quantize and epilogue passes as the library GEMMs (cpu_int8_linear.py).

Below a few dozen rows a product is bound by reading its weights, and the library GEMMs fall far short of
that: oneDNN's qlinear reads the LM head at ~3 GB/s at M = 1 on the 2-core AVX2 VM and loses to float32 up
to M = 16. The products are exact integer sums, so with the same weight codes the results equal those of
the library GEMM bit for bit, whichever path a batch size takes (worker/engine/plan/small_batch.py
measures up to which M this one is faster).

The weights come prepared once at load (`prepare`): as the [N, K] codes themselves (the AVX2 loop, and AMX
tiles, which read them in place), or on the AVX-512 VNNI tier as panels of 16 output columns that the
register-blocked product reads (csrc/int8_vnni_panels.h says why). Either gives the same integers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

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


Layout = Literal["rows", "panels"]


@functools.cache
def panels_available() -> bool:
    """Whether this build has the panel product (the AVX-512 VNNI tiers)."""
    extension = load_extension()
    return extension is not None and extension.available_panels()


def default_layout(in_features: int) -> Layout:
    """Panels where the build has their product, AMX tiles are off (they read the [N, K] codes in place) and K
    is a multiple of 4 (a panel's depth); rows otherwise."""
    return "panels" if panels_available() and not amx_enabled() and in_features % 4 == 0 else "rows"


@dataclass(frozen=True)
class SmallBatchWeights:
    """A weight's INT8 codes as the small-batch product reads them, in one layout: `codes` [N, K] int8 (with
    `w_sums`, their row sums where they are 7-bit, for the AVX2 loop), or `panels` [ceil(N / 16), K / 4, 16, 4]
    uint8 = codes + 128 (csrc/int8_vnni_panels.h)."""

    out_features: int  # N
    in_features: int  # K
    codes: torch.Tensor | None = None
    w_sums: torch.Tensor | None = None
    panels: torch.Tensor | None = None

    @property
    def layout(self) -> Layout:
        return "panels" if self.panels is not None else "rows"


def prepare(w_q: torch.Tensor, layout: Layout | None = None) -> SmallBatchWeights:
    """w_q [N, K] int8 codes in [-127, 127] -> the small-batch product's weights, in `layout` (None: this
    build's default_layout). Done once per weight, at load."""
    if w_q.dtype != torch.int8 or w_q.dim() != 2:
        raise ValueError(f"w_q must be a 2-D int8 tensor, got {w_q.dtype} {tuple(w_q.shape)}")
    N, K = w_q.shape
    layout = layout or default_layout(K)
    if layout == "rows":
        codes = w_q.contiguous()
        return SmallBatchWeights(N, K, codes=codes, w_sums=seven_bit_row_sums(codes))
    if not panels_available():
        raise RuntimeError("the panel layout needs the AVX-512 VNNI build of the small-batch kernel")
    if K % 4:
        raise ValueError(f"the panel layout needs K a multiple of 4, got K = {K}")
    padded = torch.nn.functional.pad(w_q, (0, 0, 0, -N % 16))  # zero codes past N: [16 * P, K]
    # [P, 16, K / 4, 4] -> [P, K / 4, 16, 4], then + 128 as uint8 (xor of the sign bit)
    panels = padded.view((N + 15) // 16, 16, K // 4, 4).transpose(1, 2).contiguous().view(torch.uint8) ^ 0x80
    return SmallBatchWeights(N, K, panels=panels)


def int8_product(x_q: torch.Tensor, weights: SmallBatchWeights, amx: bool | None = None) -> torch.Tensor:
    """x_q [M, K] int8 times the weights' codes [N, K] -> x_q @ codes.T as [M, N] int32, exact.
    amx (rows layout only): on AMX tiles (where K is a multiple of 64; the same integers); None: where
    amx_enabled()."""
    if x_q.dtype != torch.int8 or x_q.dim() != 2 or x_q.device.type != "cpu":
        raise ValueError(f"x_q must be a 2-D int8 CPU tensor, got {x_q.dtype} {tuple(x_q.shape)} on {x_q.device}")
    if x_q.shape[1] != weights.in_features:
        raise ValueError(
            f"x_q is [M, K] = {list(x_q.shape)} but the weight is [N, K] = [{weights.out_features}, {weights.in_features}]"
        )
    out = torch.empty((x_q.shape[0], weights.out_features), dtype=torch.int32)
    product = _modules()[0]
    if weights.panels is not None:
        product.product_panels(x_q.contiguous(), weights.panels, weights.out_features, out)
        return out
    # amx=True where the CPU has no AMX is refused by the kernel (RuntimeError)
    product.product(x_q.contiguous(), weights.codes, out, amx_enabled() if amx is None else amx, weights.w_sums)
    return out


def _check(
    x: torch.Tensor, weights: SmallBatchWeights, w_scale: torch.Tensor, out_dtype: torch.dtype | None
) -> torch.dtype:
    check_float_tensor("x", x, 2)
    N, K = weights.out_features, weights.in_features
    if x.shape[1] != K:
        raise ValueError(f"x has K = {x.shape[1]} columns but the weight is [N, K] = [{N}, {K}]")
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != (N,):
        raise ValueError(f"w_scale must be float32 [{N}], got {w_scale.dtype} {tuple(w_scale.shape)}")
    return resolve_out_dtype(x, out_dtype)


def int8_linear_small_batch(
    x: torch.Tensor,  # [M, K] float
    weights: SmallBatchWeights,  # [N, K] codes, prepared
    w_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,  # default x.dtype
    residual: torch.Tensor | None = None,  # [M, N]: added to the output
) -> torch.Tensor:  # [M, N] = x @ w.T (+ bias) (+ residual), in out_dtype
    out_dtype = _check(x, weights, w_scale, out_dtype)
    M, N = x.shape[0], weights.out_features
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias must have shape [{N}], got {tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != (M, N):
        raise ValueError(f"residual must have shape [{M}, {N}], got {tuple(residual.shape)}")
    x_q, x_scale = cpu_int8_linear.quantize_per_token_cpu(x)
    out = torch.empty((M, N), dtype=out_dtype)
    _modules()[1].dequantize_rows(
        int8_product(x_q, weights), x_scale, w_scale.contiguous(),
        None if bias is None else bias.to(out_dtype).contiguous(),
        None if residual is None else residual.to(out_dtype), out,
    )  # fmt: skip
    return out


def int8_linear_silu_mul_small_batch(
    x: torch.Tensor,  # [M, K] float
    weights: SmallBatchWeights,  # [2 * I, K] codes, prepared: gate rows, then up rows
    w_scale: torch.Tensor,  # [2 * I] float32
    out_dtype: torch.dtype | None = None,  # default x.dtype
    activation: str = "silu",  # or "gelu_tanh"
) -> torch.Tensor:  # [M, I] = act(x @ w_gate.T) * (x @ w_up.T), in out_dtype
    out_dtype = _check(x, weights, w_scale, out_dtype)
    if weights.out_features % 2:
        raise ValueError(f"the gate/up weight must have 2 * I rows (gate, then up), got N = {weights.out_features}")
    half = weights.out_features // 2
    x_q, x_scale = cpu_int8_linear.quantize_per_token_cpu(x)
    acc = int8_product(x_q, weights)  # [M, 2 * I] int32
    out = torch.empty((x.shape[0], half), dtype=out_dtype)
    _modules()[1].dequantize_silu_mul(
        acc[:, :half], acc[:, half:], x_scale, w_scale[:half].contiguous(), w_scale[half:].contiguous(), out,
        activation,
    )  # fmt: skip
    return out


def int8_argmax_small_batch(
    x: torch.Tensor,  # [M, K] float
    weights: SmallBatchWeights,  # [N, K] codes, prepared
    w_scale: torch.Tensor,  # [N] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # indices [M] int64, values [M] float32
    """Each row's first maximal entry of int8_linear_small_batch(x, weights, w_scale) (float32 out), and its
    value, without making the [M, N] product: a greedy step's LM head (the kernel's comment says why)."""
    _check(x, weights, w_scale, torch.float32)
    if weights.out_features == 0:
        raise ValueError("the weight must have at least one row")
    x_q, x_scale = cpu_int8_linear.quantize_per_token_cpu(x)
    product = _modules()[0]
    if weights.panels is not None:
        return product.argmax_panels(x_q, x_scale, weights.panels, weights.out_features, w_scale.contiguous())
    return product.argmax_product(x_q, x_scale, weights.codes, w_scale.contiguous(), amx_enabled(), weights.w_sums)
