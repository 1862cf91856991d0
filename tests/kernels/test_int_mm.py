"""kernels/int_mm.py: the int8 product is exact against a float64 reference, by either path."""

from __future__ import annotations

import pytest
import torch

from kernels.int_mm import EXACT_FLOAT_K, int_mm, int_mm_by_float_slices, int_mm_exact_on_cpu


def random_codes(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() @ b.double()).to(torch.int32)


@pytest.mark.parametrize("product", [int_mm, int_mm_by_float_slices], ids=["dispatch", "float slices"])
@pytest.mark.parametrize(("M", "K", "N"), [(1, 64, 24), (17, 576, 96), (40, 1536, 136), (3, 2 * EXACT_FLOAT_K + 8, 40)])
def test_int8_product_is_exact(product, M: int, K: int, N: int) -> None:
    a, b = random_codes(M, K, seed=M + K), random_codes(K, N, seed=N)
    assert torch.equal(product(a, b), reference(a, b))


@pytest.mark.parametrize("product", [int_mm, int_mm_by_float_slices], ids=["dispatch", "float slices"])
def test_the_worst_case_is_exact(product) -> None:
    # every pair sum at its largest: saturating int16 pair sums (AVX2 without VNNI) would show here
    a = torch.full((32, 4096), 127, dtype=torch.int8)
    b = torch.full((4096, 16), 127, dtype=torch.int8)
    b[:, 1::2] = -127
    assert torch.equal(product(a, b), reference(a, b))


def test_the_probe_agrees_with_torch() -> None:
    a = torch.full((32, 64), 127, dtype=torch.int8)
    b = torch.full((64, 16), 127, dtype=torch.int8)
    assert int_mm_exact_on_cpu() == torch.equal(torch._int_mm(a, b), reference(a, b))
