"""W8A8 linear: int8 weights per output channel, int8 activations per token, int32 products, float output.

y = (x_q @ w_q_t) * x_scale[:, None] * w_scale[None, :] + bias, with x_q, x_scale = quantize_per_token(x).

Weight layout: keep w_q [N, K] contiguous (quantize.py: quantize_weight_per_channel), pass w_q.t() as
w_q_t. On the 2-core CPU torch._int_mm runs equally fast with a [K, N]-contiguous operand and with this
transposed view (measured within 5% at M = 32, 256 and 1024 for K, N = 576, 1536 and 1536, 576); on CUDA
the K-major [N, K] layout is the one int8 tensor cores read directly.
CPU: torch._int_mm (works for every M on CPU, 1 included) and an epilogue of plain in-place float ops; on
this CPU the mixed-dtype variants (int32 * float32 in one op, out= casts) measured slower.
CUDA: a Triton quantization kernel, then a Triton int8 GEMM whose epilogue applies both scales and the bias
(torch._int_mm on CUDA wants M > 16 and multiples of 8; the Triton GEMM has no such limits).
"""

from __future__ import annotations

import torch

from kernels import cpu_int8_linear
from kernels._checks import FLOAT_DTYPES, check_same_device
from kernels._dispatch import select_backend
from kernels._triton import cdiv, jit, next_power_of_2, require_triton_device, tl
from kernels.int_mm import int_mm
from kernels.quantize import check_rows, quantize_per_token_torch


