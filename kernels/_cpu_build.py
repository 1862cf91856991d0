"""Builds the compiled CPU kernels (C++ with OpenMP) on first use, through torch.utils.cpp_extension.

Each kernel is compiled for a named ISA tier (kernels/platform.py), never with -march=native: the build of
one tier runs on every machine of that tier, and a forced lower tier (FREIGHT_CPU_ISA=avx2) gets its own
build beside the native one. The sources pick their code paths by the feature macros those flags define.

A C++ compiler and ninja are needed; when the build fails, or FREIGHT_CPU_KERNELS=0, callers fall back
to their torch paths, so a machine without a toolchain still runs (slower). FREIGHT_CPU_KERNELS=prebuilt
loads what an earlier build made and never compiles (kernels/_prebuilt.py): a test's subprocess runs so.

What a build depends on is the source, the flags below and the toolchain, never the caller's environment:
torch rebuilds whenever the build.ninja it writes, or the ninja that reads its log, differs from the last
build's, so a caller that saw another PATH would recompile for minutes (a test's subprocess once did,
under its timeout). Hence one ninja and no compiler wrapper, whatever PATH holds (_pinned_toolchain).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import platform as _platform
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import IO

from kernels._prebuilt import PREBUILT, NotPrebuilt, load_prebuilt
from kernels.platform import active_tier

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"

_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
TIER_CFLAGS: dict[str, list[str]] = {
    "generic": [],
    "avx2": _AVX2,
    "avx512vnni": [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"],
    "avx512": [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16"],
}


def tier_cflags(tier: str) -> list[str]:
    # the generic tier of a non-x86 machine still compiles for its own baseline (no -m flags)
    return TIER_CFLAGS[tier] if _platform.machine() in ("x86_64", "AMD64") else []


# torch's build takes a lock file beside the build and waits, without end, for it to go; a process killed
# mid-build (a worker stopped during its first start, a test's subprocess past its timeout) leaves it
# behind and every later start hangs. So every build of ours runs under a lock of our own, which the
# kernel releases when its holder dies: holding it, a torch lock file can only be a dead build's.
# It is a POSIX record lock (lockf), not flock: a child forked while a build runs (a Celery pool, a
# server) does not inherit it, so it cannot keep the lock held for as long as it lives.
BUILD_LOCK_WAIT_S = 900.0  # a cold build of one kernel on two busy cores takes a few minutes at most


class BuildLockTimeout(RuntimeError):
    pass


@contextlib.contextmanager
def _build_lock(module_name: str, wait_s: float = BUILD_LOCK_WAIT_S) -> Iterator[None]:
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(module_name, verbose=False))
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "freight-build.lock", "a+") as ours:
        _acquire(ours, module_name, wait_s)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build of %s that never finished", stale, module_name)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.lockf(ours, fcntl.LOCK_UN)


def _acquire(lock_file: IO[str], module_name: str, wait_s: float) -> None:
    """Waits for another process's build of the same module, but not for ever."""
    deadline = time.monotonic() + wait_s
    logged = False
    while True:
        try:
            fcntl.lockf(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise BuildLockTimeout(
                    f"another process has been building {module_name} for over {wait_s:.0f} s"
                ) from None
            if not logged:
                log.info("waiting for another process's build of %s", module_name)
                logged = True
            time.sleep(0.2)


@contextlib.contextmanager
def _pinned_toolchain() -> Iterator[None]:
    """torch runs whichever `ninja` PATH finds first. Ninja versions keep different build logs, and one that
    reads another's log discards it and rebuilds everything (minutes per kernel): a build started from the
    venv's `freight` (venv bin first on PATH) and one from plain `python` (the system's ninja) would rebuild
    each other's. So every build runs the ninja of the `ninja` package, a dependency, whatever PATH says.
    Likewise torch puts ccache or sccache in front of the compiler when PATH has one, which changes the
    compile command in build.ninja and so rebuilds: no wrapper, for every caller."""
    import ninja

    pinned = {
        "PATH": os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")]),
        "TORCH_NO_COMPILER_WRAPPER": "1",
    }
    before = {name: os.environ.get(name) for name in pinned}
    os.environ.update(pinned)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def build_extension(name: str, source: str, *, fast_math: bool) -> ModuleType | None:
    """The compiled module for csrc/`source` at the active ISA tier, or None when it cannot be built here.

    fast_math lets the compiler vectorize libm calls (expf) and reassociate sums; kernels that must
    match torch bit for bit (an exact division before rounding) are built without it.
    """
    mode = os.environ.get("FREIGHT_CPU_KERNELS", "1")
    if mode == "0":
        return None
    tier = active_tier()
    module_name = f"{name}_{tier}"
    cflags = ["-O3", *tier_cflags(tier), "-fopenmp", *(["-ffast-math"] if fast_math else [])]
    try:
        if mode == PREBUILT:
            return load_prebuilt(module_name, CSRC / source, cflags)
        from torch.utils.cpp_extension import load

        with _build_lock(module_name), _pinned_toolchain():
            return load(
                name=module_name,
                sources=[str(CSRC / source)],
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(CSRC)],
                verbose=False,
            )
    except NotPrebuilt as exc:
        log.warning("CPU kernel %s (%s tier) not loaded, FREIGHT_CPU_KERNELS=prebuilt: %s", name, tier, exc)
        return None
    except Exception as exc:  # a missing compiler or ninja must not stop the engine
        log.warning("CPU kernel %s (%s tier) unavailable (%s); using the torch path", name, tier, exc)
        return None
