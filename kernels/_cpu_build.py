"""Builds the compiled CPU kernels (C++ with OpenMP) on first use, through torch.utils.cpp_extension.

A C++ compiler and ninja are needed; when the build fails, or FREIGHT_CPU_KERNELS=0, callers fall back
to their torch paths, so a machine without a toolchain still runs (slower).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"


def build_extension(name: str, source: str, *, fast_math: bool) -> ModuleType | None:
    """The compiled module for csrc/`source`, or None when it cannot be built here (logged).

    fast_math lets the compiler vectorize libm calls (expf) and reassociate sums; kernels that must
    match torch bit for bit (an exact division before rounding) are built without it.
    """
    if os.environ.get("FREIGHT_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name=name,
            sources=[str(CSRC / source)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", *(["-ffast-math"] if fast_math else [])],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # a missing compiler or ninja must not stop the engine
        log.warning("CPU kernel %s unavailable (%s); using the torch path", name, exc)
        return None
