"""Linear layers: float, or INT8 weights with per-token INT8 activations (W8A8) on one of two GEMMs.

INT8 backends: "int_mm" runs torch._int_mm (s8 x s8; fast with AVX-512 VNNI, and the CUDA path), "onednn"
runs oneDNN's u8 x s8 qlinear (fast on AVX2, where torch._int_mm is 50x slower than float32); path_plan.py
measures which one this machine runs faster.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from kernels import cpu_int8_linear
from kernels.int8_linear import int8_linear, int8_linear_silu_mul, quantize_weight_per_channel

Int8Backend = Literal["int_mm", "onednn", "triton"]


class FloatLinear:
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, out_dtype: torch.dtype | None
    ) -> None:
        self.weight = weight.to(dtype).contiguous()  # [out_features, in_features]
        self.bias = bias.to(dtype) if bias is not None else None
        self.out_dtype = out_dtype  # None: dtype

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens, in] -> [tokens, out], plus residual [tokens, out] when given."""
        y = F.linear(x, self.weight, self.bias)
        if self.out_dtype is not None:
            y = y.to(self.out_dtype)
        return y if residual is None else residual + y  # transformers' order, for exact float32 parity

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """A gated MLP's fused gate/up projection: [tokens, in] -> silu(gate) * up [tokens, out / 2]."""
        gate, up = F.linear(x, self.weight, self.bias).chunk(2, dim=-1)
        return F.silu(gate) * up


class Int8Linear:
    """Per-output-channel symmetric INT8 weights, quantized once at load time."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, out_dtype: torch.dtype | None
    ) -> None:
        w_q, self.w_scale = quantize_weight_per_channel(weight.float())  # [out, in] int8, [out] fp32
        self.w_q_t = w_q.t()  # [in, out] view of the contiguous [out, in] tensor
        self.bias = bias.to(dtype) if bias is not None else None
        self.out_dtype = out_dtype  # None: the input's dtype

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens, in] -> [tokens, out], plus residual [tokens, out] when given (fused on CPU)."""
        return int8_linear(x, self.w_q_t, self.w_scale, self.bias, self.out_dtype, residual=residual)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, in] -> silu(gate) * up [tokens, out / 2]; gate and up are never stored on CPU."""
        if self.bias is not None:
            gate, up = self(x).chunk(2, dim=-1)
            return F.silu(gate) * up
        return int8_linear_silu_mul(x, self.w_q_t, self.w_scale, self.out_dtype)


class OnednnInt8Linear:
    """W8A8 through oneDNN's u8 x s8 GEMM (weights prepacked once; per-token scales in our epilogue)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, out_dtype: torch.dtype | None
    ) -> None:
        self.weight = cpu_int8_linear.prepack_onednn(weight.float())
        self.bias = bias.to(dtype) if bias is not None else None
        self.out_dtype = out_dtype

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return cpu_int8_linear.int8_linear_onednn(x, self.weight, self.bias, self.out_dtype, residual)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            gate, up = self(x).chunk(2, dim=-1)
            return F.silu(gate) * up
        return cpu_int8_linear.int8_linear_silu_mul_onednn(x, self.weight, self.out_dtype)


Linear = FloatLinear | Int8Linear | OnednnInt8Linear


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    quantization: str | None,
    out_dtype: torch.dtype | None = None,
    int8_backend: Int8Backend | None = None,
) -> Linear:
    """int8_backend: "onednn" on CPU when path_plan.py chose it; anything else runs int8_linear's dispatch."""
    if quantization == "int8":
        if int8_backend == "onednn" and weight.device.type == "cpu":
            return OnednnInt8Linear(weight, bias, dtype, out_dtype)
        return Int8Linear(weight, bias, dtype, out_dtype)
    return FloatLinear(weight, bias, dtype, out_dtype)
