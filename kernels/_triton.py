"""Optional Triton: importing `kernels` needs neither triton nor CUDA.

Kernel modules decorate kernels with `jit` from here: triton.jit when triton is installed, else a no-op
(launching then raises). They use `from __future__ import annotations`, so `tl.constexpr` annotations stay
strings (Triton accepts them) and `tl` may be None. TRITON_INTERPRET=1 (the numpy interpreter the tests
use on CPU) must be set before triton is first imported: triton decorates its own library (tl.zeros,
tl.max, ...) and these kernels at import time, compiled or interpreted.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: every op falls back to its torch implementation
    triton = None
    tl = None


def triton_available() -> bool:
    return triton is not None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def upcast_dot(dtype: torch.dtype) -> bool:
    """The interpreter computes bfloat16 tl.dot wrongly (numpy has no bfloat16): kernels upcast there."""
    return dtype == torch.bfloat16 and interpreter_enabled()


def use_triton(tensor: torch.Tensor) -> bool:
    """The dispatch rule of every public op: Triton for CUDA tensors when triton is installed."""
    return tensor.is_cuda and triton is not None


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _undecorated(fn: Callable[..., None]) -> Callable[..., None]:
    return fn


jit: Callable[[Callable[..., None]], Any] = triton.jit if triton is not None else _undecorated


def require_triton_device(*tensors: torch.Tensor) -> None:
    """Triton launches need CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (tests)."""
    if triton is None:
        raise RuntimeError("triton is not installed: pip install 'freight[triton]'")
    for tensor in tensors:
        if not tensor.is_cuda and not interpreter_enabled():
            raise ValueError("Triton kernels need CUDA tensors (CPU tensors only with TRITON_INTERPRET=1)")
