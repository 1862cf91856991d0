"""Linear layers: float, or INT8 weights with per-token INT8 activations (W8A8)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.int8_linear import int8_linear, quantize_weight_per_channel


class FloatLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.weight = weight.to(dtype).contiguous()  # [out_features, in_features]
        self.bias = bias.to(dtype) if bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        return F.linear(x, self.weight, self.bias)


class Int8Linear:
    """Per-output-channel symmetric INT8 weights, quantized once at load time."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        w_q, self.w_scale = quantize_weight_per_channel(weight.float())  # [out, in] int8, [out] fp32
        self.w_q_t = w_q.t()  # [in, out] view of the contiguous [out, in] tensor
        self.bias = bias.to(dtype) if bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        return int8_linear(x, self.w_q_t, self.w_scale, self.bias)


Linear = FloatLinear | Int8Linear


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, quantization: str | None
) -> Linear:
    if quantization == "int8":
        return Int8Linear(weight, bias, dtype)
    return FloatLinear(weight, bias, dtype)
