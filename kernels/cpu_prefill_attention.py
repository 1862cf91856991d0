"""Causal prefill attention over packed chunks as a compiled CPU kernel (built on first use; see
csrc/prefill_attention_cpu.cpp).

torch's CPU flash attention reaches about 50-100 GFLOP/s on these shapes (one call per sequence, head_dim
64); the kernels run every chunk of the step in one parallel call, over the step's own keys and values
with, for a chunk after a cached prefix, the prefix's keys and values in front (the caller gathers them).
Two of them, by query dtype: bfloat16 with AVX-512 BF16 dot products, and float32 with AVX2 + FMA
(every x86 build tier from AVX2 up), each for head_dim 64, 128 or 256. Everything else keeps the torch path.
Both take a sliding window (each query sees its last `window` context rows, itself included) and
attention-logit soft-capping (each score s becomes soft_cap * tanh(s / soft_cap)).
Where the CPU has AMX (Sapphire Rapids and later) bfloat16 runs on AMX tiles instead, several times the
AVX-512 BF16 kernel (docs/benchmarks.md; amx_enabled(); platform.amx_allowed() can turn it off).
On a 2-core Zen 3 (AVX2) the float32 kernel takes 15 prompts of 4,200 tokens in all (9 heads, 3 kv heads,
head_dim 64) in about 13 ms, 110 GFLOP/s; SDPA per sequence takes about 30 ms.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from kernels._cpu_build import build_extension
from kernels.platform import amx_allowed

HEAD_DIMS = (64, 128, 256)


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


@functools.cache
def amx_enabled() -> bool:
    """Whether bfloat16 head_dim-64 prefill runs on AMX tiles: the CPU and OS allow it and
    platform.amx_allowed()."""
    extension = load_extension()
    return extension is not None and extension.available_amx() and amx_allowed()


def supports(query: torch.Tensor, key: torch.Tensor | None) -> bool:
    return (
        key is not None
        and query.device.type == "cpu"
        and query.shape[-1] in HEAD_DIMS
        and available(query.dtype)
    )


def prefill_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32 or bfloat16
    key: torch.Tensor,  # [num_kv_rows, num_kv_heads, head_dim]
    value: torch.Tensor,
    q_starts: list[int],  # first query row of each chunk
    q_lens: list[int],  # its query rows
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim] in query dtype: those chunks' rows are written
    kv_starts: list[int] | None = None,  # first key row of each chunk's context (default: q_starts)
    kv_lens: list[int] | None = None,  # its context length >= q_len; its queries are the last q_len positions
    amx: bool | None = None,  # bfloat16 on AMX tiles; None: where amx_enabled()
    *,
    window: int = 0,  # > 0: the query at context index i sees context rows j with i - window < j <= i
    soft_cap: float = 0.0,  # > 0: each score s (scale applied) becomes soft_cap * tanh(s / soft_cap)
) -> None:
    """Causal attention of each chunk's queries over its context. Without kv_starts/kv_lens each chunk is
    its whole context (keys and values row-aligned with the queries); with them, a chunk's context may hold
    a prefix (e.g. gathered from the paged cache) before the keys of its own queries. With a window the
    context may start anywhere at or before its first query's window (rows before it are never read)."""
    if not available(query.dtype):
        raise RuntimeError(f"no CPU prefill-attention kernel for {query.dtype} in this build")
    if (kv_starts is None) != (kv_lens is None):
        raise ValueError("give both kv_starts and kv_lens, or neither")
    extension = load_extension()

    def int32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    args = (
        query.contiguous(),
        key.to(query.dtype).contiguous(),
        value.to(query.dtype).contiguous(),
        int32(q_starts),
        int32(q_lens),
        int32(q_starts if kv_starts is None else kv_starts),
        int32(q_lens if kv_lens is None else kv_lens),
        scale,
        out,
    )
    options = {"window": int(window), "soft_cap": float(soft_cap)}
    if query.dtype == torch.float32:
        extension.prefill_attention_f32(*args, **options)
        return
    use_amx = amx_enabled() if amx is None else amx
    if use_amx and not extension.available_amx():
        raise RuntimeError("AMX is not usable on this CPU")
    extension.prefill_attention_bf16(*args, use_amx, **options)
