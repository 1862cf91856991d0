"""The INT8 codes, defined once: symmetric per row, scale = max|row| / qmax, codes round(x / scale).

Activations are quantized per token (qmax 127), weights per output channel (qmax 127, or 63 where oneDNN's
u8 x s8 GEMM is exact only so: cpu_int8_linear.weight_qmax). The int8 linear (int8_linear.py), the oneDNN
prepacking (cpu_int8_linear.py), the KV-cache writer and the engine's weight loading
(worker/engine/quantization.py) all quantize here; the compiled and Triton kernels reproduce these codes.
It imports no other op module, so any of them may import it.
"""

from __future__ import annotations

import torch

from kernels._checks import INT8_SCALE_EPS, check_float_tensor


def check_rows(x: torch.Tensor) -> None:
    check_float_tensor("x", x, 2)
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last dimension")


def quantize_rows(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (q [M, K] int8 in [-qmax, qmax], scale [M] float32 = max|x_row| / qmax)."""
    check_rows(x)
    # Measured on the 2-core CPU: abs().amax() and an exact division beat vector_norm(inf), aminmax and
    # multiplying by the reciprocal (which also differs from the reference by 1 now and then).
    x = x.float()
    scale = x.abs().amax(dim=1).div_(qmax).clamp_(min=INT8_SCALE_EPS)
    return torch.div(x, scale[:, None]).round_().clamp_(-qmax, qmax).to(torch.int8), scale


def quantize_per_token_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (x_q [M, K] int8, x_scale [M] float32); symmetric, scale = max|x_row| / 127."""
    return quantize_rows(x, 127)


def quantize_weight_per_channel(w: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (w_q [N, K] int8 contiguous, w_scale [N] float32); pass w_q.t() to int8_linear.

    Symmetric per output channel: w_scale = max|w_row| / qmax, codes in [-qmax, qmax]. qmax 63 keeps
    oneDNN's u8 x s8 GEMM exact on CPUs without VNNI (see cpu_int8_linear.weight_qmax).
    """
    if not 1 <= qmax <= 127:
        raise ValueError(f"qmax must be in [1, 127], got {qmax}")
    return quantize_rows(w.contiguous(), qmax)
