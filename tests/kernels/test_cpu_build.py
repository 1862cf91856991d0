"""The compiled-kernel loader survives what a killed build leaves behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from torch.utils.cpp_extension import _get_build_directory

from kernels import cpu_int8_small_batch
from kernels._cpu_build import build_extension
from kernels.platform import active_tier

pytestmark = pytest.mark.skipif(not cpu_int8_small_batch.available(), reason="no C++ toolchain to build kernels")


def test_a_dead_builds_lock_is_removed_instead_of_waited_on() -> None:
    name = "freight_int8_small_batch_cpu"
    lock = Path(_get_build_directory(f"{name}_{active_tier()}", verbose=False)) / "lock"
    lock.touch()  # what a build killed mid-way leaves: torch alone would wait for it forever
    started = time.perf_counter()
    module = build_extension(name, "int8_small_batch_cpu.cpp", fast_math=False)
    assert module is not None and hasattr(module, "product")
    assert not lock.exists()
    assert time.perf_counter() - started < 120
