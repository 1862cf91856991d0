"""Causal prefill attention for whole-context chunks as a compiled CPU kernel (AVX-512 BF16, built on
first use; see csrc/prefill_attention_cpu.cpp).

torch's CPU flash attention reaches about 50-100 GFLOP/s on these shapes (one call per sequence, head_dim
64); the kernel uses bf16 dot-product instructions, runs every sequence of the step in one parallel call
and reads the step's own keys and values. It serves bfloat16 queries with head_dim 64 or 128 on CPUs with
AVX-512 BF16; everything else keeps the torch path.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from kernels._cpu_build import build_extension


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled module when it built and this CPU has AVX-512 BF16, else None."""
    extension = build_extension("freight_prefill_attention_cpu", "prefill_attention_cpu.cpp", fast_math=False)
    return extension if extension is not None and extension.available() else None


def supports(query: torch.Tensor, key: torch.Tensor | None) -> bool:
    return (
        key is not None
        and query.device.type == "cpu"
        and query.dtype == torch.bfloat16
        and query.shape[-1] in (64, 128)
        and load_extension() is not None
    )


def prefill_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] bfloat16
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    seq_starts: list[int],  # first row of each sequence to attend
    seq_lens: list[int],  # its length: the chunk is the sequence's whole context
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim] bfloat16: those sequences' rows are written
) -> None:
    extension = load_extension()
    if extension is None:
        raise RuntimeError("the CPU prefill-attention extension is not available")
    extension.prefill_attention_bf16(
        query.contiguous(),
        key.to(torch.bfloat16).contiguous(),
        value.to(torch.bfloat16).contiguous(),
        torch.tensor(seq_starts, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        scale,
        out,
    )
