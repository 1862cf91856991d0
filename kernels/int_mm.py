"""int8 x int8 -> int32 matrix product that is exact on every machine: torch._int_mm where it is exact.

torch._int_mm is exact wherever torch runs it natively. It is not on a VNNI CPU whose oneDNN is capped below
VNNI (ONEDNN_MAX_CPU_ISA=AVX2, which FREIGHT_CPU_ISA=avx2 sets to test the AVX2 tier on an AVX-512 machine):
torch still routes the product to oneDNN, whose AVX2 s8 x s8 kernel shifts the activations to u8 and adds
pairs of u8 x s8 products in int16 with saturation (2 * 255 * 127 overflows it), so a few outputs come out
wrong by thousands. There the product is taken in float32 over slices of K short enough that every partial
sum is an integer below 2**24, hence exact, and the slices are added in int32.
"""

from __future__ import annotations

import functools

import torch

# |partial sum| <= 127 * 127 * 1024 = 16,516,096 < 2**24: float32 holds every partial sum exactly
EXACT_FLOAT_K = 1024


@functools.cache
def int_mm_exact_on_cpu() -> bool:
    """Whether torch._int_mm gives the exact product of the worst case here (all +127 against +-127 columns,
    at M = 1 and M = 32: oneDNN picks kernels by shape)."""
    K, N = 64, 16
    b = torch.full((K, N), 127, dtype=torch.int8)
    b[:, 1::2] = -127
    for M in (1, 32):
        a = torch.full((M, K), 127, dtype=torch.int8)
        want = torch.full((M, N), 127 * 127 * K, dtype=torch.int32)
        want[:, 1::2] = -127 * 127 * K
        if not torch.equal(torch._int_mm(a, b), want):
            return False
    return True


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] int8 @ b [K, N] int8 -> [M, N] int32, exact (see the module docstring)."""
    if a.device.type != "cpu" or int_mm_exact_on_cpu():
        return torch._int_mm(a, b)
    return int_mm_by_float_slices(a, b)


def int_mm_by_float_slices(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] int8 @ b [K, N] int8 -> [M, N] int32 through float32 products of K slices (exact)."""
    out = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.int32, device=a.device)
    for start in range(0, a.shape[1], EXACT_FLOAT_K):
        k = slice(start, start + EXACT_FLOAT_K)
        out += (a[:, k].float() @ b[k].float()).to(torch.int32)
    return out
