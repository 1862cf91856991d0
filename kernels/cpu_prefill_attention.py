"""Causal prefill attention for whole-context chunks as a compiled CPU kernel (built on first use; see
csrc/prefill_attention_cpu.cpp).

torch's CPU flash attention reaches about 50-100 GFLOP/s on these shapes (one call per sequence, head_dim
64); the kernels run every sequence of the step in one parallel call and read the step's own keys and
values. Two of them, by query dtype: bfloat16 with AVX-512 BF16 dot products, and float32 with AVX2 + FMA
(every x86 build tier from AVX2 up), each for head_dim 64 or 128. Everything else keeps the torch path.
On a 2-core Zen 3 (AVX2) the float32 kernel takes 15 prompts of 4,200 tokens in all (9 heads, 3 kv heads,
head_dim 64) in about 13 ms, 110 GFLOP/s; SDPA per sequence takes about 30 ms.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from kernels._cpu_build import build_extension

HEAD_DIMS = (64, 128)


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled module when it built, else None; which kernels it holds depends on the ISA it was built
    for (see available)."""
    return build_extension("freight_prefill_attention_cpu", "prefill_attention_cpu.cpp", fast_math=False)


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Whether this build has the kernel for `dtype` queries (float32 or bfloat16)."""
    extension = load_extension()
    if extension is None:
        return False
    if dtype == torch.float32:
        return extension.available_f32()
    if dtype == torch.bfloat16:
        return extension.available_bf16()
    return False


def supports(query: torch.Tensor, key: torch.Tensor | None) -> bool:
    return (
        key is not None
        and query.device.type == "cpu"
        and query.shape[-1] in HEAD_DIMS
        and available(query.dtype)
    )


def prefill_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32 or bfloat16
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    seq_starts: list[int],  # first row of each sequence to attend
    seq_lens: list[int],  # its length: the chunk is the sequence's whole context
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim] in query dtype: those sequences' rows are written
) -> None:
    if not available(query.dtype):
        raise RuntimeError(f"no CPU prefill-attention kernel for {query.dtype} in this build")
    extension = load_extension()
    f32 = query.dtype == torch.float32
    attend = extension.prefill_attention_f32 if f32 else extension.prefill_attention_bf16
    attend(
        query.contiguous(),
        key.to(query.dtype).contiguous(),
        value.to(query.dtype).contiguous(),
        torch.tensor(seq_starts, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        scale,
        out,
    )
