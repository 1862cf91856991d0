"""The one dispatch rule of every public op, applied after the op has checked its arguments:

"triton"    a CUDA tensor, and triton is installed
"compiled"  a CPU tensor, the op's compiled CPU kernel is available here and supports these inputs
            (FREIGHT_CPU_KERNELS=0 makes it unavailable), and the caller did not pass compiled=False
"torch"     otherwise: the torch implementation
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from kernels._triton import use_triton

Backend = Literal["triton", "compiled", "torch"]
BACKENDS: tuple[Backend, ...] = ("triton", "compiled", "torch")


def select_backend(
    tensor: torch.Tensor,
    *,
    compiled_supports: Callable[[], bool] | None = None,
    compiled: bool = True,
) -> Backend:
    """The backend for an op whose main input is `tensor`. compiled_supports (None: the op has no
    compiled CPU kernel) says whether the compiled kernel is available and supports the op's inputs; it
    is asked only for CPU tensors, since loading the kernel can build it."""
    if use_triton(tensor):
        return "triton"
    if compiled and compiled_supports is not None and tensor.device.type == "cpu" and compiled_supports():
        return "compiled"
    return "torch"
