"""The compiled in-place rotary embedding (kernels/rope.py) against the torch expression it replaces, bit for
bit in bfloat16, on strided views of a fused qkv output (the engine's case) and partial rotary dims."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_int8_linear
from kernels.rope import rotate_, supports

pytestmark = pytest.mark.skipif(not cpu_int8_linear.available(), reason="no C++ toolchain to build the kernel")


def torch_rotation(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    part = x[..., :rot]
    swapped = part.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.cat((part * cos + swapped * signed_sin, x[..., rot:]), dim=-1)


# head_dim 64 and 128 whole (vector loop), 96 with 72 rotary dims (Phi-style partial: a scalar tail of 4)
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim", "rot"), [(1, 9, 3, 64, 64), (37, 4, 2, 128, 128),
                                                                             (5, 2, 1, 96, 72)])  # fmt: skip
def test_in_place_rotation_equals_the_torch_expression(tokens, heads, kv_heads, head_dim, rot):
    gen = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 4).bfloat16()
    angles = torch.rand(tokens, 1, rot // 2, generator=gen) * 100
    cos = torch.cat((angles.cos(), angles.cos()), -1).bfloat16()
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1).bfloat16()
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    want = torch_rotation(qk, cos, signed_sin)
    values = qkv[:, (heads + kv_heads) * head_dim :].clone()
    assert supports(qk, cos)
    assert rotate_(qk, cos, signed_sin) is qk
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], values)  # the values are not touched


def test_refuses_what_it_does_not_run():
    x = torch.randn(2, 3, 64)
    cos = torch.ones(2, 1, 64)
    assert not supports(x, cos)  # float32 keeps the torch ops
    with pytest.raises(ValueError, match="bfloat16"):
        rotate_(x, cos, cos)