@jit
def _quantize_rows_kernel(
    x_ptr,  # [M, K] float, last dim contiguous
    q_ptr,  # [M, K] int8, contiguous
    scale_ptr,  # [M] float32
    K,
    stride_xm,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    absmax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
        absmax = tl.maximum(absmax, tl.abs(x))
    scale = tl.maximum(tl.max(absmax, axis=0) / 127.0, 1e-8)
    for start in range(0, K, BLOCK_K):
        mask = start + cols < K
        x = tl.load(x_ptr + row * stride_xm + start + cols, mask=mask, other=0.0).to(tl.float32)
        # +- 1.5 * 2**23 rounds half to even, like torch.round (libdevice.rint does not run in the interpreter).
        rounded = (x / scale + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(rounded, -127.0), 127.0).to(tl.int8)
        tl.store(q_ptr + row * K + start + cols, q, mask=mask)
    tl.store(scale_ptr + row, scale)


@jit
def _int8_matmul_kernel(
    a_ptr,  # [M, K] int8 (activations)
    b_ptr,  # [K, N] int8 (weights, any strides)
    c_ptr,  # [M, N] output dtype, contiguous
    a_scale_ptr,  # [M] float32
    b_scale_ptr,  # [N] float32
    bias_ptr,  # [N] or unused
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped tile order: GROUP_M row tiles share each column tile while it is in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_id = pid // (GROUP_M * num_pid_n)
    first_m = group_id * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_rows)
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for start in range(0, K, BLOCK_K):
        k_mask = start + ks < K
        a = tl.load(a_ptrs, mask=(rows[:, None] < M) & k_mask[None, :], other=0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & (cols[None, :] < N), other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    a_scale = tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)
    b_scale = tl.load(b_scale_ptr + cols, mask=cols < N, other=0.0)
    y = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_rows(x)
    require_triton_device(x)
    M, K = x.shape
    x_q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    x_scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M > 0:
        block_k = min(1024, next_power_of_2(K))
        _quantize_rows_kernel[(M,)](x, x_q, x_scale, K, x.stride(0), BLOCK_K=block_k)
    return x_q, x_scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (x_q [M, K] int8, x_scale [M] float32), symmetric per row: absmax / 127."""
    check_rows(x)
    backend = select_backend(x, compiled_supports=cpu_int8_linear.available)
    if backend == "triton":
        return quantize_per_token_triton(x)
    if backend == "compiled":
        return cpu_int8_linear.quantize_per_token_cpu(x)
    return quantize_per_token_torch(x)


def _check_linear_args(
    x: torch.Tensor,
    w_q_t: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> torch.dtype:
    check_rows(x)
    if w_q_t.dtype != torch.int8 or w_q_t.dim() != 2:
        raise ValueError(f"w_q_t must be a 2-D int8 [K, N] tensor, got {w_q_t.dtype} {tuple(w_q_t.shape)}")
    K, N = w_q_t.shape
    if x.shape[1] != K:
        raise ValueError(f"x has K = {x.shape[1]} columns but w_q_t is [K, N] = [{K}, {N}]")
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != (N,):
        raise ValueError(f"w_scale must be float32 [{N}], got {w_scale.dtype} {tuple(w_scale.shape)}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias must have shape [{N}], got {tuple(bias.shape)}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    check_same_device(x=x, w_q_t=w_q_t, w_scale=w_scale, bias=bias)
    return out_dtype


def int8_linear_torch(
    x: torch.Tensor,
    w_q_t: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    out_dtype = _check_linear_args(x, w_q_t, w_scale, bias, out_dtype)
    x_q, x_scale = quantize_per_token_torch(x)
    y = int_mm(x_q, w_q_t).float()  # [M, N]
    y.mul_(x_scale[:, None]).mul_(w_scale)
    if bias is not None:
        y.add_(bias)
    return y.to(out_dtype)


def _matmul_config(M: int) -> dict[str, int]:
    """Tile sizes by the number of rows; decode-sized M gets short tiles so that more of them run at once."""
    if M <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)


def int8_linear_triton(
    x: torch.Tensor,
    w_q_t: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    out_dtype = _check_linear_args(x, w_q_t, w_scale, bias, out_dtype)
    require_triton_device(x, w_q_t)
    x_q, x_scale = quantize_per_token_triton(x)
    (M, K), N = x.shape, w_q_t.shape[1]
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return y
    config = _matmul_config(M)
    grid = (cdiv(M, config["BLOCK_M"]) * cdiv(N, config["BLOCK_N"]),)
    _int8_matmul_kernel[grid](
        x_q, w_q_t, y, x_scale, w_scale, bias if bias is not None else w_scale,
        M, N, K, x_q.stride(0), x_q.stride(1), w_q_t.stride(0), w_q_t.stride(1),
        HAS_BIAS=bias is not None, **config,
    )  # fmt: skip
    return y


def _check_residual(residual: torch.Tensor | None, shape: tuple[int, int]) -> None:
    if residual is not None and tuple(residual.shape) != shape:
        raise ValueError(f"residual must have shape {list(shape)}, got {tuple(residual.shape)}")


def int8_linear(
    x: torch.Tensor,
    w_q_t: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] float, w_q_t int8 [K, N], w_scale float32 [N] -> y [M, N] in out_dtype (default x.dtype).

    residual [M, N], when given, is added to y (fused into the output pass on CPU).
    """
    out_dtype = _check_linear_args(x, w_q_t, w_scale, bias, out_dtype)
    _check_residual(residual, (x.shape[0], w_q_t.shape[1]))
    backend = select_backend(x, compiled_supports=cpu_int8_linear.available)
    if backend == "compiled":
        return cpu_int8_linear.int8_linear_cpu(x, w_q_t, w_scale, bias, out_dtype, residual)
    linear = int8_linear_triton if backend == "triton" else int8_linear_torch
    y = linear(x, w_q_t, w_scale, bias, out_dtype)
    return y if residual is None else y.add_(residual)


GATE_ACTIVATIONS = ("silu", "gelu_tanh")  # SiLU, and GELU's tanh form (Gemma's GeGLU, gelu_pytorch_tanh)


def gate_activation(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """A gated MLP's activation of its gate half, one of GATE_ACTIVATIONS."""
    if activation == "silu":
        return torch.nn.functional.silu(gate)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh")
    raise ValueError(f"unknown MLP activation {activation!r}")


def int8_linear_silu_mul(
    x: torch.Tensor,
    w_q_t: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """A gated MLP's input projection: y = x @ W (W's columns: gate, then up) -> act(gate) * up, act SiLU (the
    name) or "gelu_tanh".

    x [M, K] float, w_q_t int8 [K, 2 * I], w_scale float32 [2 * I] -> [M, I] in out_dtype (default x.dtype).
    On CPU the gate and up halves are never stored: the activation and product happen in the output pass.
    """
    if w_q_t.dim() != 2 or w_q_t.shape[1] % 2:
        raise ValueError(f"w_q_t must be [K, 2 * I] (gate, then up), got {tuple(w_q_t.shape)}")
    out_dtype = _check_linear_args(x, w_q_t, w_scale, None, out_dtype)
    backend = select_backend(x, compiled_supports=cpu_int8_linear.available)
    if backend == "compiled":
        return cpu_int8_linear.int8_linear_silu_mul_cpu(x, w_q_t, w_scale, out_dtype, activation)
    linear = int8_linear_triton if backend == "triton" else int8_linear_torch
    gate, up = linear(x, w_q_t, w_scale, None, out_dtype).chunk(2, dim=-1)
    return gate_activation(gate, activation) * up
