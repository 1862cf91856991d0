"""Loads a compiled CPU kernel that an earlier build made, without ever running the compiler.

FREIGHT_CPU_KERNELS=prebuilt selects this. A process that must not spend minutes compiling (a test's
subprocess under a timeout, a worker on a busy machine) loads the module torch's build left in its build
folder, or gets None with the reason logged, so its caller takes the torch path. It never calls
torch.utils.cpp_extension.load, whose ninja run recompiles when anything in its inputs differs.

A build is usable only if it was made from this checkout's source with these flags and is not older
than the source or any header beside it: otherwise loading it would run code the source no longer says.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType

PREBUILT = "prebuilt"  # the value of FREIGHT_CPU_KERNELS that forbids building
HEADER_SUFFIXES = (".h", ".hpp")


class NotPrebuilt(RuntimeError):
    """No usable build of the kernel exists, and building one is forbidden here."""


def build_directory(module_name: str) -> Path:
    # torch's own rule, so the folder is the one its builds write (TORCH_EXTENSIONS_DIR, python, accelerator)
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(module_name, verbose=False))


def library_path(build_dir: Path, module_name: str) -> Path:
    return build_dir / f"{module_name}.so"


def stale_reason(build_dir: Path, module_name: str, source: Path, cflags: list[str]) -> str | None:
    """Why the build in `build_dir` must not be loaded for `source` compiled with `cflags`; None if it may."""
    library = library_path(build_dir, module_name)
    if not library.exists():
        return f"{library} does not exist"
    try:
        ninja = (build_dir / "build.ninja").read_text()
    except OSError:
        return f"{build_dir} has no build.ninja"
    if f"compile {source.absolute()}" not in ninja:  # torch writes the source's absolute path
        return f"{library} was built from another source than {source} (another checkout?)"
    built_flags = next((line.split() for line in ninja.splitlines() if line.startswith("cflags =")), [])
    missing = [flag for flag in cflags if flag not in built_flags]
    if missing:
        return f"{library} was built without {' '.join(missing)}"
    inputs = [source, *(p for p in source.parent.iterdir() if p.suffix in HEADER_SUFFIXES)]
    newer = [p.name for p in inputs if p.stat().st_mtime_ns > library.stat().st_mtime_ns]
    if newer:
        return f"{library} is older than {', '.join(sorted(newer))}"
    return None


def load_prebuilt(module_name: str, source: Path, cflags: list[str]) -> ModuleType:
    """The module an earlier build of `source` made, imported as torch would import it; NotPrebuilt when
    there is none usable."""
    build_dir = build_directory(module_name)
    reason = stale_reason(build_dir, module_name, source, cflags)
    if reason is not None:
        raise NotPrebuilt(f"{reason}; build it first (bash scripts/build_kernels.sh)")
    library = library_path(build_dir, module_name)
    loader = importlib.machinery.ExtensionFileLoader(module_name, str(library))
    spec = importlib.util.spec_from_file_location(module_name, library, loader=loader)
    assert spec is not None  # a file location with an explicit loader always gives a spec
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
