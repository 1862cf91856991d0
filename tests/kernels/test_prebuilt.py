"""A kernel build depends on no caller's environment, and FREIGHT_CPU_KERNELS=prebuilt loads only a build made
from this source with these flags, never compiling."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from kernels import _prebuilt
from kernels._cpu_build import _pinned_toolchain, build_extension
from kernels._prebuilt import stale_reason

NAME = "freight_demo_cpu_avx2"
FLAGS = ["-O3", "-mavx2", "-fopenmp"]


def fake_build(tmp_path: Path, *, source: Path, flags: list[str]) -> Path:
    """A build folder as torch leaves it: build.ninja naming the source and flags, then the library."""
    build = tmp_path / "build"
    build.mkdir()
    (build / "build.ninja").write_text(
        f"cflags = -DTORCH_EXTENSION_NAME={NAME} {' '.join(flags)}\nbuild demo.o: compile {source}\n"
    )
    (build / f"{NAME}.so").write_bytes(b"")
    return build


@pytest.fixture
def source(tmp_path: Path) -> Path:
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "common.h").write_text("// a header beside the source\n")
    path = csrc / "demo.cpp"
    path.write_text("// the kernel\n")
    past = os.stat(path).st_mtime_ns - 10**9  # built after its sources were written
    for name in ("demo.cpp", "common.h"):
        os.utime(csrc / name, ns=(past, past))
    return path


def test_a_build_of_this_source_with_these_flags_may_be_loaded(tmp_path: Path, source: Path) -> None:
    assert stale_reason(fake_build(tmp_path, source=source, flags=FLAGS), NAME, source, FLAGS) is None


def test_a_missing_foreign_flagless_or_older_build_is_refused(tmp_path: Path, source: Path) -> None:
    assert "does not exist" in stale_reason(tmp_path, NAME, source, FLAGS)
    other = fake_build(tmp_path, source=tmp_path / "elsewhere" / "demo.cpp", flags=FLAGS)
    assert "another source" in stale_reason(other, NAME, source, FLAGS)
    (other / "build.ninja").write_text(f"cflags = -O3\nbuild demo.o: compile {source}\n")
    assert "built without -mavx2 -fopenmp" in stale_reason(other, NAME, source, FLAGS)
    (other / "build.ninja").write_text(f"cflags = {' '.join(FLAGS)}\nbuild demo.o: compile {source}\n")
    (source.parent / "common.h").touch()  # a header changed after the build
    assert "older than common.h" in stale_reason(other, NAME, source, FLAGS)


def test_prebuilt_mode_never_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_build(*args, **kwargs):
        raise AssertionError("compiled under FREIGHT_CPU_KERNELS=prebuilt")

    monkeypatch.setenv("FREIGHT_CPU_KERNELS", "prebuilt")
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_build)
    monkeypatch.setattr(_prebuilt, "build_directory", lambda name: tmp_path / name)  # nothing built there
    with caplog.at_level(logging.WARNING, logger="kernels._cpu_build"):
        assert build_extension("freight_demo_cpu", "decode_attention_cpu.cpp", fast_math=True) is None
    assert "FREIGHT_CPU_KERNELS=prebuilt" in caplog.text and "scripts/build_kernels.sh" in caplog.text


def test_the_compile_command_does_not_depend_on_a_compiler_wrapper_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch puts a ccache found on PATH in front of the compiler, in build.ninja: a caller with one on PATH
    and a caller without would rebuild each other's kernels. Every build runs without a wrapper."""
    wrapper = tmp_path / "ccache"
    wrapper.write_text('#!/bin/sh\nexec "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.delenv("TORCH_NO_COMPILER_WRAPPER", raising=False)
    assert torch.utils.cpp_extension._wrap_compiler("c++") == ["ccache", "c++"]  # what torch would write
    with _pinned_toolchain():
        assert torch.utils.cpp_extension._wrap_compiler("c++") == ["c++"]
    assert "TORCH_NO_COMPILER_WRAPPER" not in os.environ  # the caller's environment is given back
