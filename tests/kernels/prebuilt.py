"""What a kernel test's subprocess needs to load the compiled kernels without compiling them.

A subprocess under a timeout must not build: a cold build of one kernel takes minutes on two busy cores.
So the test process loads (and, if need be, builds) every kernel first, outside any timeout, and the
subprocess runs with FREIGHT_CPU_KERNELS=prebuilt (kernels/_prebuilt.py), which loads those builds or
none, and with torch's builder replaced by one that fails (FORBID_BUILDING), so an attempt is an error.
"""

from __future__ import annotations

import os

from kernels import (
    cpu_decode_attention,
    cpu_int8_gemm_amx,
    cpu_int8_linear,
    cpu_int8_small_batch,
    cpu_prefill_attention,
)
from kernels._prebuilt import PREBUILT, build_directory
from kernels.platform import active_tier

MODULES = {
    "decode_attention": cpu_decode_attention,
    "int8_linear": cpu_int8_linear,
    "int8_small_batch": cpu_int8_small_batch,
    "int8_gemm_amx": cpu_int8_gemm_amx,
    "prefill_attention": cpu_prefill_attention,
}
# Prepended to a subprocess's script: any call of torch's JIT builder raises instead of compiling.
FORBID_BUILDING = """
import torch.utils.cpp_extension as _cpp_extension
def _no_build(*args, **kwargs):
    raise AssertionError(f"a test subprocess tried to build a C++ extension: {kwargs.get('name')}")
_cpp_extension.load = _no_build
"""
# A line for the subprocess to print: which kernels it loaded, to compare with built_here().
REPORT_LOADED = (
    "from tests.kernels.prebuilt import MODULES; "
    "print('loaded', sorted(n for n, m in MODULES.items() if m.load_extension() is not None))"
)


def built_here() -> list[str]:
    """The kernels this process has (building any that is missing or stale: there is no timeout here)."""
    return sorted(name for name, module in MODULES.items() if module.load_extension() is not None)


def build_files() -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file in the build folders of this tier's kernels: a build changes some."""
    root = build_directory(f"freight_decode_attention_cpu_{active_tier()}").parent
    return {
        str(path): (path.stat().st_size, path.stat().st_mtime_ns)
        for folder in root.glob(f"freight_*_{active_tier()}")
        for path in folder.iterdir()
        if path.is_file()
    }


def prebuilt_env() -> dict[str, str]:
    """This process's environment, with building forbidden."""
    return {**os.environ, "FREIGHT_CPU_KERNELS": PREBUILT}
