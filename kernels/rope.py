"""Rotary embedding applied in place on CPU bfloat16 (csrc/int8_linear_cpu.cpp rope): the torch expression
x * cos + swapped * signed_sin is four passes and three temporaries per tensor; the kernel computes the same
bfloat16 roundings in one pass over the fused qkv output. float32 keeps the torch ops (they match
transformers bit for bit; a compiled sum could be contracted into a fused multiply-add)."""

from __future__ import annotations

import torch

from kernels import cpu_int8_linear


def supports(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether rotate_ runs on x [T, heads, head_dim] with tables cos [T, 1, rot]."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and cos.dtype == torch.bfloat16
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cpu_int8_linear.available()
    )


def rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated in place by cos and signed_sin [T, 1, rot]; returns x."""
    if not supports(x, cos):
        raise ValueError(f"the compiled rotary embedding takes CPU bfloat16 [T, heads, head_dim] rows, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")  # fmt: skip
    cpu_int8_linear.load_extension().rope(x, cos.reshape(x.shape[0], -1).contiguous(),
                                          signed_sin.reshape(x.shape[0], -1).contiguous())  # fmt: skip
    return x
