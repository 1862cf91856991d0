"""`kernels` imports and runs its CPU paths without triton installed, loading the kernels already built."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.kernels.prebuilt import FORBID_BUILDING, REPORT_LOADED, build_files, built_here, prebuilt_env

REPO_ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import faulthandler
import sys
faulthandler.dump_traceback_later(100, exit=True)  # before the test's timeout: a hang shows where it is
sys.modules["triton"] = None  # makes `import triton` raise ImportError, as when it is not installed
import torch
import kernels
from kernels._triton import triton_available
assert not triton_available()
x = torch.randn(4, 32)
w_q, w_scale = kernels.quantize_weight_per_channel(torch.randn(8, 32))
y = kernels.int8_linear(x, w_q.t(), w_scale)
assert y.shape == (4, 8) and torch.isfinite(y).all()
kc = torch.zeros(2, 4, 1, 32, dtype=torch.int8)
vc = torch.zeros_like(kc)
ks, vs = torch.zeros(2, 4, 1), torch.zeros(2, 4, 1)
kernels.write_kv_cache(x[:2, None], x[2:, None], kc, vc, torch.tensor([0, 1]), ks, vs)
out = kernels.paged_decode_attention(
    torch.randn(1, 2, 32), kc, vc, torch.tensor([[0]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), 0.2, ks, vs
)
assert torch.isfinite(out).all()
print("ok")
"""


def test_kernels_work_without_triton():
    # The kernels this process has are the ones the triton-less subprocess must load: whether triton
    # imports is no input of a build. It may not compile (a cold build is minutes, over this timeout).
    built = built_here()
    before = build_files()
    result = subprocess.run(
        [sys.executable, "-c", FORBID_BUILDING + SCRIPT + REPORT_LOADED],
        cwd=REPO_ROOT,
        env=prebuilt_env(),  # run from REPO_ROOT, `tests` imports too
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["ok", f"loaded {built}"], result.stdout + result.stderr[-3000:]
    assert build_files() == before, "the subprocess changed a kernel build folder: it rebuilt"
