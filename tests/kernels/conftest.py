"""Kernel tests run each op three ways: the torch path on CPU, the Triton kernel under TRITON_INTERPRET=1 on
CPU tensors (`interpret`), and the Triton kernel compiled on CUDA (marker `cuda`, skipped without a GPU).

The interpreter works only if TRITON_INTERPRET=1 is set before triton is first imported. This conftest sets
it (unless the environment already sets it; scripts/gpu_check.sh runs `TRITON_INTERPRET=0` to compile for
the GPU), which is early enough when tests/kernels runs alone or after tests that import no torch (the unit
lane). In the full suite the modules collected before this folder (tests/jobs) import transformers first,
which imports triton through torch._dynamo; the `interpret` cases then skip here and
test_triton_subprocess.py runs them in a fresh process with the variable set from the start. Setting TRITON_INTERPRET=1 at the top of tests/conftest.py, or in the
environment, makes them run in-process instead.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cuda: compiles and runs Triton kernels on a CUDA device")
