"""RMSNorm in LlamaRMSNorm's order of operations: float32 statistics, the normalized row rounded to the
input dtype, then the weight.

CPU bfloat16 rows take one compiled pass per row (csrc/int8_linear_cpu.cpp rms_norm): the torch ops are
six passes plus two dtype copies, which at prefill sizes cost about a sixth of a layer's time besides its
matrix products. float32 rows keep the torch ops, which match transformers bit for bit (the compiled sum
of squares runs in another order); so do CUDA tensors (no Triton kernel: one fused norm is not worth one).
"""

from __future__ import annotations

import torch

from kernels import cpu_int8_linear
from kernels._dispatch import select_backend


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # same order of operations as transformers' LlamaRMSNorm, so float32 runs match it exactly
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    cpu_int8_linear.load_extension().rms_norm(rows, weight.contiguous(), eps, out)
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden], weight [hidden] of x's dtype -> the normalized x, x's dtype."""
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    backend = select_backend(
        x, compiled_supports=lambda: x.dtype == torch.bfloat16 and cpu_int8_linear.available()
    )
    return rms_norm_cpu(x, weight, eps) if backend == "compiled" else rms_norm_torch(x, weight, eps)


def rms_norm_quantize_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, hidden] bfloat16 on CPU -> (codes [M, hidden] int8, scales [M] float32): exactly
    quantize_per_token_cpu(rms_norm(x, weight, eps)), in one compiled pass that never writes the normalized rows
    (a W8A8 product's input). bfloat16 only: there rms_norm itself is the compiled row function this reuses."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu" or not cpu_int8_linear.available():
        raise ValueError(f"needs a [M, hidden] bfloat16 CPU tensor and the compiled kernels, got {x.dtype} {x.device}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{x.shape[1]}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    x = x.contiguous()
    codes = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty((x.shape[0],), dtype=torch.float32)
    cpu_int8_linear.load_extension().rms_norm_quantize(x, weight.contiguous(), eps, codes, scales)
    return codes, scales
