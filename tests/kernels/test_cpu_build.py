"""The compiled-kernel loader survives what a killed build leaves behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.utils.cpp_extension import _get_build_directory

from kernels import cpu_int8_small_batch
from kernels._cpu_build import BuildLockTimeout, _build_lock, build_extension
from kernels.platform import active_tier

pytestmark = pytest.mark.skipif(
    not cpu_int8_small_batch.available(), reason="no C++ toolchain to build kernels"
)


def test_a_dead_builds_lock_is_removed_instead_of_waited_on() -> None:
    name = "freight_int8_small_batch_cpu"
    lock = Path(_get_build_directory(f"{name}_{active_tier()}", verbose=False)) / "lock"
    lock.touch()  # what a build killed mid-way leaves: torch alone would wait for it forever
    started = time.perf_counter()
    module = build_extension(name, "int8_small_batch_cpu.cpp", fast_math=False)
    assert module is not None and hasattr(module, "product")
    assert not lock.exists()
    assert time.perf_counter() - started < 120


HOLD_LOCK = """
import fcntl, sys, time
with open(sys.argv[1], "a+") as f:
    fcntl.lockf(f, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_live_build_is_waited_for_but_not_for_ever() -> None:
    name = f"freight_int8_small_batch_cpu_{active_tier()}"
    lock_file = Path(_get_build_directory(name, verbose=False)) / "freight-build.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock_file)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(BuildLockTimeout, match="over 1 s"):
            with _build_lock(name, wait_s=1.0):
                pass
    finally:
        holder.kill()
        holder.wait()
    with _build_lock(name, wait_s=10.0):  # the holder's death released it
        pass


LOAD = "from kernels import cpu_int8_small_batch; assert cpu_int8_small_batch.available()"


def test_callers_with_different_paths_share_one_build() -> None:
    """A ninja that finds another version's build log rebuilds everything: a `freight` started with the venv's
    bin first on PATH and a plain `python` with the system's first must share one ninja (and one build)."""
    build = Path(_get_build_directory(f"freight_int8_small_batch_cpu_{active_tier()}", verbose=False))
    venv_bin = str(Path(sys.executable).parent)
    built = (build / "int8_small_batch_cpu.o").stat().st_mtime_ns
    for path in ("/usr/bin:/bin", f"{venv_bin}:/usr/bin:/bin", "/usr/bin:/bin"):
        env = {k: v for k, v in os.environ.items() if k != "PATH"} | {"PATH": path}
        subprocess.run([sys.executable, "-c", LOAD], check=True, env=env, timeout=300)
        assert (build / "int8_small_batch_cpu.o").stat().st_mtime_ns == built, f"rebuilt with PATH={path}"
