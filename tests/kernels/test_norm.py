"""RMSNorm: the compiled CPU pass for bfloat16 rows against the torch ops (LlamaRMSNorm's order), the
dispatch, the argument checks, and the pass fused with per-token quantization against the two unfused."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_int8_linear, rms_norm
from kernels.norm import rms_norm_cpu, rms_norm_quantize_cpu, rms_norm_torch

needs_extension = pytest.mark.skipif(not cpu_int8_linear.available(), reason="needs a C++ toolchain")


def random_rows(rows: int, hidden: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * torch.rand(rows, 1, generator=gen) * 8).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    return x, weight


@needs_extension
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("hidden", [576, 37], ids=["576", "tail"])
def test_compiled_pass_matches_the_torch_ops(dtype, hidden):
    x, weight = random_rows(33, hidden, dtype, seed=hidden)
    got = rms_norm_cpu(x, weight, 1e-5)
    want = rms_norm_torch(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        # the float32 sum of squares runs in another order: at most one bfloat16 step apart, rarely
        diff = (got.float() - want.float()).abs()
        step = want.float().abs() * 2**-7
        assert (diff <= step + 1e-6).all() and (diff > 0).float().mean() < 0.02


@needs_extension
def test_bfloat16_on_cpu_takes_the_compiled_pass_and_float32_the_torch_ops(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "kernels.norm.rms_norm_cpu", lambda *args: calls.append("compiled") or rms_norm_torch(*args)
    )
    x, weight = random_rows(4, 64, torch.bfloat16, seed=1)
    rms_norm(x, weight, 1e-6)
    assert calls == ["compiled"]
    x32, weight32 = random_rows(4, 64, torch.float32, seed=1)
    assert torch.equal(rms_norm(x32, weight32, 1e-6), rms_norm_torch(x32, weight32, 1e-6))  # bit for bit
    assert calls == ["compiled"]


def test_bad_weights_are_refused():
    x, weight = random_rows(2, 16, torch.float32, seed=2)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, weight[:8], 1e-6)
    with pytest.raises(ValueError, match="x's dtype"):
        rms_norm(x, weight.bfloat16(), 1e-6)


@needs_extension
@pytest.mark.parametrize("rows", [1, 33, 300])
@pytest.mark.parametrize("hidden", [576, 640, 37], ids=["576", "640", "tail"])
def test_fused_norm_and_quantization_give_the_unfused_codes_bit_for_bit(rows, hidden):
    x, weight = random_rows(rows, hidden, torch.bfloat16, seed=rows + hidden)
    codes, scales = rms_norm_quantize_cpu(x, weight, 1e-6)
    want_codes, want_scales = cpu_int8_linear.quantize_per_token_cpu(rms_norm(x, weight, 1e-6))
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)


@needs_extension
def test_fused_norm_and_quantization_refuse_what_they_do_not_fuse():
    x, weight = random_rows(4, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="bfloat16"):
        rms_norm_quantize_cpu(x, weight, 1e-6)  # float32 rms_norm is torch's, in another order
    with pytest.raises(ValueError, match=r"weight must be \[64\]"):
        rms_norm_quantize_cpu(x.bfloat16(), weight[:32].bfloat16(), 1e-6)
